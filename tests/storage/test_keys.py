"""Object keys come only from validated components."""

from __future__ import annotations

import pytest

from hsx_extractor.storage.layout import (
    InvalidKeyError,
    RunLayout,
    parse_output_uri,
    split_run_uri,
    validate_prefix,
)


def test_layout_is_deterministic() -> None:
    layout = RunLayout("team/hsx", "run-1")
    assert (
        layout.shard_key(7, "0123456789abcdef")
        == "team/hsx/run-1/shards/shard-000007-0123456789abcdef.safetensors"
    )
    assert layout.shard_of_key(layout.shard_key(7, "0123456789abcdef")) == 7
    assert layout.shard_of_key("team/hsx/run-1/shards/shard-000007.safetensors.tmp") is None
    assert layout.commit_key(7) == "team/hsx/run-1/commits/shard-000007.json"
    assert layout.manifest_key == "team/hsx/run-1/manifest.json"
    assert layout.shard_of_commit_key(layout.commit_key(123)) == 123
    assert layout.shard_of_commit_key("team/hsx/run-1/commits/other.json") is None


@pytest.mark.parametrize(
    "prefix", ["a/../b", "..", "a/..", "/abs/path", "a//b", "./a", "a/.hidden", "a/b\\c", "a/\x00", "a/b c"]
)
def test_unsafe_prefixes_are_rejected(prefix: str) -> None:
    with pytest.raises(InvalidKeyError):
        validate_prefix(prefix)


@pytest.mark.parametrize(
    "uri",
    [
        "s3://bucket/a/../b",
        "s3://b_ad/x",
        "s3://ab/x",
        "s3://bucket/x?y=1",
        "http://bucket/x",
        "/data/../etc",
    ],
)
def test_bad_output_uris_are_rejected(uri: str) -> None:
    with pytest.raises(InvalidKeyError):
        parse_output_uri(uri)


def test_bad_run_ids_and_shard_indices_are_rejected() -> None:
    for run_id in ("../x", "Run", "a/b", "manifest", ""):
        with pytest.raises(InvalidKeyError):
            RunLayout("p", run_id)
    with pytest.raises(InvalidKeyError):
        RunLayout("p", "r").shard_key(-1, "0123456789abcdef")
    with pytest.raises(InvalidKeyError):
        RunLayout("p", "r").shard_key(1, "../../manifest")
    with pytest.raises(InvalidKeyError):
        RunLayout("p", "r").key("../manifest.json")


def test_uris_split() -> None:
    loc = parse_output_uri("s3://my-bucket/team/out/")
    assert (loc.bucket, loc.prefix) == ("my-bucket", "team/out")
    assert parse_output_uri("file:///data/out").bucket is None
    assert split_run_uri("s3://my-bucket/team/run-1/") == ("s3://my-bucket/team", "run-1")
    with pytest.raises(InvalidKeyError):
        split_run_uri("s3://run-1")

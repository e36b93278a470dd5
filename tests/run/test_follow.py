"""Trainers read a run while it grows (issue 34, item 5): ``HiddenStatesDataset(uri, follow=True)``
started before the run's first commit yields every sample exactly once, some of them before the run
ends, and stops at the manifest; DataLoader workers and ranks split the shards without overlap; a run
that stops without a manifest raises RunStalled after the committed samples; a manifest that lists
other shards than were read is refused."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hsx_extractor import FollowedRun, HiddenStatesDataset, RunStalled
from hsx_extractor.config import ExtractConfig
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.run.runner import extract
from hsx_extractor.storage.manifest import ManifestError

from .helpers import RefServer, base_config, chat_rows, write_jsonl

ROWS = 120


def start_run(tmp_path: Path, ref_server: RefServer, rows: list[Any]) -> tuple[threading.Thread, list[Any]]:
    """An extraction in a thread; its (exit code, result) lands in the returned list."""
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    cfg = ExtractConfig.model_validate(base_config(tmp_path, ref_server, dataset))
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(asyncio.run(extract(cfg))), daemon=True)
    thread.start()
    return thread, outcome


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, _session_server: RefServer) -> Path:
    """A finished run of ROWS rows over several shards: ``{output}/run``."""
    tmp = tmp_path_factory.mktemp("finished")
    _session_server.wait_idle()
    thread, outcome = start_run(tmp, _session_server, chat_rows(ROWS, words=30))
    thread.join(timeout=300)
    assert outcome and outcome[0][0] == EXIT_OK, outcome
    assert len(outcome[0][1].manifest["shards"]) >= 3, outcome[0][1].manifest["shards"]
    return tmp / "out" / "run"


def test_a_follower_started_before_the_first_commit_reads_each_sample_once_as_shards_land(
    tmp_path: Path, ref_server: RefServer
) -> None:
    ref_server.set_fault(None, delay_ms=100)  # ~3 s of requests, so shards land while the follower waits
    run_dir = tmp_path / "out" / "run"
    follower = FollowedRun(str(run_dir), poll_seconds=0.05, idle_timeout_seconds=120)
    thread, outcome = start_run(tmp_path, ref_server, chat_rows(ROWS, words=30))
    read: list[int] = []
    shards_before_manifest: set[int] = set()
    shards: set[int] = set()
    for _, commit, _, entry in follower.entries():
        read.append(entry.index)
        shards.add(commit.shard_index)
        if not (run_dir / "manifest.json").exists():
            shards_before_manifest.add(commit.shard_index)
    thread.join(timeout=300)
    assert outcome and outcome[0][0] == EXIT_OK, outcome
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert sorted(read) == list(range(ROWS)), "every sample exactly once"
    assert shards == {s["index"] for s in manifest["shards"]} and len(shards) >= 3, manifest["shards"]
    assert shards_before_manifest, "nothing was read before the run ended: the follower did not follow"


def test_items_equal_the_map_style_readers_and_dataloader_workers_split_the_shards(finished: Path) -> None:
    whole = HiddenStatesDataset(str(finished))
    want = {tuple(item["input_ids"].tolist()): item for item in (whole[i] for i in range(len(whole)))}
    followed = HiddenStatesDataset(str(finished), follow=True, poll_seconds=0.05)
    assert isinstance(followed, FollowedRun)
    loader = torch.utils.data.DataLoader(followed, batch_size=None, num_workers=2)
    got: dict[tuple[int, ...], dict[str, torch.Tensor]] = {}
    for item in loader:
        key = tuple(item["input_ids"].tolist())
        assert key not in got, "a sample came twice through the workers"
        got[key] = item
    assert got.keys() == want.keys() and len(got) == ROWS
    for key, item in got.items():
        for name in ("loss_mask", "hidden_state", "aux_hidden_state"):
            assert item[name].dtype == want[key][name].dtype and item[name].shape == want[key][name].shape
            assert torch.equal(item[name].view(torch.int16), want[key][name].view(torch.int16)), name


def test_ranks_read_disjoint_shares_that_cover_the_run(finished: Path) -> None:
    shares = [
        [entry.index for _, _, _, entry in FollowedRun(str(finished), rank=r, world_size=3).entries()] for r in range(3)
    ]
    assert all(shares) and sorted(i for share in shares for i in share) == list(range(ROWS))
    with pytest.raises(ValueError, match="rank 3"):
        FollowedRun(str(finished), rank=3, world_size=3)
    with pytest.raises(TypeError, match="by keyword"):
        HiddenStatesDataset(str(finished), None, True, follow=True)


def test_a_run_that_stops_without_a_manifest_raises_after_its_committed_samples(finished: Path, tmp_path: Path) -> None:
    stopped = tmp_path / "stopped" / "run"
    shutil.copytree(finished, stopped)
    (stopped / "manifest.json").unlink()
    follower = FollowedRun(str(stopped), poll_seconds=0.05, idle_timeout_seconds=0.5)
    read: list[int] = []
    started = time.monotonic()
    with pytest.raises(RunStalled, match="no shard committed and no manifest"):
        for _, _, _, entry in follower.entries():
            read.append(entry.index)
    assert sorted(read) == list(range(ROWS)) and time.monotonic() - started < 60


def test_a_manifest_listing_other_shards_is_refused(finished: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered" / "run"
    shutil.copytree(finished, tampered)
    manifest = json.loads((tampered / "manifest.json").read_text())
    manifest["shards"] = manifest["shards"][1:]  # a committed shard the manifest does not list
    (tampered / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=r"not in the manifest \[0\]"):
        list(FollowedRun(str(tampered), poll_seconds=0.05).entries())

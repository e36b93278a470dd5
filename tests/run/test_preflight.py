"""``hsx preflight`` (issue 18 item 4): what would stop a run is found with no inference server,
against the real tokenizer, the real S3 server and a fault proxy that drops conditional writes."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.tools.cli import main
from tests.ground.s3 import S3Server
from tests.run.helpers import chat_rows, write_jsonl
from tests.storage.faultproxy import FaultPlan, FaultProxy

# Nothing listens here: preflight must not need the server.
NO_SERVER = "http://127.0.0.1:9"


def config(tmp_path: Path, model: Path, **over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "runId": "r1",
        "modelPath": str(model),
        "serverUrl": NO_SERVER,
        "dataset": {"uri": str(write_jsonl(tmp_path / "chat.jsonl", chat_rows(3))), "maxLength": 512},
        "output": {"uri": str(tmp_path / "out")},
        "dumpDir": str(tmp_path / "shm" / "hsx"),
        "terminationMessagePath": str(tmp_path / "termination-log"),
    }
    for dotted, value in over.items():
        node = cfg
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return cfg


def preflight(tmp_path: Path, cfg: dict[str, Any]) -> int:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return main(["preflight", "--config", str(path)])


def test_a_good_configuration_passes_every_check_without_a_server(
    tmp_path: Path, tiny_model: Path, capsys: Any
) -> None:
    (tmp_path / "shm").mkdir()
    assert preflight(tmp_path, config(tmp_path, tiny_model)) == EXIT_OK
    out = capsys.readouterr().out
    for check in ("tokenizer ok", "model ok", "dataset ok", "output ok", "dump directory ok"):
        assert f"hsx preflight: {check}" in out, out
    assert "rows render)" in out
    # The shared dump directory exists, made for both containers' users, before the server starts.
    assert stat.S_IMODE((tmp_path / "shm" / "hsx").stat().st_mode) == 0o777
    assert not (tmp_path / "termination-log").exists()


@pytest.mark.parametrize(
    ("case", "over", "words"),
    [
        ("no-tokenizer", {"modelPath": "/nonexistent/model"}, "/nonexistent/model"),
        ("aux-layer-out-of-range", {"auxLayerIds": [1, 99]}, "aux layer ids [1, 99]"),
        ("dataset-missing", {"dataset.uri": "/nonexistent/chat.jsonl"}, "/nonexistent/chat.jsonl"),
        ("output-bucket-invalid", {"output.uri": "s3://Not_A_Bucket/x"}, "not a valid S3 bucket name"),
    ],
)
def test_what_would_stop_the_run_fails_preflight_permanently_with_the_reason(
    tmp_path: Path, tiny_model: Path, capsys: Any, case: str, over: dict[str, Any], words: str
) -> None:
    (tmp_path / "shm").mkdir()
    assert preflight(tmp_path, config(tmp_path, tiny_model, **over)) == EXIT_PERMANENT, case
    err = capsys.readouterr().err
    assert "hsx preflight: error:" in err and words in err, err
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("preflight failed: ") and words in message


def test_an_empty_dataset_fails_preflight(tmp_path: Path, tiny_model: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    cfg = config(tmp_path, tiny_model, **{"dataset.uri": str(tmp_path / "empty.jsonl")})
    assert preflight(tmp_path, cfg) == EXIT_PERMANENT
    assert "has no rows" in (tmp_path / "termination-log").read_text()


def test_a_bad_first_row_is_reported_not_fatal(tmp_path: Path, tiny_model: Path, capsys: Any) -> None:
    bad = tmp_path / "bad.jsonl"
    good = {"id": "g", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]}
    bad.write_text(json.dumps({"id": "x", "messages": "not a list"}) + "\n" + json.dumps(good) + "\n")
    cfg = config(tmp_path, tiny_model, **{"dataset.uri": str(bad)})
    assert preflight(tmp_path, cfg) == EXIT_OK  # one malformed row is quarantined, not a config error
    assert "1 of its first 2 rows will be quarantined: line 1: invalid_row" in capsys.readouterr().out


def test_a_dataset_whose_every_sampled_row_is_rejected_fails_preflight(tmp_path: Path, tiny_model: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps({"id": f"x{i}", "messages": []}) + "\n" for i in range(30)))
    cfg = config(tmp_path, tiny_model, **{"dataset.uri": str(bad)})
    assert preflight(tmp_path, cfg) == EXIT_PERMANENT
    message = (tmp_path / "termination-log").read_text()
    assert "DatasetRejected: all 20 of the first rows" in message and "line 1: empty_messages" in message


def test_s3_output_reachable_with_conditional_writes_passes(
    tmp_path: Path, tiny_model: Path, s3_env: S3Server, s3_bucket: str
) -> None:
    out = {"uri": f"s3://{s3_bucket}/hs", "endpoint": s3_env.endpoint, "pathStyle": True}
    assert preflight(tmp_path, config(tmp_path, tiny_model, output=out)) == EXIT_OK
    assert "Contents" not in s3_env.client().list_objects_v2(Bucket=s3_bucket)  # the probe cleaned up


def test_a_store_that_ignores_conditional_writes_fails_preflight(
    tmp_path: Path, tiny_model: Path, s3_env: S3Server, s3_bucket: str
) -> None:
    plan = FaultPlan(seed=0, rate=0.0, strip_if_none_match=True, secret_key=s3_env.secret_key)
    with FaultProxy(s3_env.endpoint, plan) as proxy:
        out = {"uri": f"s3://{s3_bucket}/hs", "endpoint": proxy.endpoint, "pathStyle": True}
        assert preflight(tmp_path, config(tmp_path, tiny_model, output=out)) == EXIT_PERMANENT
    assert "ignores conditional writes" in (tmp_path / "termination-log").read_text()


def test_wrong_credentials_fail_preflight(
    tmp_path: Path, tiny_model: Path, s3_env: S3Server, s3_bucket: str, monkeypatch: Any
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    out = {"uri": f"s3://{s3_bucket}/hs", "endpoint": s3_env.endpoint, "pathStyle": True}
    assert preflight(tmp_path, config(tmp_path, tiny_model, output=out)) == EXIT_PERMANENT
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("preflight failed: ") and "the secret key is wrong" in message


def test_a_prompt_only_dataset_passes_when_responses_are_regenerated(tmp_path: Path, tiny_model: Path, capsys: Any) -> None:
    """Rows without an assistant turn are what a regenerating run starts from: preflight judges them as the run
    will (their generation prompts), not as samples with no loss."""
    (tmp_path / "shm").mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}"}]}) + "\n"
                               for i in range(3)))  # fmt: skip
    cfg = config(tmp_path, tiny_model, **{"dataset.uri": str(prompts)})
    assert preflight(tmp_path, cfg) == EXIT_PERMANENT  # as samples, all of them would be set aside
    assert "no_assistant_tokens" in capsys.readouterr().err
    assert preflight(tmp_path, {**cfg, "responses": "regenerate"}) == EXIT_OK
    assert "rows render)" in capsys.readouterr().out

"""`hsx ls` and `hsx show` on real runs (the session's reference server): what a person looks at (issue 31, item 5)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from hsx_extractor.contract import EXIT_OK, EXIT_PERMANENT
from hsx_extractor.tools.cli import main
from hsx_extractor.tools.runs import _pooled
from tests.run.helpers import RefServer, chat_rows, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def runs(tmp_path: Path, ref_server: RefServer) -> Path:
    """An output root with a finished run (two malformed rows) and one that has committed shards only."""
    rows = [*chat_rows(10), "not json", {"id": "e", "messages": []}]
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    root = tmp_path / "out"
    argv = ["extract", "--run-id", "done", "--dataset", str(dataset), "--output", str(root), "--model",
            str(ref_server.model), "--server-url", ref_server.url, "--dump-dir", str(ref_server.dump_dir),
            "--progress-port", "0", "--max-length", "512", "--shard-target-bytes", str(1 << 20)]  # fmt: skip
    assert main(argv) == EXIT_OK
    shutil.copytree(root / "done", root / "half")
    (root / "half" / "manifest.json").unlink()
    return root


def test_ls_lists_each_run_with_its_state(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["ls", str(runs)]) == EXIT_OK
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["RUN", "STATE", "SAMPLES", "QUARANTINED", "SHARDS", "BYTES"]
    by_run = {line.split()[0]: line.split() for line in table[1:]}
    manifest = json.loads((runs / "done" / "manifest.json").read_text())
    stored = sum(s["bytesStored"] for s in manifest["shards"])
    assert by_run["done"][1:] == ["finished", "10", "2", f"{len(manifest['shards'])}/{len(manifest['shards'])}", f"{stored:,}"]
    assert by_run["half"][1:3] == ["running", "10"]
    assert main(["ls", str(runs), "--json"]) == EXIT_OK
    listed = {r["uri"].rsplit("/", 1)[-1]: r for r in json.loads(capsys.readouterr().out)}
    assert listed["done"]["bytes_stored"] == stored and listed["half"]["state"] == "running"


def test_show_gives_reasons_with_their_lines_and_pooled_layer_norms(runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["show", str(runs / "done"), "--json"]) == EXIT_OK
    info = json.loads(capsys.readouterr().out)
    reasons = {r["reason"]: r for r in info["quarantineReasons"]}
    assert reasons["invalid_json"]["count"] == 1 and reasons["invalid_json"]["examples"][0]["line"] == 11
    assert reasons["empty_messages"]["examples"][0]["sampleId"] == "e"
    manifest = json.loads((runs / "done" / "manifest.json").read_text())
    assert [n["layer"] for n in info["layerNorms"]] == [*map(str, manifest["capture"]["layerIds"]), "final"]
    finals = [s["layerNorms"]["final"] for s in manifest["shards"]]
    assert info["layerNorms"][-1]["tokens"] == sum(f["tokens"] for f in finals)
    assert info["layerNorms"][-1]["max"] == max(f["max"] for f in finals)
    assert main(["show", str(runs / "done")]) == EXIT_OK
    text = capsys.readouterr().out
    assert "10 written, 2 quarantined, 12 rows read" in text and "line 11" in text and "final" in text
    assert main(["show", str(runs / "half")]) == EXIT_PERMANENT
    assert "is not finished" in capsys.readouterr().err
    assert main(["show", str(runs / "absent")]) == EXIT_PERMANENT
    assert "no hsx run there" in capsys.readouterr().err


def test_pooled_norms_are_the_token_weighted_moments() -> None:
    a = {"tokens": 2, "mean": 1.0, "std": 0.0, "min": 1.0, "max": 1.0}
    b = {"tokens": 2, "mean": 3.0, "std": 0.0, "min": 3.0, "max": 3.0}
    pooled = _pooled([a, b])
    assert pooled is not None and pooled["mean"] == 2.0 and math.isclose(pooled["std"], 1.0)
    assert (pooled["min"], pooled["max"], pooled["tokens"]) == (1.0, 3.0, 4)
    assert _pooled([]) is None

"""`hsx estimate` against what a real run writes: `hsx extract` on `hsx serve-reference` with the tiny model.

Three runs of the bundled example dataset (malformed and too-long rows included):
compression none (the estimate must match the bytes on disk), a 10-row bf16-zstd trial run that
measures the compression ratio, and the full bf16-zstd run the trial's ratio must predict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.storage.shard_format import header_length, parse_header
from hsx_extractor.tools.demo import reference_server
from hsx_extractor.tools.tinymodel import build_tiny_model, example_dataset_path

pytestmark = pytest.mark.slow

MAX_LENGTH = 256
SHARD_TARGET = 1 << 20
TOLERANCE = 0.03  # "within a few percent"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    dumps = tmp_path_factory.mktemp("dumps")
    with reference_server(model, dumps, ["--threads", "1"]) as url:
        yield url, dumps


def hsx(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hsx_extractor.tools.cli", *args], capture_output=True, text=True, timeout=600
    )


def extract(
    server: tuple[str, Path], model: Path, out: Path, run_id: str, compression: str, limit: int | None = None
) -> Path:
    url, dumps = server
    argv = [
        "extract", "--run-id", run_id, "--dataset", str(example_dataset_path()), "--output", str(out),
        "--model", str(model), "--server-url", url, "--dump-dir", str(dumps), "--compression", compression,
        "--max-length", str(MAX_LENGTH), "--shard-target-bytes", str(SHARD_TARGET), "--progress-port", "0",
        "--concurrency", "4",
    ]  # fmt: skip
    if limit is not None:
        argv += ["--limit", str(limit)]
    result = hsx(*argv)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run_dir = out / run_id
    assert (run_dir / "manifest.json").is_file()
    return run_dir


def bytes_on_disk(run_dir: Path) -> int:
    return sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())


def estimate(
    model: Path, compression: str, ratio: float | None = None, limit: int | None = None, trial: Path | None = None
) -> dict[str, Any]:
    argv = [
        "estimate", "--dataset", str(example_dataset_path()), "--model", str(model), "--compression", compression,
        "--max-length", str(MAX_LENGTH), "--shard-target-bytes", str(SHARD_TARGET), "--json",
    ]  # fmt: skip
    if ratio is not None:
        argv += ["--compression-ratio", str(ratio)]
    if limit is not None:
        argv += ["--limit", str(limit)]
    if trial is not None:
        argv += ["--trial", str(trial)]
    result = hsx(*argv)
    assert result.returncode == 0, result.stdout + result.stderr
    return dict(json.loads(result.stdout))


def hidden_state_ratio(run_dir: Path) -> float:
    """Raw / stored bytes of the hidden-state tensors, read from the run's shard headers."""
    raw = stored = 0
    for shard in (run_dir / "shards").glob("*.safetensors"):
        data = shard.read_bytes()
        header = parse_header(data[: header_length(data[:8])])
        for sample in header.samples:
            for t in sample.tensors:
                if t.dtype == "BF16":
                    raw, stored = raw + t.raw_length, stored + t.length
    assert stored > 0
    return raw / stored


def test_estimate_matches_an_uncompressed_run(server: tuple[str, Path], model: Path, tmp_path: Path) -> None:
    run_dir = extract(server, model, tmp_path, "plain", "none")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    est = estimate(model, "none")
    assert est["samples"] == manifest["samples"]
    assert est["quarantined"] == manifest["quarantined"]
    actual = bytes_on_disk(run_dir)
    print(f"compression none: estimated {est['storedBytes']} B, written {actual} B")
    assert abs(est["storedBytes"] - actual) <= TOLERANCE * actual, (est, actual)
    # The hidden states alone follow the formula exactly: tokens x (aux + 1) x hidden x 2.
    assert est["hiddenBytes"] == est["tokens"] * (est["auxLayers"] + 1) * est["hiddenSize"] * 2


def test_a_trial_run_ratio_predicts_the_compressed_run(
    server: tuple[str, Path], model: Path, tmp_path: Path
) -> None:
    trial = extract(server, model, tmp_path, "trial", "bf16-zstd", limit=10)
    # The ratio a user reads off the trial (hsx verify prints the same): raw tensors / stored shards.
    ratio = json.loads((trial / "manifest.json").read_text())["compression"]["ratio"]
    assert 1.0 < ratio < 2.0
    full = extract(server, model, tmp_path, "full", "bf16-zstd")
    est = estimate(model, "bf16-zstd", ratio=ratio)
    assert est["ratioMeasuredOn"] == "shards"
    actual = bytes_on_disk(full)
    print(
        f"bf16-zstd: trial manifest ratio {ratio:.4f}; estimated {est['storedBytes']} B, written {actual} B; "
        f"raw estimate {est['rawBytes']} B"
    )
    assert abs(est["storedBytes"] - actual) <= TOLERANCE * actual, (est, actual)
    assert est["rawBytes"] > actual
    # --trial reads the hidden states' own ratio off the trial's shard headers: closer still.
    by_trial = estimate(model, "bf16-zstd", trial=trial)
    assert by_trial["assumedRatio"] == pytest.approx(hidden_state_ratio(trial))
    print(f"  --trial: hidden-state ratio {by_trial['assumedRatio']:.4f} (full run {hidden_state_ratio(full):.4f}): "
          f"{by_trial['storedBytes']} B")
    assert abs(by_trial["storedBytes"] - actual) <= TOLERANCE * actual, (by_trial, actual)

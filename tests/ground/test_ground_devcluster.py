"""`make dev-cluster` starts a usable ground in the foreground, runs the README's quick start verbatim (with the
values the dev cluster prints) until `hsx verify` passes, and leaves nothing behind on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.ground.devcluster import quickstart_commands
from tests.ground.tools import tool_path

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def read_until(proc: subprocess.Popen[str], marker: str, timeout_s: float) -> str:
    """Collect stdout until it contains `marker` (AssertionError with the output so far if not)."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()  # raw reads: a buffered readline would hide lines from the selector
    seen = b""
    selector = selectors.DefaultSelector()
    selector.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and marker.encode() not in seen:
        if not selector.select(timeout=1.0):
            if proc.poll() is not None:
                break
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        seen += chunk
    text = seen.decode(errors="replace")
    if marker not in text:
        raise AssertionError(f"dev-cluster never printed {marker!r}; output:\n{text}")
    return text


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def read_all(fd: int, into: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        into.append(chunk)


def run_steps(steps: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """The steps in one bash, as a user pastes them; on timeout its whole process group is killed."""
    shell = subprocess.Popen(
        ["bash", "-euo", "pipefail", "-c", "\n".join(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = shell.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(shell.pid, signal.SIGKILL)
        out, err = shell.communicate()
    return subprocess.CompletedProcess(shell.args, shell.returncode, out, err)


def printed_steps(banner: str) -> list[str]:
    return [line.split("$ ", 1)[1] for line in banner.splitlines() if line.startswith("    $ ")]


def test_dev_cluster_runs_the_guides_extraction_and_stops_cleanly(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("dev-cluster needs root")
    workdir = tmp_path / "dev"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.ground.devcluster", "--workdir", str(workdir)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        banner = read_until(proc, "Ctrl-C stops everything", 180)
        # Keep reading its output while the steps run: a full pipe would block the dev cluster.
        assert proc.stdout is not None
        later: list[bytes] = []
        drain = threading.Thread(target=read_all, args=(proc.stdout.fileno(), later), daemon=True)
        drain.start()
        kubeconfig = re.search(r"export KUBECONFIG=(\S+)", banner)
        assert kubeconfig, banner
        nodes = subprocess.run(
            [str(tool_path("kubectl")), "--kubeconfig", kubeconfig.group(1), "get", "nodes", "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
        )
        [node] = json.loads(nodes.stdout)["items"]
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "True"
        assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
        assert "S3 endpoint: http://127.0.0.1:" in banner
        # Which endpoint goes into a manifest is said; it is the one the prepared manifest names.
        pod_endpoint = re.search(r"S3 endpoint for manifests: (\S+)", banner)
        assert pod_endpoint, banner
        assert f"S3_ENDPOINT={pod_endpoint.group(1)}" in banner
        # Another bucket, as the banner says, from another shell; the env file reaches it from this host.
        made = subprocess.run(
            ["make", "-s", "dev-bucket", "NAME=extra"], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert made.returncode == 0 and "bucket extra made" in made.stdout, made.stdout + made.stderr
        listed = subprocess.run(
            ["bash", "-c", f"source {workdir / 'dev-cluster.env'} && {sys.executable} -c "
             "'import boto3; print(sorted(b[\"Name\"] for b in boto3.client(\"s3\").list_buckets()[\"Buckets\"]))'"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "'extra'" in listed.stdout and "'hsx-try'" in listed.stdout, listed.stdout + listed.stderr
        assert (workdir / "dev-cluster.pid").read_text().strip() == str(proc.pid)
        # The banner's steps: this cluster's values, then the README's quick start, verbatim.
        steps = printed_steps(banner)
        readme = quickstart_commands()
        assert any(c.startswith("helm install hsx charts/hsx") for c in readme) and readme[-1].startswith("hsx verify")
        assert steps[-len(readme):] == readme and len(steps) == len(readme) + 3, banner
        # As a user pastes them, in one shell: the README's wait, its table and its verify.
        tried = run_steps(steps, timeout_s=1200)
        assert tried.returncode == 0, f"{tried.stdout}\n{tried.stderr}\n{banner}"
        lines = tried.stdout.splitlines()
        header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["NAME", "PHASE", "REASON"])
        assert lines[header + 1].split()[:2] == ["quickstart", "Succeeded"], tried.stdout
        assert "OK: s3://hsx-try/quickstart/r1" in tried.stdout, tried.stdout  # hsx verify
        xj = subprocess.run(
            [str(tool_path("kubectl")), "--kubeconfig", kubeconfig.group(1), "get", "xj", "-n", "hsx-try",
             "quickstart", "-o", "json"],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        progress = json.loads(xj.stdout)["status"]["progress"]
        assert progress["samplesDone"] > 0 and progress["samplesDone"] == progress["samplesTotal"], progress
        # `kubectl logs` as a newcomer types it: through the API server to the node's kubelet API.
        logs = subprocess.run(
            [str(tool_path("kubectl")), "--kubeconfig", kubeconfig.group(1), "logs", "-n", "hsx-try",
             "job/quickstart-r1", "-c", "extractor"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert logs.returncode == 0 and "samples" in logs.stdout, logs.stdout[-2000:] + logs.stderr
    finally:
        # Stopped as the banner says, by the PID it wrote (also after a failed step: nothing orphaned).
        pid_file = workdir / "dev-cluster.pid"
        os.kill(int(pid_file.read_text()) if pid_file.exists() else proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    drain.join(timeout=30)
    rest = b"".join(later).decode(errors="replace")
    assert proc.returncode == 0, rest
    assert "nothing left running" in rest
    assert processes_mentioning(str(workdir)) == []

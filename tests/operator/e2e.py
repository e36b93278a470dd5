"""Helpers of the end-to-end operator tests: reading a run's status, output and logs."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from hsx_extractor.config import OutputSpec
from hsx_extractor.run.plan import PLAN_NAME
from hsx_extractor.storage.store import open_store
from tests.operator.conftest import HSX, POLL_SECONDS, wait_for
from tests.operator.kube_helpers import Namespace, xj_manifest

# Slow enough that a run lasts tens of seconds, so it can be caught between two shard commits.
SLOW: dict[str, Any] = {"server": {"extraArgs": ["--delay-ms", "300"]}, "concurrency": 2}
# Several operator polls: long enough for a reconcile that would write to have written.
QUIET_SECONDS = 6 * float(POLL_SECONDS)
FINAL_LOG = re.compile(r"hsx progress state=succeeded samples=(\d+)/(\d+) .*?tokens=(\d+)")


def verify(output_run_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [HSX, "verify", "--json", str(output_run_dir)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def phase(ns: Namespace, name: str, *phases: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        st = ns.status(name)
        return st if st.get("phase") in phases else None

    return check


def reason_is(ns: Namespace, name: str, *reasons: str) -> Callable[[], dict[str, Any] | None]:
    """Status once its reason is one of ``reasons``."""

    def check() -> dict[str, Any] | None:
        st = ns.status(name)
        return st if st.get("reason") in reasons else None

    return check


def progressed(ns: Namespace, name: str) -> Callable[[], dict[str, Any] | None]:
    """Status once some samples are done (or the run failed: no point waiting)."""

    def check() -> dict[str, Any] | None:
        st = ns.status(name)
        done = (st.get("progress") or {}).get("samplesDone", 0)
        return st if done > 0 or st.get("phase") == "Failed" else None

    return check


def run_store(output: Path | str, run_id: str, **output_spec: Any) -> Any:
    return open_store(OutputSpec.model_validate({"uri": str(output), **output_spec}), run_id)


def planned_shards(run_dir: Path) -> int:
    return len(json.loads((run_dir / PLAN_NAME).read_text())["shards"])


def file_digests(root: Path) -> dict[str, tuple[str, int, int]]:
    """Relative path -> (sha256, size, mtime_ns) of every file under `root`."""
    out = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        st = path.stat()
        out[str(path.relative_to(root))] = (
            hashlib.sha256(path.read_bytes()).hexdigest(),
            st.st_size,
            st.st_mtime_ns,
        )
    return out


def committed_files(run_dir: Path, run_id: str) -> dict[str, tuple[str, int, int]]:
    """Digests of the commit records and shard objects of every committed shard."""
    store = run_store(run_dir.parent, run_id)
    digests = file_digests(run_dir)
    keep = set()
    for k in store.committed_shards():
        commit = store.get_commit(k)
        assert commit is not None
        keep |= {store.layout.commit_key(k), commit.key}
    prefix = f"{run_id}/"
    return {rel: d for rel, d in digests.items() if prefix + rel in keep}


def settled(ns: Namespace, name: str) -> dict[str, Any]:
    """The ExtractionJob once its resourceVersion has stayed the same for QUIET_SECONDS."""
    first = ns.get("xj", name)
    assert first is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(QUIET_SECONDS)
        again = ns.get("xj", name)
        assert again is not None
        if again["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]:
            return again
        first = again
    raise AssertionError(f"xj {name} kept changing: {first.get('status')}")


def final_log(node_agent: Any, namespace: str, pod: str) -> tuple[int, int, int]:
    """(samplesDone, samplesTotal, tokensDone) from the extractor's last progress line of a finished run."""
    found = FINAL_LOG.findall(node_agent.logs(namespace, pod, "extractor"))
    assert found, node_agent.logs(namespace, pod, "extractor")[-3000:]
    done, total, tokens = found[-1]
    return int(done), int(total), int(tokens)


def conditions(status: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in status.get("conditions") or []}


def patch_spec(ns: Namespace, name: str, spec: dict[str, Any]) -> None:
    ns.kubectl("patch", "xj", name, "--type=merge", "-p", json.dumps({"spec": spec}))


def some_committed(run_dir: Path, run_id: str, ns: Namespace, name: str) -> Callable[[], Any]:
    """At least one shard committed (or the run ended: no point waiting)."""

    def check() -> Any:
        if ns.status(name).get("phase") in ("Succeeded", "Failed"):
            return "ended"
        if not (run_dir / PLAN_NAME).exists():
            return None
        return run_store(run_dir.parent, run_id).committed_shards() or None

    return check


def start_slow_run(ns: Namespace, name: str, env: dict[str, Any], **spec: Any) -> Path:
    """Apply a SLOW run of ``env`` as run r1 and return its output dir once it is Running with at
    least one shard committed and more to go: the moment to disturb it."""
    run_dir: Path = env["output"] / "r1"
    ns.apply(xj_manifest(name, "r1", **env, **{**SLOW, **spec}))
    running = wait_for(phase(ns, name, "Running", "Succeeded", "Failed"), 180, "Running")
    assert running["phase"] == "Running", running
    early = wait_for(some_committed(run_dir, "r1", ns, name), 240, "a committed shard")
    assert early != "ended", ("the run ended before it could be disturbed; slow it down", ns.status(name))
    return run_dir


def status_patches(ns: Namespace) -> int:
    """PATCH requests the API server has answered for extractionjobs/status, from its own metrics
    (apiserver_request_total): every write of any ExtractionJob's status, no-op ones too."""
    metrics = ns.cluster.kubectl("get", "--raw", "/metrics").stdout
    total = 0
    for line in metrics.splitlines():
        if (
            line.startswith("apiserver_request_total{")
            and 'resource="extractionjobs"' in line
            and 'subresource="status"' in line
            and 'verb="PATCH"' in line
        ):
            total += int(float(line.rsplit(" ", 1)[1]))
    return total



def rendered(ns: Namespace, manifest: dict[str, Any], workdir: Path) -> list[dict[str, Any]]:
    """What `hsx render -f` prints for ``manifest`` in ``ns``: the ConfigMap and the Job."""
    path = workdir / f"render-{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    done = subprocess.run([HSX, "render", "-f", str(path), "-n", ns.name], capture_output=True, text=True, check=True)
    return list(yaml.safe_load_all(done.stdout))


def missing_from(actual: Any, expected: Any, where: str = "") -> list[str]:
    """Where ``actual`` lacks or differs from ``expected`` (the API server may add defaults, nothing else)."""
    if isinstance(expected, dict):
        if not isinstance(actual, dict):
            return [f"{where}: {actual!r} is not a mapping"]
        return [m for k, v in expected.items() for m in missing_from(actual.get(k), v, f"{where}.{k}")]
    if isinstance(expected, list):
        if not isinstance(actual, list) or len(actual) != len(expected):
            return [f"{where}: {actual!r} != {expected!r}"]
        return [m for i, (a, e) in enumerate(zip(actual, expected, strict=True)) for m in missing_from(a, e, f"{where}[{i}]")]
    return [] if actual == expected else [f"{where}: {actual!r} != {expected!r}"]

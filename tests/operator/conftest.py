"""Fixtures of the operator tests: the CRD on the session's control plane, the operator as a real
subprocess with least-privilege RBAC, the hsx images mapped onto the node agent, a tiny model."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hsx_operator.desired import EXTRACTOR_UID
from tests.ground.images import register_hsx_images
from tests.operator.kube_helpers import Namespace

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HSX = str(BIN / "hsx")
OPERATOR_USER = "hsx-operator"
POLL_SECONDS = "1"
# Copies of the bundled chat dataset in the long dataset: ~6 shards at the smallest shardTargetBytes.
COPIES = 5


@pytest.fixture(scope="session")
def xj_crd(kube_cluster: Any) -> Any:
    """The ExtractionJob CRD from crds/, applied and established."""
    kube_cluster.kubectl("apply", "-f", str(ROOT / "crds"))
    kube_cluster.wait_crd_established("extractionjobs.hsx.dev")
    return kube_cluster


@pytest.fixture(scope="session")
def operator_kubeconfig(xj_crd: Any) -> Path:
    """A kubeconfig for user hsx-operator holding exactly hsx_operator.rbac's ClusterRole."""
    from hsx_operator.rbac import cluster_role

    role = cluster_role("hsx-operator-test")
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": "hsx-operator-test"},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "hsx-operator-test",
        },
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": OPERATOR_USER}],
    }
    xj_crd.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    return xj_crd.user_kubeconfig(OPERATOR_USER)  # type: ignore[no-any-return]


@pytest.fixture(scope="session")
def op_workdir() -> Iterator[Path]:
    # Not under /tmp: the extractor container mounts its own /tmp over it.
    path = Path(tempfile.mkdtemp(prefix="hsx-operator-tests-", dir="/var/tmp"))
    path.chmod(0o755)  # mkdtemp's 0700 would lock the pods' non-root users out of what lies below
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(op_workdir: Path) -> Path:
    """A tiny random Llama with its tokenizer, in {op_workdir}/models/tiny (mounted at /models)."""
    from hsx_extractor.tools.tinymodel import build_tiny_model

    return build_tiny_model(op_workdir / "models" / "tiny")


@pytest.fixture(scope="session")
def chat_dataset(op_workdir: Path) -> Path:
    from hsx_extractor.tools.tinymodel import example_dataset_path

    target = op_workdir / "data" / "chat.jsonl"
    target.parent.mkdir(parents=True)
    shutil.copy(example_dataset_path(), target)
    return target


@pytest.fixture
def ns(xj_crd: Any, namespace: str, request: pytest.FixtureRequest, node_agent: Any) -> Iterator[Namespace]:
    space = Namespace(xj_crd, namespace)
    yield space
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        # What the run looked like when the test gave up.
        for xj in space.items("xj"):
            print(f"--- xj {xj['metadata']['name']} status ---\n{json.dumps(xj.get('status'), indent=1)}")
        for pod in space.items("pods"):
            print(f"--- pod {pod['metadata']['name']} ---\n{json.dumps(pod.get('status'), indent=1)[:3000]}")
            for c in ("sglang", "extractor"):
                print(f"--- {c} log ---\n{node_agent.logs(namespace, pod['metadata']['name'], c)[-3000:]}")


@pytest.fixture
def run_env(
    hsx_node: Any, tiny_model: Path, chat_dataset: Path, op_workdir: Path, namespace: str
) -> dict[str, Any]:
    # The admin's step for a node-local output (docs/guide.md): a directory the extractor's user owns.
    # The kubelet would make a missing one root's, and the run would fail PreflightFailed.
    out = op_workdir / "out" / namespace
    out.mkdir(parents=True, exist_ok=True)
    os.chown(out, EXTRACTOR_UID, EXTRACTOR_UID)
    return {"model_root": tiny_model.parent, "dataset": chat_dataset, "output": out}


@pytest.fixture(scope="session")
def long_dataset(op_workdir: Path) -> Path:
    """The bundled chat dataset, its readable rows repeated COPIES times under new ids (its bad rows once)."""
    from hsx_extractor.tools.tinymodel import example_dataset_path

    target = op_workdir / "data-long" / "chat-long.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    lines = example_dataset_path().read_bytes().splitlines()
    out: list[bytes] = []
    for copy in range(COPIES):
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("id"), str):
                if copy == 0:
                    out.append(line)
                continue
            out.append(json.dumps({**row, "id": f"{row['id']}-c{copy}"}).encode() if copy else line)
    target.write_bytes(b"\n".join(out) + b"\n")
    return target


@pytest.fixture(scope="session")
def hsx_node(node_agent: Any, tiny_model: Path) -> Any:
    """The node agent with the hsx images registered (the operator's default image names)."""
    register_hsx_images(node_agent, operator=False)
    return node_agent


class OperatorProcess:
    """One `hsx-operator` subprocess watching one namespace, as the least-privilege user."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        log: Path,
        allow_host_paths: tuple[Path, ...] = (),
        extra_args: tuple[str, ...] = (),
    ):
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HSX_OPERATOR_POLL_SECONDS": POLL_SECONDS}
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(BIN / "hsx-operator"),
                    *("-n", namespace, "--metrics-port", "0"),
                    *(f"--allow-host-path={p}" for p in allow_host_paths),
                    *extra_args,
                ],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def kill(self) -> None:
        """SIGKILL: no cleanup, like a crashed pod."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@pytest.fixture
def start_operator(
    operator_kubeconfig: Path,
    namespace: str,
    tmp_path: Path,
    op_workdir: Path,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., OperatorProcess]]:
    """Start operators for the test's namespace (each call one more); all are stopped afterwards.
    They allow host paths under the session's work directory only (models, datasets, outputs)."""
    started: list[OperatorProcess] = []

    def start(*extra_args: str) -> OperatorProcess:
        log = tmp_path / f"operator-{len(started)}.log"
        op = OperatorProcess(operator_kubeconfig, namespace, log, allow_host_paths=(op_workdir,), extra_args=extra_args)
        started.append(op)
        return op

    yield start
    for op in started:
        op.stop()
    if request.node.rep_call.failed if hasattr(request.node, "rep_call") else False:
        for op in started:
            print(f"--- {op.log} ---\n{op.tail()}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Any:
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
    """Poll until `predicate` returns something truthy; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}")

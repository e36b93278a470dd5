"""The operator end to end with the real vLLM server (0.32, CPU build) in the pod's server container.

The node agent maps a test image onto the vLLM CPU venv of tests/engines: the container runs the
command the operator generated (hsx's launcher `python3 -m hsx_extractor.vllm_hook serve ...`, which
reads the model's config in the pod and execs vLLM with hsx's connector), with python3 being the
venv's and hsx installed from this checkout's wheel. Only the CPU flags are the test's, passed as
the user would: through server.extraArgs and server.env.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
from tests.engines import vllm_venv
from tests.engines.vllm_server import CONTEXT_LENGTH, CPU_ARGS
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import phase, verify
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.vllm]

VLLM_CPU_IMAGE = "hsx-test.local/hsx-vllm-cpu:0.32.0"


@pytest.fixture(scope="module")
def vllm_image(hsx_node: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    if not vllm_venv.is_built():
        pytest.skip(
            f"the vLLM CPU venv is not built at {vllm_venv.venv_dir()}: run `bash tests/engines/build_vllm.sh`"
        )
    hsx_dir = vllm_venv.install_hsx(tmp_path_factory.mktemp("op-vllm") / "site")
    env = vllm_venv.process_env(hsx_dir, {})
    # PATH too: the launcher execs `python3`, which must be the venv's.
    image_env = [f"{k}={env[k]}" for k in ("PYTHONPATH", "VIRTUAL_ENV", "PATH")]

    def vllm_argv(container: dict, pod: dict) -> list[str]:
        command = list(container["command"])
        assert command[:4] == ["python3", "-m", "hsx_extractor.vllm_hook", "serve"], command
        return ["env", *image_env, str(vllm_venv.venv_python()), *command[1:]]

    hsx_node.register_image(VLLM_CPU_IMAGE, vllm_argv)
    return VLLM_CPU_IMAGE


@pytest.fixture(scope="module")
def vllm_model_root(op_workdir: Path) -> Path:
    # 2 heads of 32: vLLM's CPU attention has no kernel for the default tiny model's head size 16.
    # Under the session's work directory: the only host path the test operators allow.
    root = op_workdir / "models-vllm"
    build_tiny_model(root / "tiny", TinyModelSpec(num_heads=2, num_kv_heads=1))
    return root


def test_run_with_real_vllm_in_the_pod_succeeds_and_verifies(
    ns: Namespace,
    run_env: dict[str, Any],
    vllm_image: str,
    vllm_model_root: Path,
    start_operator: Callable[[], OperatorProcess],
) -> None:
    op = start_operator()
    server = {
        "engine": "vllm",
        "image": vllm_image,
        "extraArgs": [*CPU_ARGS, "--max-model-len", str(CONTEXT_LENGTH)],
        "env": [{"name": k, "value": v} for k, v in {**vllm_venv.CPU_ENV, "HF_HUB_OFFLINE": "1"}.items()],
        "startupTimeoutSeconds": 900,
        "gpus": 1,
    }
    manifest = xj_manifest("real-vllm", "r1", server=server, **{**run_env, "model_root": vllm_model_root})
    manifest["spec"]["dataset"]["maxLength"] = CONTEXT_LENGTH - 12
    ns.apply(manifest)
    done = wait_for(phase(ns, "real-vllm", "Succeeded", "Failed"), 1200, "the run with real vLLM to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
    run = Path(run_env["output"]) / "r1"
    report = verify(run)
    assert report.get("ok", True) and report["samples"] > 0, report
    assert done["progress"]["samplesDone"] == done["progress"]["samplesTotal"] > 0
    # The pod's server was vLLM with hsx's connector: the run records vLLM's final-state convention.
    assert json.loads((run / "manifest.json").read_text())["capture"]["finalState"] == "pre-norm"

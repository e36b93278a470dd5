"""The operator end to end with the real SGLang server (0.5.23 on CPU) in the pod's server container.

The node agent maps a test image onto the SGLang CPU venv of tests/engines: the container runs the
command the operator generated (its `python3 -m sglang.launch_server ...`, the hook switched on by
the pod's SGLANG_HS_DUMP_DIR), with python3 being the venv's and hsx installed as the image installs
it. Only the CPU flags are the test's, passed as the user would: through server.extraArgs and server.env.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.engines.sglang_server import CPU_ARGS, CPU_ENV
from tests.engines.sglang_venv import install_hook, install_hsx, is_built, process_env, venv_dir, venv_python
from tests.operator.conftest import OperatorProcess, wait_for
from tests.operator.e2e import phase, verify
from tests.operator.kube_helpers import Namespace, xj_manifest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SGLANG_CPU_IMAGE = "hsx-test.local/hsx-sglang-cpu:0.5.23"


@pytest.fixture(scope="module")
def sglang_image(hsx_node: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    if not is_built():
        pytest.skip(
            f"the SGLang CPU venv is not built at {venv_dir()}: run `bash tests/engines/build_sglang.sh`"
        )
    # This checkout's hsx as the image has it: its wheel --no-deps, then the Dockerfile's hook steps.
    hsx_dir = install_hsx(tmp_path_factory.mktemp("op-sglang") / "site")
    install_hook(hsx_dir)
    env = process_env(hsx_dir, {})
    image_env = [f"{k}={env[k]}" for k in ("PYTHONPATH", "VIRTUAL_ENV")]

    def sglang_argv(container: dict, pod: dict) -> list[str]:
        command = list(container["command"])
        assert command[:3] == ["python3", "-m", "sglang.launch_server"], command
        return ["env", *image_env, str(venv_python()), *command[1:]]

    hsx_node.register_image(SGLANG_CPU_IMAGE, sglang_argv)
    return SGLANG_CPU_IMAGE


def test_run_with_real_sglang_in_the_pod_succeeds_and_verifies(
    ns: Namespace,
    run_env: dict[str, Any],
    sglang_image: str,
    start_operator: Callable[[], OperatorProcess],
) -> None:
    op = start_operator()
    server = {
        "image": sglang_image,
        "extraArgs": list(CPU_ARGS),
        "env": [{"name": k, "value": v} for k, v in CPU_ENV.items()],
        "startupTimeoutSeconds": 900,
        "gpus": 1,  # one CPU rank: SGLang on CPU runs one rank per NUMA node
    }
    # SGLang runs with --context-length 512 here: a longer sample would be refused (server_error)
    # and trip the mismatch gate, so the dataset quarantines them first (too_long).
    manifest = xj_manifest("real", "r1", server=server, **run_env)
    manifest["spec"]["dataset"]["maxLength"] = 500
    ns.apply(manifest)
    done = wait_for(phase(ns, "real", "Succeeded", "Failed"), 1200, "the run with real SGLang to end")
    assert done["phase"] == "Succeeded", (done, op.tail())
    report = verify(Path(run_env["output"]) / "r1")
    assert report.get("ok", True) and report["samples"] > 0, report
    assert done["progress"]["samplesDone"] == done["progress"]["samplesTotal"] > 0

"""How this checkout stands for each of hsx's images on the node agent.

The operator and extractor images run their console scripts from this venv with the pod's arguments; the
SGLang image runs hsx's CPU reference server with the model, port, host, dump dir and aux layers the operator
put on its command line (tests that need the real engine map it themselves, tests/engines).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
# hsx's default registry (operator/hsx_operator/api.py, the chart's values); the quick start's REGISTRY here.
REGISTRY = "ghcr.io/hsx-dev"
OPERATOR_IMAGE = f"{REGISTRY}/hsx-operator:*"
SERVER_IMAGE = f"{REGISTRY}/hsx-sglang:*"
EXTRACTOR_IMAGE = f"{REGISTRY}/hsx-extractor:*"


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def reference_server_argv(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """The sglang image -> hsx's CPU reference server with the same model, port and dump dir. A rank other
    than 0 of a server over several nodes (SGLang cannot run one on CPU: docs/sglang.md) -> a stand-in that
    holds the pod until it is stopped, as such a rank's scheduler does; the leader's reference server
    serves the whole model."""
    command = list(container["command"])
    rank = flag_value(command, "--node-rank")
    if rank is not None and rank != "0":
        assert flag_value(command, "--nnodes") and flag_value(command, "--dist-init-addr"), command
        return [sys.executable, "-c", "import time; time.sleep(86400)"]
    env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    model, port, host = (flag_value(command, f) for f in ("--model-path", "--port", "--host"))
    assert model and port and host, command
    argv = [str(BIN / "hsx"), "serve-reference", "--model", model, "--dump-dir", env["SGLANG_HS_DUMP_DIR"]]
    argv += ["--host", host, "--port", port, "--threads", "1"]
    if "--return-aux-hidden-state-layer-ids" in command:
        start = command.index("--return-aux-hidden-state-layer-ids") + 1
        ids = [x for x in command[start:] if x.isdigit()]
        argv += ["--aux-layer-ids", *ids]
    delay = flag_value(command, "--delay-ms")  # test hook, passed through server.extraArgs
    if delay:
        argv += ["--delay-ms", delay]
    return argv


def extractor_argv(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    command = list(container["command"])
    assert command[0] == "hsx", command
    return [str(BIN / "hsx"), *command[1:]]


def operator_argv(container: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    """The chart's containers: the operator's console script, or the image's python (`helm test`), from
    this venv with exactly the chart's arguments."""
    command = list(container["command"])
    if command == ["hsx-operator"]:
        return [str(BIN / "hsx-operator"), *container.get("args", [])]
    assert command[0] == "python", command
    return [sys.executable, *command[1:], *container.get("args", [])]


def register_hsx_images(node_agent: Any, *, operator: bool = True) -> None:
    """Map hsx's images onto this checkout on `node_agent` (see the module's docstring)."""
    node_agent.register_image(SERVER_IMAGE, reference_server_argv)
    node_agent.register_image(EXTRACTOR_IMAGE, extractor_argv)
    if operator:
        node_agent.register_image(OPERATOR_IMAGE, operator_argv)

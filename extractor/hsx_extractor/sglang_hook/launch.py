"""The SGLang release the hook targets, and the server command and environment of extraction mode.

Pure: nothing here imports SGLang or torch, so the operator can build the sidecar's command line.
Why each flag is there: docs/sglang.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from hsx_extractor.protocol import DUMP_DIR_ENV, FINAL_POST_NORM, FINAL_PRE_NORM

# The one SGLang release the hook is written against; any other version fails at start.
SGLANG_VERSION = "0.5.23"
# The producer name the hook writes into every dump (protocol.DumpMeta.producer).
HOOK_PRODUCER = f"hsx-sglang-hook/sglang-{SGLANG_VERSION}"
# The official image of that release (Docker Hub); the `sglang` image target builds FROM it.
SGLANG_BASE_IMAGE = f"lmsysorg/sglang:v{SGLANG_VERSION}"

# Which final state the hook dumps (protocol.FINAL_STATE_KEY): post-norm (SGLang's own output, the default)
# or pre-norm (the final norm's input, kept by sglang_hook/prenorm.py).
FINAL_STATE_ENV = "SGLANG_HS_FINAL_STATE"
FINAL_STATES = (FINAL_POST_NORM, FINAL_PRE_NORM)

# What the hook patches: module, class and method, by name.
TARGET_MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"
TARGET_CLASS = "SchedulerBatchResultProcessor"
TARGET_METHOD = "_append_prefill_hidden_states"
# The method's keyword-only parameters the hook relies on, in declaration order.
TARGET_KWONLY = (
    "req",
    "logits_output",
    "hidden_state_offset",
    "capture_hidden_mode",
    "extend_input_len",
    "store",
)

# Flags the operator must not let users override: extraction is wrong or impossible without them.
# With every alias SGLang's parser gives them (tests/engines/test_owned_flags.py reads its parser).
OWNED_FLAGS = frozenset(
    {
        "--model-path",
        "--model",
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        "--dp-size",
        "--dp",
        "--data-parallel-size",
        "--port",
        "--host",
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "--return-aux-hidden-state-layer-ids",
        "--disable-radix-cache",
        "--speculative-draft-model-path",
        "--speculative-draft-model",
        "--pp-size",
        "--pipeline-parallel-size",
        # A server over several nodes (issue 37): each pod's rank and the leader's address are the group's.
        "--nnodes",
        "--node-rank",
        "--dist-init-addr",
        "--nccl-init-addr",
    }
)


# Flags server.extraArgs may not name at all: SGLang's --config reads a file of arguments that could set
# any owned flag behind the check's back.
REFUSED_FLAGS = frozenset({"--config"})
# SGLang parses with argparse's allow_abbrev: any unambiguous prefix of a long flag is that flag
# (--tp-siz is --tp-size). A flag name of the arguments is refused when it is an owned or refused flag
# or a prefix of one, given longer than this ("--" alone and "--x" style stubs are not flags).
MIN_ABBREV = 3


def refused_extra_arg(arg: str) -> str | None:
    """The owned or refused flag ``arg`` would set, or None: ``--tp-size=4``, ``--tp-siz`` and
    ``--mod`` (argparse abbreviations of --tp-size and --model-path) and ``--config`` are refused.
    The one check of extra arguments, used by :func:`server_args` and by the operator."""
    if not arg.startswith("--"):
        return None
    name = arg.split("=", 1)[0]
    if len(name) < MIN_ABBREV:
        return None
    for flag in sorted(OWNED_FLAGS | REFUSED_FLAGS):
        if flag.startswith(name):
            return flag
    return None


def extra_args_problem(extra_args: Sequence[str]) -> str | None:
    """Why ``extra_args`` cannot be appended to the server's command line, or None."""
    clashes = {str(a): flag for a in extra_args if (flag := refused_extra_arg(str(a))) is not None}
    if not clashes:
        return None
    named = ", ".join(f"{a} ({flag})" if a.split("=", 1)[0] != flag else a for a, flag in clashes.items())
    return (
        f"extra_args may not set {named}: extraction mode sets the flags {', '.join(sorted(OWNED_FLAGS))} "
        "itself, argparse reads any prefix of a flag as that flag, and --config could set them from a file"
    )


def server_args(
    model_path: str,
    tp: int,
    port: int,
    layer_ids: Sequence[int] | None = None,
    extra_args: Sequence[str] = (),
    *,
    host: str = "127.0.0.1",
    dp: int = 1,
    chunked_prefill_size: int = -1,
    context_length: int | None = None,
    nodes: int = 1,
    node_rank: int | str = 0,
    dist_init_addr: str | None = None,
) -> list[str]:
    """The argv that starts SGLang in extraction mode.

    ``layer_ids`` are SGLang's ``--return-aux-hidden-state-layer-ids`` (see hsx_extractor.model for
    which layers they capture); None keeps EAGLE-3's default layers. ``dp`` > 1 runs that many
    data-parallel replicas (each scheduler's attention-TP rank 0 dumps its own requests; total
    GPUs = tp x dp). ``nodes`` > 1 spreads the tensor-parallel group over that many pods on as many nodes:
    each runs this argv with its own ``node_rank`` (0 is the leader, whose attention-TP rank 0 writes the
    dumps; a Kubernetes ``$(VAR)`` reference, expanded in the pod, is taken as it is) and the leader's
    ``dist_init_addr`` (``host:port``). ``extra_args`` are appended
    verbatim (quantization, memory fraction, ...) but may not override the flags extraction needs.
    Raises ValueError on bad input.
    """
    if not model_path:
        raise ValueError("model_path is empty")
    if tp < 1 or dp < 1:
        raise ValueError(f"tp and dp must be >= 1, got tp={tp} dp={dp}")
    if not 0 < port < 65536:
        raise ValueError(f"port {port} is not a TCP port")
    if chunked_prefill_size == 0 or chunked_prefill_size < -1:
        raise ValueError("chunked_prefill_size must be -1 (no chunking) or positive")
    group = _node_group(nodes, node_rank, dist_init_addr)
    extra = [str(a) for a in extra_args]
    problem = extra_args_problem(extra)
    if problem:
        raise ValueError(problem)
    argv = [
        "python3",
        "-m",
        "sglang.launch_server",
        "--model-path",
        model_path,
        "--tp-size",
        str(tp),
        *(["--dp-size", str(dp)] if dp > 1 else []),
        "--host",
        host,
        "--port",
        str(port),
        "--enable-return-aux-hidden-states",
        "--speculative-algorithm",
        "EAGLE3",
        "--disable-radix-cache",
        "--chunked-prefill-size",
        str(chunked_prefill_size),
        # Under overlap scheduling the final states stay on the GPU until the hook copies them;
        # a replayed prefill graph could overwrite its static buffers first (docs/sglang.md).
        "--disable-prefill-cuda-graph",
    ]
    if layer_ids:
        ids = [int(i) for i in layer_ids]
        if min(ids) < 0 or len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids {ids} must be distinct and non-negative")
        argv += ["--return-aux-hidden-state-layer-ids", *map(str, ids)]
    if context_length is not None:
        if context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        argv += ["--context-length", str(context_length)]
    return argv + group + extra


_ENV_REFERENCE = re.compile(r"^\$\([A-Z_][A-Z0-9_]*\)$")
# host:port; the host may hold $(VAR) references the pod expands (a group's leader, by its index).
_HOST_PORT = re.compile(r"^(?:[A-Za-z0-9.-]|\$\([A-Z_][A-Z0-9_]*\)){1,253}:\d{1,5}$")


def _node_group(nodes: int, node_rank: int | str, dist_init_addr: str | None) -> list[str]:
    """SGLang's flags for a server over ``nodes`` pods (none for one)."""
    if nodes < 1:
        raise ValueError(f"nodes must be >= 1, got {nodes}")
    if nodes == 1:
        return []
    if isinstance(node_rank, int) and not 0 <= node_rank < nodes:
        raise ValueError(f"node_rank {node_rank} must be in [0, {nodes})")
    if isinstance(node_rank, str) and not _ENV_REFERENCE.match(node_rank):
        raise ValueError(f"node_rank {node_rank!r} must be a number or a $(VAR) reference")
    if not dist_init_addr or not _HOST_PORT.match(dist_init_addr):
        raise ValueError(f"a server over {nodes} nodes needs dist_init_addr host:port, got {dist_init_addr!r}")
    return ["--nnodes", str(nodes), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]


# SGLang 0.5.23 samples with a request's seed only in deterministic inference mode (its sampling_batch_info).
DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def seed_ignored(extra_args: Sequence[str]) -> bool:
    """Whether SGLang started with ``extra_args`` (and hsx's flags) ignores the seed a request carries."""
    return not any(a == DETERMINISTIC_FLAG or a.startswith(DETERMINISTIC_FLAG + "=") for a in extra_args)


def server_env(
    dump_dir: str, *, context_length: int | None = None, final_state: str = FINAL_POST_NORM
) -> dict[str, str]:
    """Environment variables the server container needs in extraction mode."""
    if not dump_dir:
        raise ValueError("dump_dir is empty")
    if final_state not in FINAL_STATES:
        raise ValueError(f"final_state {final_state!r} is not one of {FINAL_STATES}")
    env = {DUMP_DIR_ENV: dump_dir}
    if final_state != FINAL_POST_NORM:
        env[FINAL_STATE_ENV] = final_state
    if context_length is not None:
        # SGLang refuses a --context-length above the model config's unless this is set.
        env["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    return env


def is_extraction_env(environ: Mapping[str, str]) -> bool:
    """Whether the hook switches on in a process with this environment."""
    return bool(environ.get(DUMP_DIR_ENV))

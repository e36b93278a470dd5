"""The server command and environment of extraction mode (pure)."""

from __future__ import annotations

import pytest

from hsx_extractor.protocol import DUMP_DIR_ENV
from hsx_extractor.sglang_hook.launch import (
    SGLANG_BASE_IMAGE,
    SGLANG_VERSION,
    is_extraction_env,
    server_args,
    server_env,
)


def _flag_value(argv: list[str], flag: str) -> list[str]:
    i = argv.index(flag)
    values = []
    for a in argv[i + 1 :]:
        if a.startswith("--"):
            break
        values.append(a)
    return values


def test_extraction_flags_and_layer_ids() -> None:
    argv = server_args(
        "/models/kimi", 8, 30000, [1, 29, 57], ["--trust-remote-code", "--mem-fraction-static", "0.8"]
    )
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    assert _flag_value(argv, "--model-path") == ["/models/kimi"]
    assert _flag_value(argv, "--tp-size") == ["8"]
    assert _flag_value(argv, "--host") == ["127.0.0.1"] and _flag_value(argv, "--port") == ["30000"]
    assert "--enable-return-aux-hidden-states" in argv and _flag_value(argv, "--speculative-algorithm") == [
        "EAGLE3"
    ]
    assert _flag_value(argv, "--return-aux-hidden-state-layer-ids") == ["1", "29", "57"]
    assert "--disable-radix-cache" in argv and _flag_value(argv, "--chunked-prefill-size") == ["-1"]
    assert argv[-3:] == ["--trust-remote-code", "--mem-fraction-static", "0.8"]
    assert "--disable-prefill-cuda-graph" in argv and "--disable-cuda-graph" not in argv


def test_default_layers_and_context_length() -> None:
    argv = server_args("/m", 1, 31000, None, context_length=131072, host="0.0.0.0")
    assert "--return-aux-hidden-state-layer-ids" not in argv and "--dp-size" not in argv
    assert _flag_value(server_args("/m", 4, 31000, dp=2), "--dp-size") == ["2"]
    assert _flag_value(argv, "--context-length") == ["131072"] and _flag_value(argv, "--host") == ["0.0.0.0"]
    assert server_env("/dev/shm/hsx", context_length=131072) == {
        DUMP_DIR_ENV: "/dev/shm/hsx",
        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN": "1",
    }
    assert server_env("/dev/shm/hsx") == {DUMP_DIR_ENV: "/dev/shm/hsx"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_path": ""}, "model_path"),
        ({"tp": 0}, "tp"),
        ({"dp": 0}, "dp"),
        ({"extra_args": ["--dp", "2"]}, "may not set --dp"),
        ({"port": 70000}, "port"),
        ({"layer_ids": [3, 3]}, "distinct"),
        ({"extra_args": ["--disable-radix-cache"]}, "may not set --disable-radix-cache"),
        ({"extra_args": ["--port=1"]}, "may not set --port"),
        ({"chunked_prefill_size": 0}, "chunked_prefill_size"),
        ({"nodes": 0}, "nodes"),
        ({"nodes": 2}, "needs dist_init_addr"),
        ({"nodes": 2, "dist_init_addr": "leader"}, "needs dist_init_addr host:port"),
        ({"nodes": 2, "node_rank": 2, "dist_init_addr": "leader:20000"}, "node_rank 2"),
        ({"nodes": 2, "node_rank": "$(rank; rm -rf /)", "dist_init_addr": "l:1"}, "VAR"),
        ({"extra_args": ["--nnodes", "2"]}, "may not set --nnodes"),
        ({"extra_args": ["--nccl-init-addr=a:1"]}, "may not set --nccl-init-addr"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, match: str) -> None:
    args = {"model_path": "/m", "tp": 8, "port": 30000} | kwargs
    with pytest.raises(ValueError, match=match):
        server_args(**args)


def test_a_server_over_several_nodes_names_its_group() -> None:
    """Issue 37's launch: every pod of a group runs the same argv but its rank; one node adds nothing."""
    assert "--nnodes" not in server_args("/m", 8, 30000)
    argv = server_args("/m", 16, 30000, nodes=2, node_rank="$(JOB_COMPLETION_INDEX)", dist_init_addr="g-0.grp:20000")
    assert _flag_value(argv, "--nnodes") == ["2"] and _flag_value(argv, "--tp-size") == ["16"]
    assert _flag_value(argv, "--node-rank") == ["$(JOB_COMPLETION_INDEX)"]
    assert _flag_value(argv, "--dist-init-addr") == ["g-0.grp:20000"]
    assert _flag_value(server_args("/m", 16, 30000, nodes=2, node_rank=1, dist_init_addr="10.0.0.5:20000"),
                       "--node-rank") == ["1"]  # fmt: skip


def test_pin_and_switch() -> None:
    assert SGLANG_VERSION == "0.5.23" and SGLANG_BASE_IMAGE == "lmsysorg/sglang:v0.5.23"
    assert is_extraction_env({DUMP_DIR_ENV: "/dev/shm/hsx"}) and not is_extraction_env({DUMP_DIR_ENV: ""})

"""vllm_hook.launch: the operator's command and vLLM's argv, pure (no vLLM needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
from hsx_extractor.vllm_hook.launch import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    VLLM_VERSION,
    extra_args_problem,
    launcher_args,
    server_args,
)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_server_args_turn_extraction_on_and_prefix_caching_off() -> None:
    argv = server_args("/m", 2, 30000, [2, 4, 5], 8, ["--max-num-seqs", "8"])
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    spec = json.loads(_flag(argv, "--speculative-config"))
    assert spec["method"] == "extract_hidden_states" and spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    transfer = json.loads(_flag(argv, "--kv-transfer-config"))
    assert transfer == {"kv_connector": CONNECTOR_CLASS, "kv_connector_module_path": CONNECTOR_MODULE,
                        "kv_role": "kv_producer"}  # fmt: skip
    assert "--no-enable-prefix-caching" in argv and _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--tensor-parallel-size") == "2" and argv[-2:] == ["--max-num-seqs", "8"]
    assert "--enable-chunked-prefill" not in argv
    chunked = server_args("/m", 1, 30000, [2, 4, 5], 8, chunked_prefill_size=64, context_length=512)
    assert _flag(chunked, "--max-num-batched-tokens") == "64" and _flag(chunked, "--max-model-len") == "512"
    assert VLLM_VERSION == "0.32.0"


@pytest.mark.parametrize(
    "args",
    [
        ["--speculative-config", "{}"],
        ["--kv-transfer-config={}"],
        ["-tp", "2"],
        ["--enable-prefix-cach"],
        ["--mod", "/x"],
        ["--port=1"],
    ],
)
def test_owned_flags_are_refused_with_their_prefixes(args: list[str]) -> None:
    assert extra_args_problem(args) is not None
    with pytest.raises(ValueError, match="may not set"):
        launcher_args("/m", 1, 30000, None, args)


def test_tuning_flags_pass() -> None:
    assert extra_args_problem(["--gpu-memory-utilization", "0.8", "--max-num-seqs=64", "--dtype", "bf16"]) is None


def test_launcher_derives_the_capture_layers_from_the_model_config(tmp_path: Path) -> None:
    """The launcher reads config.json and builds vLLM's argv with model.capture_layers' layers; its
    argv parse fails cleanly (exit 2, no exec) on ids the model cannot capture."""
    model = build_tiny_model(tmp_path / "model", TinyModelSpec(num_layers=8, num_heads=2, num_kv_heads=1))
    argv = launcher_args(str(model), 1, 30000, [9, 10, 11], ["--dtype", "float32"])
    run = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "layer id 9 asks for the input of layer 10" in run.stderr, run.stderr

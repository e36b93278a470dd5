"""The CPU reference server: SGLang's API subset, the layer convention, rid rules, faults."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor import protocol
from hsx_extractor.model import capture_layers
from tests.run.helpers import RefServer


def post(server: RefServer, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(
        server.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def gen(ids: list[int], rid: str) -> dict[str, Any]:
    return {
        "input_ids": ids,
        "rid": rid,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        "return_hidden_states": True,
    }


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_model_info_and_health(ref_server: RefServer, tiny_model: Path) -> None:
    info = ref_server.get("/get_model_info")
    config = json.loads((tiny_model / "config.json").read_text())
    assert info["architecture"] == "LlamaForCausalLM"
    assert info["vocab_size"] == config["vocab_size"]
    assert info["hidden_size"] == config["hidden_size"] == 64
    assert info["num_hidden_layers"] == config["num_hidden_layers"] == 8
    assert info["capture_layers"] == capture_layers("LlamaForCausalLM", 8, None) == [2, 4, 5]
    with urllib.request.urlopen(ref_server.url + "/health", timeout=10) as r:
        assert r.status == 200


def test_dump_follows_sglang_layer_convention(ref_server: RefServer, tiny_model: Path) -> None:
    """aux block k == HF hidden_states[capture_layers[k]] (input of that layer); final == post-norm."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [1, 3, 40, 41, 42, 43, 44, 4]
    status, body = post(ref_server, gen(ids, "conv-1"))
    assert status == 200 and body["meta_info"]["id"] == "conv-1"
    assert body["meta_info"]["prompt_tokens"] == len(ids)
    dump = protocol.read_dump(protocol.dump_path(ref_server.dump_dir, "conv-1"))
    assert dump.input_ids.tolist() == ids
    assert dump.meta.capture_layers == (2, 4, 5) and dump.meta.producer == "hsx-reference"

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    raw: dict[str, Any] = {}

    def keep_raw_output(_m: Any, _i: Any, out: Any) -> None:
        raw["last"] = (out[0] if isinstance(out, tuple) else out)[0].numpy().copy()

    model.model.layers[-1].register_forward_hook(keep_raw_output)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        normed = model.model.norm(torch.from_numpy(raw["last"])).numpy()
    states = [h[0].numpy() for h in out.hidden_states]
    aux = bf16_to_f32(dump.aux_hidden_states).reshape(len(ids), 3, 64)

    def distance(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max())

    for k, layer in enumerate((2, 4, 5)):
        # The captured block is HF's hidden_states[layer] to bf16 precision, and no other layer's.
        nearest = min(range(len(states) - 1), key=lambda j: distance(aux[:, k], states[j]))
        assert nearest == layer
        assert np.allclose(aux[:, k], states[layer], rtol=1e-2, atol=1e-2)
    final = bf16_to_f32(dump.hidden_states)
    # The final state is the last layer's output after the final norm, not before it.
    assert np.allclose(final, normed, rtol=1e-2, atol=1e-2)
    assert not np.allclose(final, raw["last"], rtol=1e-2, atol=1e-2)
    protocol.dump_path(ref_server.dump_dir, "conv-1").unlink()


def test_duplicate_rid_and_bad_requests_are_rejected(ref_server: RefServer) -> None:
    assert post(ref_server, gen([1, 2, 3], "dup-1"))[0] == 200
    status, body = post(ref_server, gen([1, 2, 3], "dup-1"))
    assert status == 400 and "Duplicate" in body["error"]["message"]
    assert post(ref_server, {"text": "hello", "rid": "t-1"})[0] == 400
    assert post(ref_server, gen([1, 10**6], "big-1"))[0] == 400
    assert post(ref_server, gen([1, 2], "../escape"))[0] == 400
    status, body = post(ref_server, {**gen([1, 2], "no-hs-1"), "return_hidden_states": False})
    assert status == 400 and "return_hidden_states" in body["error"]["message"]
    assert not protocol.dump_path(ref_server.dump_dir, "no-hs-1").exists()
    protocol.dump_path(ref_server.dump_dir, "dup-1").unlink()


@pytest.mark.parametrize("kind", ["drop", "truncate", "add_bos", "nan", "error", "swap"])
def test_faults_spoil_only_the_chosen_samples(ref_server: RefServer, kind: str) -> None:
    ref_server.set_fault(kind, every=2)
    ids = [1, 3, 50, 51, 52]
    for index in (0, 1):
        rid = protocol.make_rid(f"fault{kind.replace('_', '')}", index, 0)
        assert post(ref_server, gen(ids, rid))[0] == 200
    good = protocol.read_dump(
        protocol.dump_path(ref_server.dump_dir, protocol.make_rid(f"fault{kind.replace('_', '')}", 1, 0))
    )
    assert good.input_ids.tolist() == ids and good.hidden_states.shape[0] == len(ids)
    spoiled_rid = protocol.make_rid(f"fault{kind.replace('_', '')}", 0, 0)
    assert ref_server.stats()["faulted"] == [spoiled_rid]
    path, err = (
        protocol.dump_path(ref_server.dump_dir, spoiled_rid),
        protocol.error_path(ref_server.dump_dir, spoiled_rid),
    )
    if kind == "drop":
        assert not path.exists() and not err.exists()
    elif kind == "error":
        assert protocol.read_error(err)["reason"] == "test_fault"
    else:
        dump = protocol.read_dump(path)
        if kind == "truncate":
            assert dump.hidden_states.shape[0] == len(ids) - 1
        elif kind == "add_bos":
            assert dump.input_ids.tolist() == [1, *ids]
        elif kind == "nan":
            assert ((dump.hidden_states & 0x7F80) == 0x7F80).any()
        elif kind == "swap":
            assert dump.input_ids.tolist() != ids
    for p in ref_server.dump_dir.iterdir():
        p.unlink()

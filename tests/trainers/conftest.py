"""hsx outputs for the trainer tests, and the trainers' own code run in their cached venv.

Two kinds of output:
* a real extraction (``hsx extract`` in-process against the session's reference server) into the
  real S3 server: post-norm final states, as hsx's SGLang and reference captures store them;
* a pre-norm run written with the storage API from a transformers forward of a tiny model whose
  final-norm weight is not all ones (so applying it, or not, shows in the values).

Each manifest says how its states were captured (``capture``): the extraction's own, and for the
pre-norm run what its forward really is.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hsx_extractor.config import ExtractConfig, OutputSpec
from hsx_extractor.contract import EXIT_OK
from hsx_extractor.run.plan import planned_shards
from hsx_extractor.storage.shard_format import SampleRecord
from hsx_extractor.storage.store import open_store
from hsx_extractor.tools.tinymodel import build_tiny_model
from tests.run.helpers import RefServer, base_config, chat_rows, write_jsonl
from tests.storage.samples import CAPTURE, plan_for
from tests.trainers.trainers_venv import is_built, venv_dir, venv_python

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    if not is_built():
        pytest.skip(
            f"the trainers venv is not built at {venv_dir()}: run `bash tests/trainers/build_trainers.sh` "
            "(make test-tools does)"
        )
    return venv_python()


EXTRACTOR = HERE.parents[1] / "extractor"  # hsx itself, for the in-place loaders in the trainers venv


def run_trainer(
    python: Path,
    mode: str,
    export: Path,
    out: Path,
    max_len: int = 2048,
    verifier: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The trainer's own code over ``export`` (trainer_side.py, in the trainers venv); ``*-in-place`` modes
    read the run through hsx's in-place loaders (hsx on PYTHONPATH, S3 settings from ``env``)."""
    from safetensors.torch import load_file

    extra = [str(verifier)] if verifier else []
    done = subprocess.run(
        [str(python), str(HERE / "trainer_side.py"), mode, str(export), str(out), str(max_len), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(out.parent), "PYTHONPATH": str(EXTRACTOR)}
        | (env or {}),
    )
    assert done.returncode == 0, f"{mode} failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return dict(load_file(str(out)))


@pytest.fixture
def s3_run(tmp_path: Path, ref_server: RefServer, s3_env: Any, s3_bucket: str) -> tuple[str, OutputSpec]:
    """A real extraction of 7 chat rows (one malformed: quarantined) into S3; post-norm final states."""
    rows: list[Any] = chat_rows(6, words=9)
    rows.insert(3, "{not json")
    dataset = write_jsonl(tmp_path / "d.jsonl", rows)
    output = {"uri": f"s3://{s3_bucket}/runs", "endpoint": s3_env.endpoint, "pathStyle": True}
    cfg = ExtractConfig.model_validate({**base_config(tmp_path, ref_server, dataset), "output": output})
    from hsx_extractor.run.runner import extract

    code, result = asyncio.run(extract(cfg))
    assert code == EXIT_OK and result is not None and result.manifest is not None
    assert result.manifest["samples"] == 6 and result.manifest["quarantined"] == 1
    assert result.manifest["capture"]["finalState"] == "post-norm"
    return f"s3://{s3_bucket}/runs/run", OutputSpec.model_validate(output)


def bits(t: Any) -> np.ndarray:
    import torch

    return t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.fixture(scope="session")
def norm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose final-norm weight is random (the builder's is all ones), with a weight index."""
    import torch
    from safetensors.torch import load_file, save_file

    model = build_tiny_model(tmp_path_factory.mktemp("norm-model") / "model")
    weights = load_file(str(model / "model.safetensors"))
    gen = torch.Generator().manual_seed(7)
    w = weights["model.norm.weight"]
    weights["model.norm.weight"] = (0.5 + torch.rand(w.shape, generator=gen)).to(w.dtype)
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    # SpecForge's TargetHead reads weights only through an index, as real checkpoints have one.
    index = {"metadata": {}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    return model


@pytest.fixture(scope="session")
def prenorm_run(norm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A local run of 5 samples in 2 shards holding PRE-norm final states, with the model's own post-norm ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from hsx_extractor.model import default_capture_layers, final_norm_digest

    model = AutoModelForCausalLM.from_pretrained(str(norm_model), dtype=torch.bfloat16).eval()
    layers = default_capture_layers(model.config.num_hidden_layers)
    seen: list[torch.Tensor] = []
    model.model.norm.register_forward_hook(lambda _m, args, _o: seen.append(args[0]))
    root = tmp_path_factory.mktemp("prenorm") / "out"
    store = open_store(OutputSpec.model_validate({"uri": str(root)}), "pre", writing=True)
    plan = plan_for(5, 3)
    store.put_json_if_absent("plan.json", plan)
    rng = np.random.default_rng(3)
    post_norm: dict[int, np.ndarray] = {}
    for shard in plan["shards"]:
        builder = store.open_shard(shard["index"], range(shard["start"], shard["stop"]))
        for i in range(shard["start"], shard["stop"]):
            ids = rng.integers(8, model.config.vocab_size, 12 + 5 * i)
            with torch.no_grad():
                out = model(torch.from_numpy(ids)[None], output_hidden_states=True)
                post = model.model.norm(seen[-1])  # the model's own final norm
            aux = torch.cat([out.hidden_states[layer][0] for layer in layers], dim=-1)  # inputs of the layers
            post_norm[i] = bits(post[0])
            builder.add(SampleRecord(i, f"row-{i}", ids.astype(np.int32), (rng.random(ids.size) < 0.5).astype(np.uint8),
                                     bits(aux), bits(seen[-1][0])))  # fmt: skip
        builder.seal()
    capture = {**CAPTURE, "engine": "transformers-forward", "layerIds": layers, "finalState": "pre-norm"}
    run = {"model": str(norm_model), "finalNormDigest": final_norm_digest(norm_model)}
    store.finalize(planned_shards(plan), {"run": run, "capture": capture})
    return {"uri": str(root / "pre"), "post_norm": post_norm, "model": norm_model}

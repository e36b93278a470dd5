"""Both producers against the one consumer: dumps written by the hook's own code (through SGLang's
real result path) and by the CPU reference server, for the same tiny model and the same prompts,
are read by the extractor's collector and validator and hold the same bytes."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hsx_extractor import protocol
from hsx_extractor.reasons import Reason
from hsx_extractor.run import collect
from hsx_extractor.tools.reference_server import ReferenceModel, ReferenceServer
from hsx_extractor.tools.tinymodel import build_tiny_model
from tests.sglang.conftest import Hooked
from tests.sglang.harness import Chunk, StandInReq, make_processor, run_prefill

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def reference_model(tmp_path_factory: pytest.TempPathFactory) -> ReferenceModel:
    return ReferenceModel(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model"))


def _model_states(model: ReferenceModel, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows SGLang's forward would put in ``hidden_states`` / ``last_hidden_states`` (fp32 here)."""
    with torch.inference_mode():
        out = model.model(torch.tensor([ids]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[j][0] for j in model.capture_layers], dim=-1)
    return aux, out.hidden_states[-1][0]


def test_hook_and_reference_dumps_pass_the_same_collector(
    hooked: Hooked, reference_model: ReferenceModel, tmp_path: Path
) -> None:
    rng = np.random.default_rng(5)
    lengths = [3, 17, 9, 30]
    prompts = {f"hsx-same-{i}-a0": rng.integers(5, 400, n).tolist() for i, n in enumerate(lengths)}
    reqs = {rid: StandInReq(rid, ids) for rid, ids in prompts.items()}
    a, b, c, d = reqs.values()

    def states(req: StandInReq) -> tuple[torch.Tensor, torch.Tensor]:
        return _model_states(reference_model, list(req.origin_input_ids))

    processor = make_processor(
        hooked.module, architecture=reference_model.architecture, num_layers=reference_model.num_layers
    )
    run_prefill(processor, hooked.parts, [Chunk(a, 0, 3), Chunk(d, 0, 12, middle=True)], states=states)
    run_prefill(processor, hooked.parts, [Chunk(d, 12, 30), Chunk(b, 0, 17)], states=states)
    # c ran with a cached prefix (only 7 of its 9 tokens): the hook must refuse it.
    run_prefill(processor, hooked.parts, [Chunk(c, 2, 9)], states=states)
    hooked.flush()

    reference_dir = tmp_path / "reference"
    server = ReferenceServer(reference_model, reference_dir)
    for arrival, (rid, ids) in enumerate(prompts.items()):
        server._serve_one(rid, ids, arrival)

    shape = (
        reference_model.hidden_size,
        len(reference_model.capture_layers),
        tuple(reference_model.capture_layers),
    )
    for rid, ids in prompts.items():
        sent = np.asarray(ids, dtype=np.int32)
        from_hook = collect.check_collected(collect.look(hooked.dump_dir, rid), rid, sent, *shape)
        from_reference = collect.check_collected(collect.look(reference_dir, rid), rid, sent, *shape)
        assert isinstance(from_reference, protocol.Dump)
        if rid == c.rid:
            assert isinstance(from_hook, collect.Mismatch) and from_hook.reason is Reason.SERVER_ERROR
            assert "row_count_mismatch" in from_hook.detail
            continue
        assert isinstance(from_hook, protocol.Dump), from_hook
        assert from_hook.meta.capture_layers == from_reference.meta.capture_layers
        np.testing.assert_array_equal(from_hook.input_ids, from_reference.input_ids)
        np.testing.assert_array_equal(from_hook.aux_hidden_states, from_reference.aux_hidden_states)
        np.testing.assert_array_equal(from_hook.hidden_states, from_reference.hidden_states)


def test_collector_waits_for_a_dump_the_writer_thread_finishes_later(hooked: Hooked) -> None:
    processor = make_processor(hooked.module)
    req = StandInReq("hsx-late-0-a0", list(range(7)))

    async def collect_while_producing() -> Any:
        waiting = asyncio.ensure_future(collect.Collector(hooked.dump_dir).wait(req.rid, timeout=30))
        await asyncio.sleep(0)
        run_prefill(processor, hooked.parts, [Chunk(req, 0, 7)])
        return await waiting

    arrival = asyncio.run(collect_while_producing())
    assert isinstance(arrival, collect.Found) and arrival.dump.input_ids.tolist() == list(range(7))


def test_the_extractors_own_request_gets_a_dump(hooked: Hooked) -> None:
    from hsx_extractor.run.server_client import generate_body

    body = generate_body([4, 5, 6], "hsx-client-0-a0")
    req = StandInReq(body["rid"], body["input_ids"], return_hidden_states=body["return_hidden_states"])
    run_prefill(make_processor(hooked.module), hooked.parts, [Chunk(req, 0, 3)])
    assert hooked.files() == [f"{req.rid}.safetensors"]

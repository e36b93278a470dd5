"""The hook on SGLang 0.5.23's real batch-result code: what it writes, for which requests.

The prefill results go through the real ``process_batch_result_prefill`` (see standins.py for
exactly which parts are stand-ins), so ``store`` and the chunking state come from SGLang's code.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np

from hsx_extractor import protocol
from hsx_extractor.sglang_hook import bootstrap
from hsx_extractor.sglang_hook.hook import PRODUCER
from tests.sglang.conftest import Hooked
from tests.sglang.harness import (
    DEFAULT_CAPTURE,
    HIDDEN,
    Chunk,
    StandInReq,
    expected_bits,
    make_processor,
    run_prefill,
)


def _ids(n: int, base: int) -> list[int]:
    return [base + i for i in range(n)]


def _check_dump(hooked: Hooked, req: StandInReq, capture: tuple[int, ...] = DEFAULT_CAPTURE) -> None:
    hooked.flush()
    dump = protocol.read_dump(protocol.dump_path(hooked.dump_dir, req.rid))
    n = len(req.origin_input_ids)
    assert dump.meta.rid == req.rid and dump.meta.seq_len == n and dump.meta.hidden_size == HIDDEN
    assert dump.meta.capture_layers == capture and dump.meta.producer == PRODUCER
    assert dump.input_ids.tolist() == list(req.origin_input_ids)
    np.testing.assert_array_equal(dump.aux_hidden_states, expected_bits(req.rid, n, len(capture) * HIDDEN))
    np.testing.assert_array_equal(dump.hidden_states, expected_bits(req.rid, n, HIDDEN))


def test_the_hook_replaced_the_real_method(hooked: Hooked) -> None:
    method = hooked.module.SchedulerBatchResultProcessor._append_prefill_hidden_states
    assert method.__hsx_hook__ is True
    assert method.__wrapped__.__module__ == hooked.module.__name__
    bootstrap.patch_module(hooked.module)  # a second patch changes nothing
    assert hooked.module.SchedulerBatchResultProcessor._append_prefill_hidden_states is method


def test_mixed_lengths_and_chunking_write_exactly_one_dump_per_request(hooked: Hooked) -> None:
    processor = make_processor(hooked.module)
    a = StandInReq("hsx-run-0-a0", _ids(3, 10))
    b = StandInReq("hsx-run-1-a0", _ids(5, 20))
    long = StandInReq("hsx-run-2-a0", _ids(10, 30))
    plain = StandInReq("plain-request", _ids(4, 40), return_hidden_states=False)
    last = StandInReq("last-only", _ids(2, 50), return_hidden_states="last")

    run_prefill(processor, hooked.parts, [Chunk(a, 0, 3), Chunk(plain, 0, 4), Chunk(long, 0, 4, middle=True)])
    assert hooked.files() == [f"{a.rid}.safetensors"]  # the middle chunk wrote nothing
    run_prefill(processor, hooked.parts, [Chunk(long, 4, 8, middle=True), Chunk(last, 0, 2), Chunk(b, 0, 5)])
    assert hooked.files() == [f"{a.rid}.safetensors", f"{b.rid}.safetensors"]
    run_prefill(processor, hooked.parts, [Chunk(long, 8, 10)])

    assert hooked.files() == sorted(f"{r.rid}.safetensors" for r in (a, b, long))
    for req in (a, b, long):
        _check_dump(hooked, req)
        assert req.hidden_states == []  # SGLang's .tolist() path was skipped
        assert req.finished() and len(req.output_ids) == 1  # and SGLang's own flow went on
    assert (
        json.loads(protocol.read_dump(protocol.dump_path(hooked.dump_dir, long.rid)).meta.extra["chunks"])
        == 3
    )
    # Requests that are not extraction requests keep SGLang's behaviour, offsets included.
    assert plain.hidden_states == []
    expected_last = expected_bits(last.rid, 2, len(DEFAULT_CAPTURE) * HIDDEN)[-1]
    got_last = np.asarray(last.hidden_states[0], dtype=np.float32)
    want_last = expected_last.astype(np.uint32) << 16
    np.testing.assert_array_equal(got_last, want_last.view(np.float32))


def test_non_zero_attention_tp_rank_writes_nothing(hooked: Hooked) -> None:
    hooked.parts.parallel.attn_tp_rank = 1
    processor = make_processor(hooked.module)
    reqs = [StandInReq("hsx-r1-0-a0", _ids(3, 1)), StandInReq("hsx-r1-1-a0", _ids(6, 1))]
    run_prefill(processor, hooked.parts, [Chunk(reqs[0], 0, 3), Chunk(reqs[1], 0, 2, middle=True)])
    run_prefill(processor, hooked.parts, [Chunk(reqs[1], 2, 6)])
    assert hooked.files() == []
    assert all(r.hidden_states == [] and r.finished() for r in reqs)
    assert bootstrap.process_hook().pending == {}


def test_row_count_mismatch_writes_an_error_marker_and_no_data(hooked: Hooked) -> None:
    processor = make_processor(hooked.module)
    # A radix-cache hit: 6 prompt tokens, only the 4 uncached ones ran.
    cached = StandInReq("hsx-run-7-a0", _ids(6, 5))
    fine = StandInReq("hsx-run-8-a0", _ids(2, 5))
    run_prefill(processor, hooked.parts, [Chunk(cached, 2, 6), Chunk(fine, 0, 2)])
    assert hooked.files() == [f"{cached.rid}.error.json", f"{fine.rid}.safetensors"]
    marker = protocol.read_error(protocol.error_path(hooked.dump_dir, cached.rid))
    assert marker["reason"] == "row_count_mismatch" and "4 aux rows" in marker["message"]
    _check_dump(hooked, fine)


def test_aux_width_that_does_not_match_the_capture_layers_is_an_error(hooked: Hooked) -> None:
    processor = make_processor(hooked.module)
    req = StandInReq("hsx-run-9-a0", _ids(3, 5))
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 3)], k=2)
    assert hooked.files() == [f"{req.rid}.error.json"]
    assert (
        protocol.read_error(protocol.error_path(hooked.dump_dir, req.rid))["reason"] == "aux_width_mismatch"
    )


def test_capture_layers_come_from_the_model_when_it_says(hooked: Hooked) -> None:
    # Explicit ids [1, 3, 4] on Llama capture inputs of 2, 4, 5; the model's own list wins and is sorted.
    model = SimpleNamespace(model=SimpleNamespace(layers_to_capture=[5, 2, 4]))
    hooked.parts.features.return_aux_hidden_state_layer_ids = [1, 3, 4]
    processor = make_processor(hooked.module, model=model)
    req = StandInReq("hsx-run-3-a0", _ids(4, 9))
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 4)])
    _check_dump(hooked, req, capture=(2, 4, 5))


def test_deepseek_ids_follow_the_deepseek_rule(hooked: Hooked) -> None:
    hooked.parts.features.return_aux_hidden_state_layer_ids = [2, 4, 5]
    processor = make_processor(hooked.module, architecture="DeepseekV3ForCausalLM")
    req = StandInReq("hsx-run-4-a0", _ids(4, 9))
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 4)])
    _check_dump(hooked, req, capture=(2, 4, 5))  # first id is not 1: taken unchanged


def test_retracted_request_drops_its_chunks_and_is_dumped_once_when_rerun(hooked: Hooked) -> None:
    processor = make_processor(hooked.module)
    req = StandInReq("hsx-run-5-a0", _ids(8, 3))
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 4, middle=True)])
    req.is_retracted = True  # preempted: SGLang re-runs it from scratch later
    run_prefill(processor, hooked.parts, [Chunk(req, 4, 8)])
    assert hooked.files() == [] and bootstrap.process_hook().pending == {}
    req.is_retracted = False
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 4, middle=True)])
    run_prefill(processor, hooked.parts, [Chunk(req, 4, 8)])
    assert hooked.files() == [f"{req.rid}.safetensors"]
    _check_dump(hooked, req)


def test_aborted_request_gets_an_error_marker(hooked: Hooked) -> None:
    class FINISH_ABORT:  # the name SGLang's abort reason has
        message = "input too long"

    processor = make_processor(hooked.module)
    req = StandInReq("hsx-run-6-a0", [0])  # SGLang swaps an aborted prompt for one dummy token
    req.to_finish = FINISH_ABORT()
    run_prefill(processor, hooked.parts, [Chunk(req, 0, 1)])
    assert hooked.files() == [f"{req.rid}.error.json"]
    marker = protocol.read_error(protocol.error_path(hooked.dump_dir, req.rid))
    assert marker["reason"] == "aborted" and marker["message"] == "input too long"

"""The background dump writer: staging, bf16 bits, bounded queue, errors become markers."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx_extractor import protocol
from hsx_extractor.protocol import f32_to_bf16_bits
from hsx_extractor.sglang_hook.writer import (
    DumpJob,
    DumpWriter,
    ErrorJob,
    Staged,
    bf16_bits,
    run_job,
    stage,
)


def _meta(rid: str, n: int, hidden: int = 4, k: int = 2) -> protocol.DumpMeta:
    return protocol.DumpMeta(rid, n, hidden, tuple(range(2, 2 + k)), "test")


def _job(rid: str, aux: list[Staged], final: list[Staged], n: int) -> DumpJob:
    return DumpJob(_meta(rid, n), np.arange(n, dtype=np.int32), aux, final)


class _Gate:
    """Stands in for a CUDA event: the writer waits on it like on a device copy."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        assert self.open.wait(30)


def test_cpu_rows_are_kept_by_reference_and_chunks_join_in_order() -> None:
    rows = torch.randn(5, 3, dtype=torch.float32)
    staged = stage(rows)
    assert staged.host is rows and staged.event is None
    pieces = bf16_bits([stage(rows[:2]), stage(rows[2:])])
    np.testing.assert_array_equal(
        np.concatenate(pieces), rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    )


def test_float32_rows_round_to_bf16_as_torch_does() -> None:
    rng = np.random.default_rng(0)
    every_kind = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([np.inf, -np.inf, 0.0, -0.0, 3.4028235e38, -3.4028235e38, 1e-45, 1.00390625, 1.01171875],
                     dtype=np.float32)  # fmt: skip
    values = np.concatenate([every_kind, edges])
    ours = f32_to_bf16_bits(values)
    torchs = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    nan = np.isnan(values)
    assert nan.sum() > 100  # the random bit patterns include NaNs
    np.testing.assert_array_equal(ours[~nan], torchs[~nan])
    as_f32 = (ours[nan].astype(np.uint32) << 16).view(np.float32)
    assert np.isnan(as_f32).all()


def test_chunks_are_written_one_after_another(tmp_path: Path) -> None:
    aux, final = torch.randn(7, 8).to(torch.bfloat16), torch.randn(7, 4).to(torch.bfloat16)
    job = _job("hsx-c-0-a0", [stage(aux[:3]), stage(aux[3:])], [stage(final[:5]), stage(final[5:])], 7)
    dump = protocol.read_dump(run_job(tmp_path, job))
    np.testing.assert_array_equal(
        dump.aux_hidden_states.reshape(7, 8), aux.view(torch.int16).numpy().view(np.uint16)
    )
    np.testing.assert_array_equal(dump.hidden_states, final.view(torch.int16).numpy().view(np.uint16))


def test_staged_copy_releases_its_source_once_the_copy_is_done() -> None:
    gate = _Gate()
    staged = Staged(host=torch.zeros(2, 2), event=gate, source=torch.ones(2, 2))  # type: ignore[arg-type]
    gate.open.set()
    staged.wait()
    assert staged.event is None and staged.source is None


def test_a_dump_that_cannot_be_written_becomes_an_error_marker(tmp_path: Path) -> None:
    # aux is 3 wide but the meta says 2 layers x 4: not whole rows, so the protocol refuses it.
    bad = _job("hsx-w-0-a0", [stage(torch.zeros(3, 3))], [stage(torch.zeros(3, 4))], 3)
    path = run_job(tmp_path, bad)
    assert path.name == "hsx-w-0-a0.error.json"
    assert protocol.read_error(path)["reason"] == "writer_error"
    assert not protocol.dump_path(tmp_path, "hsx-w-0-a0").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hsx-w-0-a0.error.json"]


def test_writer_writes_dumps_and_markers(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path / "d", max_queue=4)
    aux, final = torch.randn(3, 8), torch.randn(3, 4)
    writer.submit(_job("hsx-w-1-a0", [stage(aux)], [stage(final)], 3))
    writer.submit(ErrorJob("hsx-w-2-a0", "row_count_mismatch", "2 rows for 3 tokens"))
    assert writer.flush(30)
    dump = protocol.read_dump(protocol.dump_path(tmp_path / "d", "hsx-w-1-a0"))
    np.testing.assert_array_equal(dump.aux_hidden_states, bf16_bits([stage(aux)])[0])
    assert (
        protocol.read_error(protocol.error_path(tmp_path / "d", "hsx-w-2-a0"))["reason"]
        == "row_count_mismatch"
    )
    assert writer.written == 2 and writer.failed == 0


def test_a_full_queue_holds_the_submitter_back(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, max_queue=1, threads=1)
    gate = _Gate()
    blocked = Staged(host=torch.zeros(1, 8), event=gate)  # type: ignore[arg-type]
    writer.submit(_job("hsx-q-0-a0", [blocked], [stage(torch.zeros(1, 4))], 1))  # the writer waits on it
    writer.submit(ErrorJob("hsx-q-1-a0", "x", "fills the queue"))
    third = threading.Thread(target=writer.submit, args=(ErrorJob("hsx-q-2-a0", "x", "must wait"),))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # still waiting for room
    gate.open.set()
    third.join(30)
    assert not third.is_alive() and writer.flush(30)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hsx-q-0-a0.safetensors",
        "hsx-q-1-a0.error.json",
        "hsx-q-2-a0.error.json",
    ]


def test_flush_waits_for_a_slow_job_while_other_writers_finish_later_ones(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, max_queue=8, threads=3)
    gate = _Gate()
    slow = Staged(host=torch.zeros(1, 8), event=gate)  # type: ignore[arg-type]
    writer.submit(_job("hsx-f-0-a0", [slow], [stage(torch.zeros(1, 4))], 1))
    for i in range(1, 6):
        writer.submit(ErrorJob(f"hsx-f-{i}-a0", "x", "quick"))
    assert not writer.flush(1.0)  # five later jobs are done; the first is not
    assert writer.written == 5
    gate.open.set()
    assert writer.flush(30) and writer.written == 6
    assert protocol.dump_path(tmp_path, "hsx-f-0-a0").exists()


def test_writers_share_the_work(tmp_path: Path) -> None:
    writer = DumpWriter(tmp_path, max_queue=8, threads=3)
    gates = [_Gate() for _ in range(3)]
    for i, gate in enumerate(gates):  # three jobs each holding a writer: all three start at once
        held = Staged(host=torch.zeros(1, 8), event=gate)  # type: ignore[arg-type]
        writer.submit(_job(f"hsx-s-{i}-a0", [held], [stage(torch.zeros(1, 4))], 1))
    writer.submit(ErrorJob("hsx-s-9-a0", "x", "waits for a free writer"))
    assert not writer.flush(0.5) and writer.written == 0
    gates[2].open.set()
    deadline = time.monotonic() + 30
    while writer.written < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writer.written == 2  # job 2 and the marker, while jobs 0 and 1 still hold their writers
    for gate in gates[:2]:
        gate.open.set()
    assert writer.flush(30) and writer.written == 4


@pytest.mark.parametrize("kw", [{"max_queue": 0}, {"threads": 0}])
def test_queue_size_and_threads_must_be_positive(tmp_path: Path, kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        DumpWriter(tmp_path, **kw)

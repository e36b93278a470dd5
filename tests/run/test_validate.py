"""Dumps against what was sent: each mismatch reason, on a plain directory of dumps."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import numpy as np
import pytest

from hsx_extractor import protocol
from hsx_extractor.protocol import DumpMeta
from hsx_extractor.reasons import Reason
from hsx_extractor.run import collect
from hsx_extractor.run.collect import Collector, Found, ServerRefused
from hsx_extractor.run.validate import DumpShapeError, Mismatch, MismatchGate

H, LAYERS = 8, (2, 4, 5)


def states(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    # Finite bf16 bit patterns: sign and exponent below all-ones.
    rng = np.random.default_rng(seed)
    return (
        rng.integers(0, 0x7F00, size=(rows, cols)) | (rng.integers(0, 2, size=(rows, cols)) << 15)
    ).astype(np.uint16)


def write(
    d: Path,
    rid: str,
    ids: list[int],
    rows: int | None = None,
    meta_rid: str | None = None,
    hidden: int = H,
    seed: int = 0,
) -> None:
    n = len(ids) if rows is None else rows
    meta = DumpMeta(meta_rid or rid, len(ids), hidden, LAYERS, "test")
    path = protocol.write_dump(
        d, meta, np.asarray(ids, np.int32), states(n, 3 * hidden, seed), states(n, hidden, seed + 1)
    )
    if meta_rid:  # another request's dump, found under this rid's name
        path.rename(protocol.dump_path(d, rid))


def checked(d: Path, rid: str, sent: list[int]) -> np.ndarray | Mismatch:
    arrival = collect.look(d, rid)
    assert arrival is not None
    got = collect.check_collected(arrival, rid, np.asarray(sent, np.int32), H, len(LAYERS))
    return got if isinstance(got, Mismatch) else got.hidden_states


def test_exact_dump_is_accepted(tmp_path: Path) -> None:
    write(tmp_path, "r1", [1, 2, 3])
    got = checked(tmp_path, "r1", [1, 2, 3])
    assert isinstance(got, np.ndarray) and got.shape == (3, H)


@pytest.mark.parametrize(
    ("ids", "rows", "meta_rid", "reason"),
    [
        ([1, 2, 4], None, None, Reason.ID_MISMATCH),  # other ids
        ([9, 1, 2, 3], None, None, Reason.ID_MISMATCH),  # a BOS added
        ([1, 2], None, None, Reason.ID_MISMATCH),  # ids truncated
        ([1, 2, 3], 2, None, Reason.LENGTH_MISMATCH),  # rows truncated
        ([1, 2, 3], 4, None, Reason.LENGTH_MISMATCH),  # rows padded
        ([1, 2, 3], None, "r-other", Reason.ID_MISMATCH),  # another request's dump under this name
    ],
)
def test_mismatches(
    tmp_path: Path, ids: list[int], rows: int | None, meta_rid: str | None, reason: Reason
) -> None:
    write(tmp_path, "r1", ids, rows, meta_rid)
    got = checked(tmp_path, "r1", [1, 2, 3])
    assert isinstance(got, Mismatch) and got.reason == reason and got.detail


@pytest.mark.parametrize("bits", [0x7FC0, 0xFFC1, 0x7F80, 0xFF80])  # NaN, -NaN, +Inf, -Inf
def test_non_finite(tmp_path: Path, bits: int) -> None:
    meta = DumpMeta("r1", 2, H, LAYERS, "test")
    final = states(2, H)
    final[1, 3] = bits
    protocol.write_dump(tmp_path, meta, np.asarray([1, 2], np.int32), states(2, 3 * H), final)
    got = checked(tmp_path, "r1", [1, 2])
    assert isinstance(got, Mismatch) and got.reason == Reason.NON_FINITE
    # Without scan_values the values are left to the shard builder, which counts them as it encodes.
    arrival = collect.look(tmp_path, "r1")
    assert arrival is not None
    left = collect.check_collected(arrival, "r1", np.asarray([1, 2], np.int32), H, len(LAYERS), scan_values=False)
    assert not isinstance(left, Mismatch) and left.hidden_states[1, 3] == bits


def test_error_marker_is_server_error(tmp_path: Path) -> None:
    protocol.write_error(tmp_path, "r1", "row_count", "expected 3 rows, got 2")
    arrival = collect.look(tmp_path, "r1")
    assert isinstance(arrival, ServerRefused) and arrival.reason == "row_count"
    got = checked(tmp_path, "r1", [1, 2, 3])
    assert isinstance(got, Mismatch) and got.reason == Reason.SERVER_ERROR and "row_count" in got.detail


def test_damaged_dump_is_a_mismatch_not_a_crash(tmp_path: Path) -> None:
    write(tmp_path, "r1", [1, 2, 3])
    path = protocol.dump_path(tmp_path, "r1")
    path.write_bytes(path.read_bytes()[:-10])
    got = checked(tmp_path, "r1", [1, 2, 3])
    assert isinstance(got, Mismatch) and got.reason == Reason.LENGTH_MISMATCH


def test_other_shape_or_layers_is_fatal(tmp_path: Path) -> None:
    write(tmp_path, "r1", [1, 2], hidden=16)
    with pytest.raises(DumpShapeError, match="hidden size 16"):
        checked(tmp_path, "r1", [1, 2])
    write(tmp_path, "r2", [1, 2])
    arrival = collect.look(tmp_path, "r2")
    assert arrival is not None
    sent = np.asarray([1, 2], np.int32)
    assert not isinstance(collect.check_collected(arrival, "r2", sent, H, 3, LAYERS), Mismatch)
    with pytest.raises(DumpShapeError, match=r"capture layers \[2, 4, 5\].*expects.*\[3, 5, 6\]"):
        collect.check_collected(arrival, "r2", sent, H, 3, (3, 5, 6))
    # The manifest names one engine for the run: a dump of another producer is a swapped server.
    assert not isinstance(collect.check_collected(arrival, "r2", sent, H, 3, LAYERS, "test"), Mismatch)
    with pytest.raises(DumpShapeError, match="written by 'test'"):
        collect.check_collected(arrival, "r2", sent, H, 3, LAYERS, "hsx-sglang-hook/sglang-0.5.23")


def test_collector_correlates_by_rid_only(tmp_path: Path) -> None:
    # Other rids' dumps, including a newer one, are never taken for ours.
    write(tmp_path, "mine", [1, 2, 3], seed=1)
    time.sleep(0.01)
    write(tmp_path, "theirs", [1, 2, 3], seed=2)
    got = asyncio.run(Collector(tmp_path).wait("mine", 1.0))
    assert isinstance(got, Found) and got.dump.meta.rid == "mine" and got.path.name == "mine.safetensors"
    assert asyncio.run(Collector(tmp_path).wait("nobody", 0.05)) is None


def test_collector_waits_for_a_late_dump(tmp_path: Path) -> None:
    async def scenario() -> Found | object:
        waiter = asyncio.create_task(Collector(tmp_path, poll_max=0.01).wait("late", 5.0))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        write(tmp_path, "late", [4, 5])
        return await waiter

    got = asyncio.run(scenario())
    assert isinstance(got, Found) and got.dump.input_ids.tolist() == [4, 5]


def test_abandoned_rids_are_swept_when_they_arrive(tmp_path: Path) -> None:
    c = Collector(tmp_path)
    c.abandon("gone")
    write(tmp_path, "gone", [1])
    write(tmp_path, "kept", [1])
    assert c.sweep() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.safetensors"]


def test_waiting_bytes_and_dead_process_cleanup(tmp_path: Path) -> None:
    write(tmp_path, "hsx-run-r0-aaa-1-a0", [1, 2])
    write(tmp_path, "hsx-run-r1-bbb-1-a0", [1, 2])
    total = sum(p.stat().st_size for p in tmp_path.iterdir())
    assert collect.waiting_bytes(tmp_path) == total > 0
    assert collect.remove_dead_processes(tmp_path, protocol.RunKey("run", 0, "ccc")) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["hsx-run-r1-bbb-1-a0.safetensors"]
    assert collect.waiting_bytes(tmp_path / "missing") == 0


def test_gate_trips_only_past_min_samples_and_rate() -> None:
    gate = MismatchGate(max_rate=0.25, window=8, min_samples=4)
    for bad in (True, True, True):
        gate.record(bad)
    assert gate.verdict() is None  # too few checked yet
    gate.record(False)
    assert "mismatch gate: 3 of the last 4" in (gate.verdict() or "")
    ok = MismatchGate(max_rate=0.25, window=4, min_samples=4)
    for bad in (True, False, False, False, False, False, False, True):
        ok.record(bad)
        assert ok.verdict() is None  # never more than 1 in 4
    ok.record(True)
    assert ok.verdict() is not None  # window now holds 2 of 4


def test_sweep_removes_a_dead_processes_late_dumps(tmp_path: Path) -> None:
    c = Collector(tmp_path, own=protocol.RunKey("run", 0, "beef"))
    for rid in ("hsx-run-r0-dead-3-a0", "hsx-run-r0-beef-3-a0", "hsx-run-r1-abcd-3-a0", "other"):
        write(tmp_path, rid, [1])
    assert c.sweep() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "hsx-run-r0-beef-3-a0.safetensors",
        "hsx-run-r1-abcd-3-a0.safetensors",
        "other.safetensors",
    ]


def test_sweep_matches_the_parsed_run_and_replica_not_a_name_prefix(tmp_path: Path) -> None:
    """runId job replica 1 once deleted the live dumps of runId job-r1 ("hsx-job-r1-" is a prefix of
    both) and of job replica 10's rids if the prefix lost its dash."""
    own = protocol.RunKey("job", 1, "aaaaaa")
    live_others = [
        protocol.make_rid(protocol.RunKey("job-r1", 0, "cccccc"), 3, 0),
        protocol.make_rid(protocol.RunKey("job-r1-bbbbbb", 2, "dddddd"), 4, 1),
        protocol.make_rid(protocol.RunKey("job", 10, "eeeeee"), 5, 0),
        protocol.make_rid(own, 6, 0),
    ]
    dead = protocol.make_rid(protocol.RunKey("job", 1, "bbbbbb"), 3, 0)
    for rid in [*live_others, dead]:
        write(tmp_path, rid, [1])
    assert Collector(tmp_path, own=own).sweep() == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{r}.safetensors" for r in live_others)
    assert collect.remove_dead_processes(tmp_path, protocol.RunKey("job", 1, "ffffff")) == 1  # own's, now dead
    assert not (tmp_path / f"{live_others[-1]}.safetensors").exists()


def test_waiting_bytes_leaves_out_reserved_rids_and_dead_writers_partials(tmp_path: Path) -> None:
    write(tmp_path, "hsx-run-r0-aaa-1-a0", [1, 2])
    mine = tmp_path / "hsx-run-r0-aaa-1-a0.safetensors"
    live = tmp_path / ".hsx-run-r0-aaa-2-a0.safetensors.123.partial"
    live.write_bytes(b"x" * 100)
    dead = tmp_path / ".hsx-run-r0-aaa-3-a0.safetensors.77.partial"
    dead.write_bytes(b"x" * 1000)
    old = time.time() - collect.STALE_PARTIAL_SECONDS - 5
    os.utime(dead, (old, old))
    assert protocol.rid_of_partial(live.name) == "hsx-run-r0-aaa-2-a0"
    assert protocol.rid_of_partial("hsx-run-r0-aaa-1-a0.safetensors") is None
    assert collect.waiting_bytes(tmp_path) == mine.stat().st_size + 100
    assert collect.waiting_bytes(tmp_path, exclude_rids={"hsx-run-r0-aaa-1-a0"}) == 100
    assert collect.waiting_bytes(tmp_path, exclude_rids={"hsx-run-r0-aaa-2-a0"}) == mine.stat().st_size
    # The collector's sweep frees the dead writer's shm; a live partial is left to its writer.
    assert Collector(tmp_path).sweep() == 1
    assert not dead.exists() and live.exists() and mine.exists()


def test_waiting_bytes_of_one_replica_and_orphans_of_dead_runs(tmp_path: Path) -> None:
    own = protocol.RunKey("job", 1, "aaaaaa")
    ours = protocol.make_rid(own, 1, 0)
    dead_process = protocol.make_rid(protocol.RunKey("job", 1, "bbbbbb"), 2, 0)
    other_run = protocol.make_rid(protocol.RunKey("job-r1", 0, "cccccc"), 3, 0)
    old_run = protocol.make_rid(protocol.RunKey("old", 0, "dddddd"), 4, 0)
    for rid in (ours, dead_process, other_run, old_run):
        write(tmp_path, rid, [1, 2])
    (tmp_path / "unrelated.bin").write_bytes(b"x" * 1000)
    (tmp_path / f".{ours}.safetensors.5.partial").write_bytes(b"x" * 10)
    size = (tmp_path / f"{ours}.safetensors").stat().st_size
    assert collect.waiting_bytes(tmp_path, own=own) == 2 * size + 10  # ours, the dead process's, our partial
    assert collect.waiting_bytes(tmp_path, exclude_rids={ours}, own=own) == size
    hour_ago = time.time() - collect.ORPHAN_DUMP_SECONDS - 1
    for rid in (old_run, other_run):
        os.utime(tmp_path / f"{rid}.safetensors", (hour_ago, hour_ago))
    os.utime(tmp_path / "unrelated.bin", (hour_ago, hour_ago))
    os.utime(tmp_path / f"{ours}.safetensors", (hour_ago, hour_ago))
    # Other runs' dumps an hour old go; ours (however old), and names outside the protocol, stay.
    assert collect.remove_orphans(tmp_path, own) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{ours}.safetensors", f"{dead_process}.safetensors", "unrelated.bin", f".{ours}.safetensors.5.partial"]
    )

"""bench/gil.py's reading of a perf trace: who held the GIL, for how long, and how much of it off a CPU."""

from __future__ import annotations

import pytest

from bench.gil import holds_of, thread_kind

# perf script --ns -F pid,tid,time,event,trace, as perf 6 prints it (lines of another process interleaved).
TRACE = """\
  100/100   1.000000000: hsx_gil:take__return: (7f089b44f7b0 <- 7f089b44fd4e)
  200/200   1.000000001: hsx_gil:take__return: (7f089b44f7b0 <- 7f089b44fd4e)
  100/101   1.100000000:         hsx_gil:drop: (7f089b44f3e0)
  100/100   1.500000000:         hsx_gil:drop: (7f089b44f3e0)
  100/101   2.000000000: hsx_gil:take__return: (7f089b44f7b0 <- 7f089b44fd4e)
  100/101   2.100000000:   sched:sched_switch: prev_comm=python prev_pid=101 prev_prio=120 prev_state=R ==> next_comm=python next_pid=201 next_prio=120
  200/201   2.400000000:   sched:sched_switch: prev_comm=python prev_pid=201 prev_prio=120 prev_state=S ==> next_comm=python next_pid=101 next_prio=120
  100/101   2.600000000:         hsx_gil:drop: (7f089b44f3e0)
  100/101   2.700000000:   sched:sched_switch: prev_comm=python prev_pid=101 prev_prio=120 prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
  100/-1    2.900000000:   sched:sched_switch: prev_comm=python prev_pid=101 prev_prio=120 prev_state=X ==> next_comm=swapper/0 next_pid=0 next_prio=120
  200/200   3.000000000:         hsx_gil:drop: (7f089b44f3e0)
"""


def test_holds_are_summed_per_thread_with_the_time_switched_out_apart() -> None:
    holds = holds_of(iter(TRACE.splitlines()), 100, {100: "main", 101: "hsx-part_3"})
    # main 1.0-1.5; 101 2.0-2.6 of which 2.1-2.4 off a CPU; its drop at 1.1 ended a hold the trace never saw
    # begin; process 200 is another one.
    assert holds.held == pytest.approx(1.1)
    assert holds.held_switched_out == pytest.approx(0.3)
    assert holds.held_on_cpu == pytest.approx(0.8)
    assert holds.acquisitions == 2 and holds.threads == 2
    assert holds.by_thread == pytest.approx({"main": 0.5, "hsx-part": 0.3})


def test_a_thread_is_known_by_its_pool() -> None:
    assert thread_kind("hsx-part_3") == "hsx-part"
    assert thread_kind("asyncio_0") == "asyncio"
    assert thread_kind("ThreadPoolExecutor-0_12") == "ThreadPoolExecutor"
    assert thread_kind("main") == "main"

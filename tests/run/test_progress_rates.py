"""Rates and ETA follow the last minute while running: a stall shows as 0 tok/s within a minute,
not as a whole-run average decaying over hours."""

from __future__ import annotations

import pytest

from hsx_extractor.run import progress as progress_mod
from hsx_extractor.run.progress import RATE_WINDOW_S, Progress
from tests.run.helpers import Clock


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(progress_mod.time, "monotonic", c)
    return c


def run_for(p: Progress, clock: Clock, seconds: int, per_second: int, tokens: int = 100) -> None:
    for _ in range(seconds):
        clock.now += 1
        for _ in range(per_second):
            p.sample_done(tokens)


def test_a_stall_shows_within_the_window_and_the_eta_disappears(clock: Clock) -> None:
    p = Progress("r", 0, samples_total=100_000)
    p.mark_running()
    run_for(p, clock, 3600, 10)  # an hour at 10 samples/s
    busy = p.report()
    assert busy.samplesPerSecond == pytest.approx(10, rel=0.05) and busy.tokensPerSecond == pytest.approx(1000, rel=0.05)
    assert busy.etaSeconds == pytest.approx((100_000 - 36_000) / 10, rel=0.05)
    clock.now += RATE_WINDOW_S + 1  # the server stalls
    stalled = p.report()
    assert stalled.samplesPerSecond == 0 and stalled.tokensPerSecond == 0 and stalled.etaSeconds is None
    # The whole-run average would still say ~9.8/s; the new pace shows as soon as it resumes.
    run_for(p, clock, 120, 2)
    assert p.report().samplesPerSecond == pytest.approx(2, rel=0.05)


def test_resumed_samples_are_not_throughput_and_the_end_reports_the_run(clock: Clock) -> None:
    p = Progress("r", 0, samples_total=1000, samples_done=600, samples_resumed=600)
    p.mark_running()
    run_for(p, clock, 10, 5)
    assert p.report().samplesPerSecond == pytest.approx(5, rel=0.1)  # not (600 + 50) / 10
    run_for(p, clock, 90, 5)
    p.mark_succeeded()
    clock.now += 500
    done = p.report()
    assert done.samplesPerSecond == pytest.approx(5, rel=0.05)  # over the run, not the idle time after


def test_a_shard_counts_once_when_another_process_commits_it_while_this_one_works_on_it() -> None:
    """A race or a takeover on a stale listing: this process finishes samples of a shard another commits first.
    The run's counts take the shard's rows once, whichever news comes first; the tokens stay this process's work."""
    from hsx_extractor.storage.commit_record import QuarantineEntry, ShardCommit

    def commit(shard: int) -> ShardCommit:
        bad = (QuarantineEntry(shard * 10 + 9, None, "too_long", "long"),)
        return ShardCommit(shard, 9, 1, 100, 1000, "k", "0123456789abcdef", shard * 10, shard * 10 + 10,
                           tuple(range(shard * 10, shard * 10 + 9)), bad)  # fmt: skip

    p = Progress("r", 0)
    for _ in range(4):  # shard 0: four of its samples here, then another process's commit arrives
        p.sample_done(10, shard=0)
    p.sample_quarantined("too_long", shard=0)
    p.shard_resumed(0, commit(0), 10)
    for _ in range(5):  # the rest of shard 0 here, after: already counted
        p.sample_done(10, shard=0)
    p.shard_resumed(1, commit(1), 10)  # shard 1 counted first, then worked on here too
    for _ in range(9):
        p.sample_done(10, shard=1)
    p.shard_committed(1, 100)  # the loser adopts the committed shard
    report = p.report()
    assert (report.samplesDone, report.samplesWritten, report.samplesQuarantined) == (20, 18, 2)
    assert report.quarantinedByReason == {"too_long": 2} and report.tokensDone == 180
    for _ in range(3):  # a shard only this process works on counts as before
        p.sample_done(1, shard=2)
    p.sample_quarantined("no_dump", shard=2)
    p.shard_committed(2, 10)
    assert p.report().samplesDone == 24 and p.report().quarantinedByReason == {"no_dump": 1, "too_long": 2}


def test_one_window_keeps_the_marks_of_every_rate() -> None:
    """RateWindow, the one keeper of marks (Progress's samples and tokens, Pace's decode and prefill): the rate
    over the last minute, marks thinned to one a second, 0 after a silent minute, None before any mark."""
    window = progress_mod.RateWindow()
    assert window.empty and window.rates(0.0, (0,)) is None
    window.restart(0.0, (0,))
    for second in range(1, 121):
        for tenth in range(10):  # ten adds a second: marks two apart are a second apart, whatever the adds
            window.mark(second + tenth / 10, (second * 10 + tenth,))
    assert len(window._marks) <= 2 * RATE_WINDOW_S / progress_mod.MARK_EVERY_S + 2
    (rate,) = window.rates(121.0, (1210,)) or (None,)
    assert rate == pytest.approx(10.0, rel=0.05)  # the last minute's, not the first minute's zeros
    (silent,) = window.rates(121.0 + RATE_WINDOW_S + 1, (1210,)) or (None,)
    assert silent == 0.0


def test_the_generation_pace_counts_its_first_turn_and_falls_to_zero(clock: Clock) -> None:
    pace = progress_mod.Pace()
    assert pace.rates(True, 0.0) == (0.0, 0.0, 0.0)
    pace.add(100, 50, rows=1)
    clock.now += 10
    pace.add(100, 50, rows=1)
    decode, prefill, rows = pace.rates(True, 10.0)
    assert decode == pytest.approx(20.0) and prefill == pytest.approx(10.0) and rows == pytest.approx(0.2)
    assert pace.rates(False, 20.0) == (10.0, 5.0, 0.1)  # the whole run once it ended
    clock.now += RATE_WINDOW_S + 1
    assert pace.rates(True, 80.0) == (0.0, 0.0, 0.0)


def test_a_regenerating_run_has_its_generations_pace_for_eta_between_its_bursts_of_captures(clock: Clock) -> None:
    """Captures come a shard at a time after its generations: their rate swings from a burst to nothing, while
    rows are generated at a steady pace, which is the run's."""
    p = Progress("r", 0, samples_total=1000)
    p.mark_running()
    for minute in range(3):
        for _ in range(60):  # a row generated a second...
            clock.now += 1
            p.generated(50, 20, rows=1)
        for _ in range(60):  # ...and the shard's 60 captures in one burst
            p.sample_done(70)
        report = p.report()
        assert report.etaSeconds == pytest.approx((1000 - 60 * (minute + 1)) / 1.0, rel=0.05)
    clock.now += RATE_WINDOW_S + 1  # generated all it could, capturing the rest: the capture's pace
    assert p.report().etaSeconds is None  # neither moved for a window: no pace, no ETA
    for _ in range(2 * int(RATE_WINDOW_S)):
        clock.now += 1
        p.sample_done(70)
    assert p.report().etaSeconds == pytest.approx((1000 - 180 - 120) / 1.0, rel=0.05)

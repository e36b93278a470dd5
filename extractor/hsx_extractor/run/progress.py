"""Progress: the run's counters in one place, served as GET /progress (JSON) and GET /metrics
(Prometheus), logged as one unbuffered line per interval, and drawn as a bar on a TTY."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from aiohttp import web
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hsx_extractor.contract import ExtractorState, ProgressReport
from hsx_extractor.storage.commit_record import ShardCommit

# Rates (and the ETA from them) while running are over the last minute, not the whole process: after
# hours of extraction a stalled server must show 0 tok/s within a minute, not an average decaying slowly.
RATE_WINDOW_S = 60.0
MARK_EVERY_S = 1.0


# The share of the dataset read before the rows placed so far estimate its total (1%: the first rows can mislead).
MIN_READ_FRACTION = 0.01

@dataclass
class RateWindow:
    """Marks of running totals for their rates over the last RATE_WINDOW_S: the newest mark is always the
    current totals, older ones stay at least MARK_EVERY_S apart, and the first is the newest at or before
    the window's start (or the first mark of all)."""

    _marks: deque[tuple[float, tuple[int, ...]]] = field(default_factory=deque)

    @property
    def empty(self) -> bool:
        return not self._marks

    def restart(self, now: float, totals: tuple[int, ...]) -> None:
        self._marks.clear()
        self.mark(now, totals)

    def mark(self, now: float, totals: tuple[int, ...]) -> None:
        if len(self._marks) >= 2 and now - self._marks[-2][0] < MARK_EVERY_S:
            self._marks[-1] = (now, totals)
        else:
            self._marks.append((now, totals))
        while len(self._marks) > 1 and self._marks[1][0] <= now - RATE_WINDOW_S:
            self._marks.popleft()

    def rates(self, now: float, totals: tuple[int, ...]) -> tuple[float, ...] | None:
        """Per second over the window (0 once nothing came for a window); None before the first mark."""
        if not self._marks:
            return None
        self.mark(now, totals)
        since, base = self._marks[0]
        span = max(now - since, 1e-9)
        return tuple((total - old) / span for total, old in zip(totals, base, strict=True))


@dataclass
class Pace:
    """A generation's running totals (decoded tokens, prefilled tokens, rows) and their rates over the
    last RATE_WINDOW_S."""

    decoded: int = 0
    prefilled: int = 0
    rows: int = 0
    _window: RateWindow = field(default_factory=RateWindow)

    def add(self, decoded: int, prefilled: int, rows: int = 0) -> None:
        self.decoded += decoded
        self.prefilled += prefilled
        self.rows += rows
        now = time.monotonic()
        if self._window.empty:
            self._window.mark(now, (0, 0, 0))  # the first add counts toward the rate
        self._window.mark(now, (self.decoded, self.prefilled, self.rows))

    def rates(self, windowed: bool, elapsed: float) -> tuple[float, float, float]:
        """Per second over the window while running (0 once nothing came for a window), else the whole run."""
        totals = (self.decoded, self.prefilled, self.rows)
        if not windowed:
            return (totals[0] / elapsed, totals[1] / elapsed, totals[2] / elapsed) if elapsed > 0 else (0.0, 0.0, 0.0)
        got = self._window.rates(time.monotonic(), totals)
        return (got[0], got[1], got[2]) if got else (0.0, 0.0, 0.0)


@dataclass
class Progress:
    """Counters of one extractor process, for the whole run: samples of shards committed before a
    restart or by other processes count as done (``samples_resumed``) once this process has seen their
    commit; rates and ETA use only what this process did: over the last
    :data:`RATE_WINDOW_S` while running, over the whole run once it ended."""

    run_id: str
    replica_index: int
    state: ExtractorState = "starting"
    samples_total: int = 0
    samples_done: int = 0  # added to a shard or quarantined, resumed ones included
    samples_written: int = 0  # of samples_done, added to a shard (the rest: sum of quarantined)
    samples_resumed: int = 0
    tokens_done: int = 0
    bytes_committed: int = 0
    shards_committed: int = 0
    shards_total: int = 0
    # True while the plan is made as the dataset is read (no plan.json yet): the totals are what was
    # read so far, and there is no ETA.
    planning: bool = False
    last_error: str | None = None
    failure_reason: str | None = None  # a failure's own name (DatasetRejected), for the operator
    waiting_for: str | None = None  # before running: what the run waits for (the server's /health)
    quarantined: Counter[str] = field(default_factory=Counter)
    # Shards counted as committed (this process's, and others' it has seen): each counts once.
    counted_shards: set[int] = field(default_factory=set)
    # Rates count from the first request (not from start-up) to the end of the run.
    running_since: float | None = None
    finished_at: float | None = None
    _metrics: Metrics | None = None
    _in_flight_probe: Callable[[], int] | None = None
    _leased_probe: Callable[[], int] | None = None
    _planning_probe: Callable[[], tuple[int, int, bool]] | None = None
    _read_fraction: Callable[[], float | None] | None = None
    # (checked, failed) of the consistency check, read when asked
    _consistency_probe: Callable[[], tuple[int, int]] | None = None
    on_commit: Callable[[], None] = lambda: None  # after each shard this process commits (leases: wake)
    # (samples this process finished, tokens) since it started running.
    _window: RateWindow = field(default_factory=RateWindow)
    # Samples this process counted per shard not yet counted as committed (shard_resumed takes them back).
    _own_done: Counter[int] = field(default_factory=Counter)
    _own_written: Counter[int] = field(default_factory=Counter)
    _own_quarantined: defaultdict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    # responses: regenerate: rows this process generated, and the tokens decoded and prefilled for them.
    samples_generated: int = 0
    generation: Pace = field(default_factory=lambda: Pace())

    def __post_init__(self) -> None:
        self._metrics = Metrics()

    def _totals(self) -> tuple[int, int]:
        """What this process did: samples finished (not those counted from others' commits) and tokens."""
        return self.samples_done - self.samples_resumed, self.tokens_done

    def _mark(self, now: float) -> None:
        self._window.mark(now, self._totals())

    @property
    def metrics(self) -> Metrics:
        assert self._metrics is not None
        return self._metrics

    # Updates: every change goes through these, so /metrics and /progress never disagree.
    def sample_done(self, tokens: int, shard: int | None = None) -> None:
        """A sample written to ``shard`` by this process. If the shard was already counted (another process
        committed it first: a race, a stale takeover), the run's counts have its rows: only the work counts."""
        self.tokens_done += tokens
        if self._own_sample(shard):
            self.samples_done += 1
            self.samples_written += 1
            self._own_written[shard] += 1  # type: ignore[index]
        self.metrics.samples.inc()
        self.metrics.tokens.inc(tokens)
        if self.running_since is not None:
            self._mark(time.monotonic())

    def generated(self, decoded: int, prefilled: int, rows: int = 0) -> None:
        """A turn generated (its tokens), or a row's generation done (``rows``)."""
        self.samples_generated += rows
        self.generation.add(decoded, prefilled, rows)
        self.metrics.generated.labels(phase="decode").inc(decoded)
        self.metrics.generated.labels(phase="prefill").inc(prefilled)

    def sample_quarantined(self, reason: str, shard: int | None = None) -> None:
        if self._own_sample(shard):
            self.samples_done += 1
            self.quarantined[reason] += 1
            self._own_quarantined[shard][reason] += 1  # type: ignore[index]
        self.metrics.quarantined.labels(reason=reason).inc()
        if self.running_since is not None:
            self._mark(time.monotonic())

    def watch_planning(
        self, probe: Callable[[], tuple[int, int, bool]], fraction: Callable[[], float | None] = lambda: None
    ) -> None:
        """While planning, the totals are ``probe()``: (samples, shards) of this replica placed so far and
        whether the plan is made, which ends planning; ``fraction()``: how much of the dataset was read
        (by bytes), when known, which makes an estimate of the total and so an ETA."""
        self._planning_probe = probe
        self._read_fraction = fraction
        self.planning = True

    def total_estimate(self) -> int | None:
        """While planning: the samples placed so far over the fraction of the dataset read (never
        below what is placed); None when the fraction is unknown or too small to say."""
        if not self.planning or self._read_fraction is None:
            return None
        read = self._read_fraction()
        if not read or read < MIN_READ_FRACTION:
            return None
        return max(self.samples_total, round(self.samples_total / read))

    def _read_planning(self) -> None:
        if self.planning and self._planning_probe is not None:
            samples, shards, made = self._planning_probe()
            if made:
                self.plan_known(samples, shards)
            else:
                self.samples_total, self.shards_total = samples, shards

    def plan_known(self, samples: int, shards: int) -> None:
        self.samples_total, self.shards_total, self.planning = samples, shards, False
        self._planning_probe = None

    def _own_sample(self, shard: int | None) -> bool:
        """Whether a sample this process finished in ``shard`` counts toward the run (its shard not counted
        yet); counted ones are remembered per shard until the shard is."""
        if shard is None:
            return True
        if shard in self.counted_shards:
            return False
        self._own_done[shard] += 1
        return True

    def shard_resumed(self, shard: int, commit: ShardCommit | None, rows: int) -> None:
        """A shard committed by an earlier process or another replica: its rows are done (``commit``
        None: its record is gone; the shard still counts as committed). Each shard counts once, less
        the samples of it this process already counted (it worked on the shard too)."""
        if shard in self.counted_shards:
            return
        self.counted_shards.add(shard)
        own = self._own_done.pop(shard, 0)
        self.samples_done += rows - own
        self.samples_resumed += rows - own
        self.shards_committed += 1
        written, quarantined = self._own_written.pop(shard, 0), self._own_quarantined.pop(shard, Counter())
        if commit is not None:
            self.bytes_committed += commit.bytes_stored
            self.samples_written += commit.samples - written
            self.quarantined.update(q.reason for q in commit.quarantine)
        else:
            self.samples_written -= written
        if quarantined:
            self.quarantined.subtract(quarantined)
            self.quarantined = Counter({r: n for r, n in self.quarantined.items() if n > 0})

    def shard_committed(self, shard: int, nbytes: int, seconds: float | None = None) -> None:
        """One shard stored and committed; ``seconds``: its seal (upload and commit record) took."""
        self.counted_shards.add(shard)
        for own in (self._own_done, self._own_written, self._own_quarantined):
            own.pop(shard, None)
        self.shards_committed += 1
        self.bytes_committed += nbytes
        self.metrics.shards.inc()
        self.metrics.bytes.inc(nbytes)
        if seconds is not None:
            self.metrics.seal_seconds.observe(seconds)
        self.on_commit()

    def watch_in_flight(self, probe: Callable[[], int]) -> None:
        """Read requests in flight from ``probe`` (the client's counter) whenever asked."""
        self._in_flight_probe = probe
        self.metrics.in_flight.set_function(lambda: float(probe()))

    def watch_leases(self, probe: Callable[[], int]) -> None:
        """Read the shards this process holds from ``probe`` whenever asked."""
        self._leased_probe = probe

    def watch_consistency(self, probe: Callable[[], tuple[int, int]]) -> None:
        self._consistency_probe = probe

    def waiting(self, why: str) -> None:
        """Before the run starts: what it waits for (shown in lastError and the log line)."""
        self.last_error = self.waiting_for = why

    def mark_running(self) -> None:
        if self.last_error is not None and self.last_error == self.waiting_for:
            self.last_error = None  # the wait is over; a real error stays
        self.state = "running"
        self.running_since = time.monotonic()
        self._window.restart(self.running_since, self._totals())

    def mark_succeeded(self) -> None:
        self.state = "succeeded"
        self.finished_at = time.monotonic()

    def fail(self, message: str, reason: str | None = None) -> None:
        self.state = "failed"
        self.finished_at = time.monotonic()
        self.last_error = message
        self.failure_reason = reason

    @property
    def elapsed(self) -> float:
        """Seconds spent extracting (0 before the first request)."""
        if self.running_since is None:
            return 0.0
        return (self.finished_at or time.monotonic()) - self.running_since

    def rates(self) -> tuple[float, float]:
        """(samples/s, tokens/s): over the last RATE_WINDOW_S while running, else the whole run."""
        fresh, tokens = self._totals()
        if self.state == "running" and (got := self._window.rates(time.monotonic(), (fresh, tokens))) is not None:
            return got[0], got[1]
        elapsed = max(self.elapsed, 1e-9)
        return fresh / elapsed, tokens / elapsed

    def report(self) -> ProgressReport:
        samples_rate, tokens_rate = self.rates()
        self._read_planning()
        estimate = self.total_estimate()
        remaining = max((estimate or self.samples_total) - self.samples_done, 0)
        decode_rate, prefill_rate, rows_rate = self.generation.rates(self.state == "running", self.elapsed)
        # A regenerating run goes at its generation's pace: its captures come a shard at a time, after each
        # shard's generations, so their own rate swings from a burst to nothing. Capture alone is left once
        # every row is generated.
        pace = rows_rate if rows_rate > 0 else samples_rate
        eta = remaining / pace if pace > 0 and (not self.planning or estimate) else None
        checked, failed = self._consistency_probe() if self._consistency_probe else (0, 0)
        return ProgressReport(
            samplesGenerated=self.samples_generated,
            generationDecodeTokensPerSecond=round(decode_rate, 3),
            generationPrefillTokensPerSecond=round(prefill_rate, 3),
            samplesTotal=self.samples_total,
            samplesDone=self.samples_done,
            samplesWritten=self.samples_written,
            samplesQuarantined=sum(self.quarantined.values()),
            tokensDone=self.tokens_done,
            samplesPerSecond=round(samples_rate, 3),
            tokensPerSecond=round(tokens_rate, 3),
            etaSeconds=None if eta is None else round(eta, 1),
            bytesCommitted=self.bytes_committed,
            shardsCommitted=self.shards_committed,
            shardsTotal=self.shards_total,
            planning=self.planning,
            samplesTotalEstimate=estimate,
            requestsInFlight=self._in_flight_probe() if self._in_flight_probe else 0,
            shardsLeased=self._leased_probe() if self._leased_probe and self.state == "running" else 0,
            lastError=self.last_error,
            failureReason=self.failure_reason,
            state=self.state,
            runId=self.run_id,
            replicaIndex=self.replica_index,
            quarantinedByReason=dict(sorted(self.quarantined.items())),
            consistencyChecked=checked,
            consistencyFailed=failed,
        )

    def snapshot(self) -> dict[str, Any]:
        """The report as GET /progress serves it."""
        return self.report().model_dump()

    def termination_message(self) -> str:
        """The final report, as the operator reads it once the pod is gone."""
        return self.report().termination_message()

    def quarantine_summary(self) -> str:
        """One line: how many samples were written and quarantined, the quarantined ones by reason."""
        total = sum(self.quarantined.values())
        written = self.samples_written
        by_reason = sorted(self.quarantined.items(), key=lambda kv: (-kv[1], kv[0]))
        reasons = f": {', '.join(f'{reason} {n}' for reason, n in by_reason)}" if total else ""
        return f"written {written}, quarantined {total}{reasons}"

    def log_line(self) -> str:
        s = self.snapshot()
        eta = "-" if s["etaSeconds"] is None else f"{s['etaSeconds']:.0f}s"
        return (
            f"hsx progress state={s['state']} samples={s['samplesDone']}/{s['samplesTotal']}{'+' if s['planning'] else ''} "
            f"written={s['samplesWritten']} quarantined={s['samplesQuarantined']} tokens={s['tokensDone']} "
            f"tok/s={s['tokensPerSecond']:.1f} shards={s['shardsCommitted']}/{s['shardsTotal']} "
            f"bytes={s['bytesCommitted']} in_flight={s['requestsInFlight']} eta={eta}"
            f" checked={s['consistencyChecked']} inconsistent={s['consistencyFailed']}"
            + (f" ({s['lastError']})" if s["state"] == "starting" and s["lastError"] else "")
        )


class Metrics:
    """Prometheus series, in a registry of their own (several runs may share a process in tests)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = PromCounter("hsx_samples_done", "Samples written to a shard.", registry=r)
        self.quarantined = PromCounter(
            "hsx_samples_quarantined", "Samples quarantined, by reason.", ["reason"], registry=r
        )
        self.tokens = PromCounter("hsx_tokens_done", "Tokens of samples written to a shard.", registry=r)
        self.bytes = PromCounter("hsx_bytes_committed", "Stored bytes of committed shards.", registry=r)
        self.shards = PromCounter("hsx_shards_committed", "Shards committed by this process.", registry=r)
        self.in_flight = Gauge("hsx_requests_in_flight", "Requests at the server now.", registry=r)
        self.generated = PromCounter(
            "hsx_generated_tokens", "responses: regenerate: tokens decoded or prefilled to generate.", ["phase"], registry=r
        )
        self.seal_seconds = Histogram(
            "hsx_shard_seal_seconds",
            "Time to store one shard: its upload (or file write) and its commit record.",
            buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
            registry=r,
        )


def progress_app(progress: Progress) -> web.Application:
    async def get_progress(_: web.Request) -> web.Response:
        return web.json_response(progress.snapshot())

    async def get_metrics(_: web.Request) -> web.Response:
        body = generate_latest(progress.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/progress", get_progress)
    app.router.add_get("/metrics", get_metrics)
    return app


async def start_progress_server(progress: Progress, host: str, port: int) -> web.AppRunner:
    """Serve /progress and /metrics; the caller cleans up the runner."""
    runner = web.AppRunner(progress_app(progress), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


def bound_port(runner: web.AppRunner) -> int:
    """The port a runner listens on (for port 0: the one the OS chose)."""
    for site in runner.sites:
        server = getattr(site, "_server", None)
        if server is not None and server.sockets:
            return int(server.sockets[0].getsockname()[1])
    raise RuntimeError("progress server is not listening")


def _bar_text(s: dict[str, Any]) -> str:
    eta = s["etaSeconds"]
    eta_text = "-" if eta is None else f"{int(eta) // 3600}:{int(eta) % 3600 // 60:02d}:{int(eta) % 60:02d}"
    return f"{s['tokensPerSecond']:.0f} tok/s, quarantined {s['samplesQuarantined']}, ETA {eta_text}"


async def _bar_loop(progress: Progress, stream: TextIO) -> None:
    """A terminal's live bar: samples done of the total (growing while planning), tok/s, quarantined
    and hsx's own ETA (rates of this process only, as /progress gives them)."""
    from tqdm import tqdm

    try:
        width, height = os.get_terminal_size(stream.fileno())
    except (OSError, ValueError, AttributeError):
        width, height = 0, 0
    # A terminal that reports no size (a bare pty, some CI runners) would get no bar at all from tqdm.
    bar = tqdm(total=0, file=stream, unit="sample", ncols=width or 100, nrows=height or 24, mininterval=0,
               bar_format="{desc} {percentage:3.0f}%|{bar}| {n}/{total} samples{postfix}")  # fmt: skip

    def draw() -> None:
        s = progress.snapshot()
        bar.set_description_str(f"hsx {s['state']}", refresh=False)
        bar.total, bar.n = s["samplesTotalEstimate"] or s["samplesTotal"], s["samplesDone"]
        bar.set_postfix_str(_bar_text(s), refresh=False)
        bar.refresh()

    try:
        while True:
            draw()
            await asyncio.sleep(0.25)
    finally:
        draw()  # the last state, before the run's closing lines
        bar.close()


async def report_loop(progress: Progress, interval: float, stream: TextIO | None = None) -> None:
    """On a terminal, a live bar; otherwise (a pod's log, a pipe) one flushed log line per interval."""
    stream = stream or sys.stderr
    if stream.isatty():
        await _bar_loop(progress, stream)
    while True:
        await asyncio.sleep(interval)
        print(progress.log_line(), file=stream, flush=True)

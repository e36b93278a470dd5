"""Shard leases: which process works on which shard, decided through the store alone.

A replica claims a shard when its reader reaches the shard's first row, so it holds only what it is
about to work on; shards held by others are skipped. When its pass over the dataset ends it takes over
shards whose lease expired or was released, then (once idle, nothing left to take) races the in-flight
shard held longest, once per shard. It ends when every planned shard is committed. No coordinator, no
operator: the objects below, written with the store's create-if-absent (the same conditional write the
commit protocol needs), a listing and deletes.

    leases/shard-{k:06d}/g{gen:06d}                              generation ``gen`` of shard k's lease
    leases/shard-{k:06d}/g{gen:06d}.b{beat:08d}.{kind}.{holder}  its holder's renewals

Only one process can create a generation (``If-None-Match``); it holds its creator's name and a nonce,
so a creator whose reply was lost knows it as its own. A generation's beats are written by its holder
only, a new object per renewal (the previous one deleted), so nothing is ever overwritten.
Holder ``{slot}-{process}`` (protocol.RunKey: ``r{replica}`` or ``r{replica}w{worker}``); kind: claim (a free shard), take (an expired or
released one), race (a live one, speculatively), free (released by its holder).

Expiry is observed, never computed from a timestamp: a lease is expired once a process has seen the
same newest (generation, beat) for ``leaseSeconds`` of its own monotonic clock, so clock skew between
nodes cannot expire a live lease early or keep a dead one. A lease whose holder is another process of
this slot is expired at once (the Job replaces a pod only after it failed: podReplacementPolicy; the
supervisor starts a worker again only after it exited).

Leases only decide who works on what. Two writers of one shard (a race, a paused holder) both seal it
and the commit protocol keeps exactly one (storage/store.py: the loser adopts the winner's shard), so
a lease can neither lose nor duplicate a sample.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hsx_extractor.storage.backends import PermanentStoreError, StoreError
from hsx_extractor.storage.store import Store

LEASE_SECONDS = 60.0
LEASE_BODY_BYTES = 256  # a holder and a nonce: what a read-back of anyone's lease takes


@dataclass(frozen=True)
class LeaseState:
    """Shard k's newest lease generation as listed: its newest beat (-1: none yet), kind and holder."""

    generation: int
    beat: int = -1
    kind: str = "claim"
    holder: str = ""

    @property
    def slot(self) -> str | None:
        return self.holder.split("-")[0] if self.holder else None


def replica_of(slot: str) -> str:
    """The replica (pod) part of a slot: ``r3`` of ``r3w1`` (protocol.RunKey.slot)."""
    return slot.split("w", 1)[0]


def lease_states(parsed: Iterable[tuple[int, int, tuple[int, str, str] | None]]) -> dict[int, LeaseState]:
    """Each shard's newest generation and that generation's newest beat, from parsed lease keys."""
    gens: dict[int, int] = {}
    beats: dict[tuple[int, int], tuple[int, str, str]] = {}
    for shard, gen, beat in parsed:
        gens[shard] = max(gens.get(shard, -1), gen)
        if beat is not None and beat > beats.get((shard, gen), (-1, "", "")):
            beats[(shard, gen)] = beat
    states = {}
    for shard, gen in gens.items():
        number, kind, holder = beats.get((shard, gen), (-1, "claim", ""))
        states[shard] = LeaseState(gen, number, kind, holder)
    return states


class LeaseObserver:
    """What one process has seen of the leases, and since when (its monotonic clock): expiry by
    observation alone."""

    def __init__(self, ttl: float, slot: str, holder: str) -> None:
        self.ttl, self.slot, self.holder = ttl, slot, holder
        self.states: dict[int, LeaseState] = {}
        self._since: dict[int, tuple[LeaseState, float]] = {}  # shard -> (state, first seen)
        self._gen_since: dict[int, tuple[int, float]] = {}  # shard -> (generation, first seen)

    def observe(self, states: dict[int, LeaseState], now: float) -> None:
        self.states = states
        for shard, state in states.items():
            if self._since.get(shard, (None, 0.0))[0] != state:
                self._since[shard] = (state, now)
            if self._gen_since.get(shard, (-1, 0.0))[0] != state.generation:
                self._gen_since[shard] = (state.generation, now)

    def status(self, shard: int, now: float) -> str:
        """free (never leased), mine, live, or expired (released, dead, or silent for ttl)."""
        state = self.states.get(shard)
        if state is None:
            return "free"
        if state.holder == self.holder:
            return "mine"
        if state.kind == "free" or (state.holder and state.slot == self.slot):
            return "expired"
        return "expired" if now - self._since[shard][1] >= self.ttl else "live"

    def held_since(self, shard: int) -> float:
        """When this process first saw the shard's current generation."""
        return self._gen_since[shard][1]


class Leases:
    """This process's leases in ``store``: claims, takeovers, races, renewal in a thread, release."""

    def __init__(
        self,
        store: Store,
        slot: str,
        process: str,
        ttl: float = LEASE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.layout, self.backend = store, store.layout, store.backend
        self.ttl, self.clock = ttl, clock
        self.holder = f"{slot}-{process}"
        self.observer = LeaseObserver(ttl, slot, self.holder)
        self.held: dict[int, tuple[int, int, str]] = {}  # shard -> (generation, beat, kind)
        self.lost: set[int] = set()  # held once, taken over since (worked on anyway)
        # Every shard this process took: its engine finishes them, so none is taken twice here.
        self.worked: set[int] = set()
        # Whether racing a shard costs only its capture (a regenerating run: its generations are stored).
        self.raceable: Callable[[int], bool] = lambda shard: True
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._wake = threading.Event()  # set when this process commits a shard, or stops
        self._renewer: threading.Thread | None = None
        self.on_tick: Callable[[], None] = lambda: None  # run after each renewal round (progress)

    # -- start and stop -----------------------------------------------------------------------
    def probe(self) -> None:
        """Refuse a store that cannot hold leases: a created object must be listed, refused a
        second time, and gone from the listing once deleted."""
        key = self.layout.beat_key(999_999, 0, 0, "free", self.holder)  # this process's own
        ok = self._create_own(key) and not self.backend.put_if_absent(key, b"again")
        ok = ok and key in set(self.backend.list_keys(self.layout.lease_prefix(999_999)))
        self.backend.delete(key)
        if not ok or key in set(self.backend.list_keys(self.layout.lease_prefix(999_999))):
            raise PermanentStoreError(
                f"{self.store.description} cannot hold shard leases: a created object must be refused a "
                "second create, listed at once and unlisted once deleted (run/leases.py)"
            )

    def start(self) -> None:
        self._renewer = threading.Thread(target=self._renew_forever, name="hsx-leases", daemon=True)
        self._renewer.start()

    def stop(self, release: bool = False) -> None:
        """Stop renewing; ``release``: mark every held lease free so others take it at once."""
        self._stopped.set()
        self._wake.set()
        if release:
            for shard in list(self.held):
                self._beat(shard, kind="free")

    @property
    def stopped(self) -> threading.Event:
        return self._stopped

    def wake(self) -> None:
        """This process committed a shard: an idle :func:`work_left` looks again now, not at its next poll."""
        self._wake.set()

    def wait(self, seconds: float) -> None:
        """Until :meth:`wake` or :meth:`stop`, or ``seconds`` at most."""
        self._wake.wait(seconds)
        self._wake.clear()

    # -- taking work ----------------------------------------------------------------------------
    def claim(self, shard: int) -> bool:
        """The reader reached shard ``shard``'s first row: take it if no process ever leased it, or
        if its lease was expired at the last :meth:`scan` (an earlier process of this replica's)."""
        if shard in self.worked:
            return False
        if self._create(shard, 0, "claim"):
            return True
        return self.observer.status(shard, self.clock()) == "expired" and self.take(shard)

    def scan(self) -> None:
        """List every lease once and note what changed since the last scan."""
        parsed = (self.layout.parse_lease_key(k) for k in self.backend.list_keys(self.layout.leases_prefix))
        self.observer.observe(lease_states(p for p in parsed if p is not None), self.clock())

    def takeable(self, shards: Iterable[int], committed: set[int]) -> list[int]:
        """Uncommitted shards no live process holds (after :meth:`scan`), held ones of ours aside."""
        now = self.clock()
        return [k for k in shards if k not in committed and k not in self.worked
                and self.observer.status(k, now) in ("free", "expired")]  # fmt: skip

    def take(self, shard: int, kind: str = "take") -> bool:
        state = self.observer.states.get(shard)
        return self._create(shard, 0 if state is None else state.generation + 1, kind)

    def race_candidate(self, shards: Iterable[int], committed: set[int]) -> int | None:
        """A live, uncommitted shard of another replica not raced yet: the one held longest. A sibling
        worker of this pod sends to the same server, so racing it would only do its work twice; a shard
        that is not :attr:`raceable` (its generations not stored yet) would cost its decode twice."""
        now, pod = self.clock(), replica_of(self.observer.slot)
        live = [k for k in shards if k not in committed and k not in self.worked
                and self.observer.status(k, now) == "live" and self.observer.states[k].kind != "race"
                and replica_of(self.observer.states[k].slot or "") != pod]  # fmt: skip
        return next((k for k in sorted(live, key=self.observer.held_since) if self.raceable(k)), None)

    def idle(self, committed: set[int]) -> bool:
        """None of the shards this process took is still uncommitted."""
        return all(k in committed for k in self.worked)

    def _create_own(self, key: str) -> bool:
        """Create ``key`` holding this process's name and a nonce. A refusal whose object holds exactly
        that is this very create, its reply lost and the retry refused (S3 over a flaky network): ours."""
        mine = f"{self.holder} {uuid.uuid4().hex}".encode()
        return self.backend.put_if_absent(key, mine) or self.backend.get(key, LEASE_BODY_BYTES) == mine

    def _create(self, shard: int, generation: int, kind: str) -> bool:
        if self._stopped.is_set() or not self._create_own(self.layout.lease_key(shard, generation)):
            return False
        with self._lock:
            self.held[shard] = (generation, -1, kind)
            self.worked.add(shard)
        self._beat(shard)
        return True

    # -- renewal ----------------------------------------------------------------------------------
    def _beat(self, shard: int, kind: str | None = None) -> None:
        with self._lock:
            if shard not in self.held:
                return
            generation, beat, held_kind = self.held[shard]
            self.held[shard] = (generation, beat + 1, held_kind)
        key = self.layout.beat_key(shard, generation, beat + 1, kind or held_kind, self.holder)
        self.backend.put_if_absent(key, b"")
        if beat >= 0:
            self.backend.delete(self.layout.beat_key(shard, generation, beat, held_kind, self.holder))

    def renew(self) -> None:
        """One round: a shard committed (by anyone) or taken over is let go; the rest renewed."""
        for shard in list(self.held):
            generation = self.held[shard][0]
            keys = list(self.backend.list_keys(self.layout.lease_prefix(shard)))
            newest = max((p[1] for p in map(self.layout.parse_lease_key, keys) if p is not None), default=-1)
            if self.backend.size(self.layout.commit_key(shard)) is not None or newest > generation:
                if newest > generation:
                    self.lost.add(shard)
                with self._lock:
                    self.held.pop(shard, None)
                for key in keys:  # our own beats: the shard is done or someone else's now
                    if key.endswith(f".{self.holder}"):
                        self.backend.delete(key)
                continue
            self._beat(shard)

    def _renew_forever(self) -> None:
        while not self._stopped.wait(self.ttl / 4):
            try:
                self.renew()
                self.on_tick()
            except StoreError as exc:  # the next round tries again; a silent holder only loses its leases
                print(f"hsx: leases: renewing failed: {exc}", flush=True)

    def clear(self) -> None:
        """Delete every lease object of the run (its manifest is written: nothing is left to work on)."""
        for key in list(self.backend.list_keys(self.layout.leases_prefix)):
            self.backend.delete(key)


def poll_seconds(ttl: float) -> float:
    """How often an idle process looks again for work left."""
    return min(max(ttl / 4, 0.2), 5.0)


def work_left(leases: Leases, shards: int, read: Callable[[list[int]], None]) -> None:
    """After a pass over the dataset: take over expired or released shards, race the longest-held one
    when idle, and return once all ``shards`` are committed. ``read``: reads the taken shards' rows."""
    everything = range(shards)
    while not leases.stopped.is_set():
        committed = leases.store.committed_shards()
        if all(k in committed for k in everything):
            return
        leases.scan()
        got = [k for k in leases.takeable(everything, committed) if leases.take(k)]
        if got:
            print(f"hsx: leases: took over shards {got} (released, or silent for {leases.ttl:g}s)", flush=True)
        if not got and leases.idle(committed):
            raced = leases.race_candidate(everything, committed)
            if raced is not None and leases.take(raced, "race"):
                print(f"hsx: leases: racing shard {raced}, held longest by another process", flush=True)
                got = [raced]
        if got:
            read(got)
            continue
        leases.wait(poll_seconds(leases.ttl))

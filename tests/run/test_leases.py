"""Shard leases (issue 34, item 1), on a real local store: a lease is exclusive per generation, expires
only by observation (no timestamp is ever compared, so clock skew cannot matter), at once when its holder
released it or was an earlier process of the same replica, and is let go once its shard is committed or
taken over. The fleet runs that use them are in tests/faults/test_fleet.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from hsx_extractor.config import OutputSpec
from hsx_extractor.run import leases as leases_module
from hsx_extractor.run.leases import LeaseObserver, Leases, LeaseState, lease_states, work_left
from hsx_extractor.storage.backends import PermanentStoreError
from hsx_extractor.storage.store import Store, open_store
from tests.run.helpers import Clock


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(OutputSpec.model_validate({"uri": str(tmp_path / "out")}), "run")


def leases(store: Store, replica: int, process: str, clock: Clock, ttl: float = 30.0) -> Leases:
    return Leases(store, f"r{replica}", process, ttl, clock)


def shards_held_by_two(store: Store) -> tuple[Leases, Leases, Leases]:
    """Processes a and b claim shards 0 and 1 five seconds apart (0 is held longer); c has scanned both."""
    clock = Clock()
    a, b, c = (leases(store, r, p, clock) for r, p in ((0, "aa"), (1, "bb"), (2, "cc")))
    assert a.claim(0)
    clock.now += 5
    assert b.claim(1)
    c.scan()
    return a, b, c


def test_lease_keys_parse_to_each_shards_newest_generation_and_beat(store: Store) -> None:
    layout = store.layout
    keys = [layout.lease_key(3, 0), layout.beat_key(3, 0, 4, "claim", "r0-aa"), layout.lease_key(3, 1),
            layout.beat_key(3, 1, 0, "race", "r1-bb"), layout.beat_key(3, 0, 5, "claim", "r0-aa"),
            layout.lease_key(7, 0), "run/leases/junk", layout.commit_key(3)]  # fmt: skip
    states = lease_states(p for p in map(layout.parse_lease_key, keys) if p is not None)
    assert states == {3: LeaseState(1, 0, "race", "r1-bb"), 7: LeaseState(0, -1, "claim", "")}
    assert states[3].slot == "r1" and states[7].slot is None


def test_expiry_is_observed_on_the_observers_own_clock_only() -> None:
    observer = LeaseObserver(ttl=30.0, slot="r0", holder="r0-aa")
    held = {5: LeaseState(0, 3, "claim", "r1-bb")}
    observer.observe(held, now=0.0)
    assert observer.status(5, now=29.9) == "live"
    observer.observe(held, now=29.9)  # the same beat again: still counted from when it was first seen
    assert observer.status(5, now=30.0) == "expired"
    renewed = {5: LeaseState(0, 4, "claim", "r1-bb")}
    observer.observe(renewed, now=31.0)  # a new beat, seen late: live again from the sighting
    assert observer.status(5, now=60.9) == "live" and observer.status(5, now=61.0) == "expired"
    # A new observer (a replica that just started) waits a whole ttl whatever the beat's age.
    fresh = LeaseObserver(ttl=30.0, slot="r2", holder="r2-cc")
    fresh.observe(renewed, now=10_000.0)
    assert fresh.status(5, now=10_029.0) == "live"
    assert fresh.status(6, now=10_029.0) == "free"


def test_a_released_lease_and_one_of_an_earlier_process_of_this_replica_expire_at_once() -> None:
    observer = LeaseObserver(ttl=30.0, slot="r1", holder="r1-new")
    observer.observe({1: LeaseState(0, 9, "free", "r0-aa"), 2: LeaseState(2, 0, "take", "r1-old"),
                      3: LeaseState(0, 0, "claim", "r1-new"), 4: LeaseState(0, 0, "claim", "r0-aa"),
                      5: LeaseState(0, 0, "claim", "r1w1-sib")}, now=0.0)  # fmt: skip
    # A sibling worker of the same pod (another slot) is live like any other process.
    assert [observer.status(k, now=0.0) for k in (1, 2, 3, 4, 5)] == ["expired", "expired", "mine", "live", "live"]


def test_one_claim_wins_and_a_silent_holder_is_taken_over(store: Store) -> None:
    clock = Clock()
    a, b = leases(store, 0, "aa", clock), leases(store, 1, "bb", clock)
    assert a.claim(0) and not b.claim(0)
    assert not leases(store, 123456, "0123456789abcdef0123456789abcdef", clock).claim(0)  # a longer name read back
    assert b.claim(1) and not a.claim(1)
    b.scan()
    assert b.takeable(range(3), committed=set()) == [2]
    clock.now += 29.0
    b.scan()
    assert b.takeable(range(3), committed=set()) == [2]
    a.renew()  # a beat: b sees a new state and counts the ttl again
    clock.now += 2.0
    b.scan()
    assert b.takeable(range(3), committed=set()) == [2]
    clock.now += 30.0  # a is silent for a whole ttl
    b.scan()
    assert b.takeable(range(3), committed=set()) == [0, 2] and b.take(0)
    a.renew()  # a sees generation 1 and lets shard 0 go (its engine still finishes it)
    assert 0 in a.lost and 0 not in a.held and 0 in a.worked
    assert not a.take(0), "a generation is created once"


def test_renewal_lets_go_of_committed_shards_and_release_frees_at_once(store: Store) -> None:
    clock = Clock()
    a, b = leases(store, 0, "aa", clock), leases(store, 1, "bb", clock)
    assert a.claim(0) and a.claim(1)
    store.backend.put_if_absent(store.layout.commit_key(0), b"{}")
    a.renew()
    assert set(a.held) == {1}
    assert [k for k in store.backend.list_keys(store.layout.lease_prefix(0)) if ".b" in k] == []
    a.stop(release=True)
    b.scan()
    assert b.takeable(range(2), committed={0}) == [1]
    assert b.take(1) and b.observer.states[1].generation == 0  # the scan before the take


def test_an_idle_process_races_the_shard_held_longest_once(store: Store) -> None:
    a, b, c = shards_held_by_two(store)
    assert c.idle(committed=set()) and c.race_candidate(range(2), committed=set()) == 0
    assert c.take(0, "race")
    a.scan()
    b.scan()
    # A raced shard is not raced again, and a process races only what it did not work on.
    assert b.race_candidate(range(2), committed=set()) is None
    assert a.race_candidate(range(2), committed=set()) == 1


def test_a_regenerating_run_races_only_shards_whose_generations_are_stored(store: Store) -> None:
    """A race before a shard's generations are stored would decode the shard twice (and throw one away)."""
    from hsx_extractor.run.regenerate import generations_stored

    *_, c = shards_held_by_two(store)
    c.raceable = generations_stored(store)
    assert c.race_candidate(range(2), committed=set()) is None  # neither shard's generations are stored
    store.backend.put_if_absent(store.layout.generations_key(1), b"{}\n")
    assert c.race_candidate(range(2), committed=set()) == 1  # shard 0 is held longer but still decoding
    store.backend.put_if_absent(store.layout.generations_key(0), b"{}\n")
    assert c.race_candidate(range(2), committed=set()) == 0


def test_workers_of_one_pod_do_not_race_each_other(store: Store) -> None:
    """They send to the same server: a race would do the same work twice on the same GPUs."""
    clock = Clock()
    w0, w1, other = (Leases(store, s, p, 30.0, clock) for s, p in (("r0", "aa"), ("r0w1", "bb"), ("r1", "cc")))
    assert w0.claim(0)
    w1.scan()
    assert w1.idle(committed=set()) and w1.race_candidate(range(1), committed=set()) is None
    other.scan()
    assert other.race_candidate(range(1), committed=set()) == 0


def test_the_probe_passes_on_a_real_store_and_refuses_one_that_lists_nothing(store: Store) -> None:
    clock = Clock()
    leases(store, 0, "aa", clock).probe()
    assert not [k for k in store.backend.list_keys(store.layout.leases_prefix)]

    class Unlisted:  # a store whose listing misses new objects (no read-after-write listing)
        def __init__(self, inner: object) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> object:
            return getattr(self.inner, name)

        def list_keys(self, prefix: str) -> list[str]:
            return []

    broken = Store(Unlisted(store.backend), store.layout, store.output)  # type: ignore[arg-type]
    with pytest.raises(PermanentStoreError, match="cannot hold shard leases"):
        leases(broken, 0, "aa", clock).probe()


def test_its_own_commit_wakes_an_idle_process_without_waiting_for_a_poll(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last shard of a run committed by this process ends work_left at once (the run's tail used to
    wait for the next poll, up to 5 s, before its manifest); here a poll would take an hour."""
    monkeypatch.setattr(leases_module, "poll_seconds", lambda ttl: 3600.0)
    a = leases(store, 0, "aa", Clock())
    assert a.claim(0)
    looked = threading.Event()
    committed_shards = store.committed_shards

    def look() -> set[int]:
        looked.set()
        return committed_shards()

    monkeypatch.setattr(store, "committed_shards", look)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (work_left(a, 1, lambda taken: None), done.set()), daemon=True)
    thread.start()
    assert looked.wait(30) and not done.wait(0.2)  # shard 0 is still being extracted: it waits
    store.backend.put_if_absent(store.layout.commit_key(0), b"{}")
    a.wake()  # what Progress.on_commit calls
    assert done.wait(30), "work_left kept waiting for its poll after this process's commit"

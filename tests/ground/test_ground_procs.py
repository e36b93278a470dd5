"""The test ground's clean-up of what killed process trees leave in /dev/shm."""

from __future__ import annotations

import multiprocessing
import uuid

from tests.ground.procs import SHM, remove_orphaned_semaphores, semaphores


def test_only_new_semaphores_nobody_has_open_are_removed() -> None:
    before = semaphores()
    # A spawn context's lock is a named semaphore mapped by this process: alive, so it stays.
    held = multiprocessing.get_context("spawn").Lock()
    orphan = SHM / f"sem.mp-hsxtest{uuid.uuid4().hex[:8]}"  # what a killed tree leaves: a file nobody maps
    orphan.write_bytes(bytes(32))
    try:
        kept = semaphores() - before - {orphan.name}
        assert kept, "the spawn context's lock made no named semaphore to keep"
        assert remove_orphaned_semaphores(before) == [orphan.name]
        assert not orphan.exists() and kept <= semaphores()
        with held:
            pass
    finally:
        orphan.unlink(missing_ok=True)

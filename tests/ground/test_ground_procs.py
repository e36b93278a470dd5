"""The test ground's clean-up of what killed engine process trees leave in /dev/shm."""

from __future__ import annotations

import multiprocessing
import os
import uuid

from tests.ground.procs import SHM, engine_shm_files, remove_orphaned_shm


def test_only_new_engine_files_nobody_uses_are_removed() -> None:
    before = engine_shm_files()
    # A spawn context's lock is a named semaphore mapped by this process: alive, so it stays.
    held = multiprocessing.get_context("spawn").Lock()
    tag = uuid.uuid4().hex[:8]
    orphans = [SHM / f"sem.mp-hsxtest{tag}", SHM / f"sglang_loads_hsxtest_{tag}.shm"]  # nobody maps or opens them
    opened = SHM / f"sgl_shm_hsxtest_{os.getpid()}_{tag}"  # open in this process: stays
    other = SHM / f"hsxtest-{tag}"  # not an engine's: stays
    for path in [*orphans, opened, other]:
        path.write_bytes(bytes(32))
    fd = os.open(opened, os.O_RDONLY)
    try:
        kept = engine_shm_files() - before - {p.name for p in orphans} - {opened.name}
        assert kept, "the spawn context's lock made no named semaphore to keep"
        assert remove_orphaned_shm(before) == sorted(p.name for p in orphans)
        assert not any(p.exists() for p in orphans)
        assert opened.exists() and other.exists() and kept <= engine_shm_files()
        with held:
            pass
    finally:
        os.close(fd)
        for path in [*orphans, opened, other]:
            path.unlink(missing_ok=True)

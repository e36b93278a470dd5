"""Runs in the trainers venv (bench/in_place.py starts it, with -P: bench/tokenize.py is not the stdlib's): every
sample once through a trainer's own loader, from a copied export and from an in-place one, rounds interleaved;
prints one JSON line of (wall s, CPU s, samples) lists.

    python -P bench/trainer_read.py TRAINER COPIED_DIR IN_PLACE_DIR ROUNDS
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def touch(item: dict[str, Any]) -> None:
    """Copy every tensor once, as the move to the GPU does: a memory-mapped file is read only when touched."""
    import torch

    for value in item.values():
        if isinstance(value, torch.Tensor):
            value.clone()


def specforge(dest: Path, in_place: bool) -> Callable[[], int]:
    from specforge.algorithms.eagle3.data import build_offline_normalizer, build_offline_reader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    path = str(dest)
    if in_place:
        from hsx_extractor.in_place.specforge import install

        install()
        path = json.loads((dest / "specforge.json").read_text())["data"]["hidden_states_path"]

    def read() -> int:
        refs = build_offline_reader(path, run_id="bench", ttt_length=7, max_len=1 << 20).read()
        store, normalize = LocalFeatureStore(), build_offline_normalizer(1 << 20)
        for ref in refs:
            raw, handle = store.get(ref)
            touch(normalize(raw))
            store.release(handle)
        return len(refs)

    return read


def speculators(dest: Path, in_place: bool) -> Callable[[], int]:
    from hs_connectors import HiddenStatesBackend
    from speculators.train.data import ArrowDataset

    transfer = None
    if in_place:
        from hsx_extractor.in_place.speculators import register

        register()
        transfer = HiddenStatesBackend.registry["hsx"].from_train_args(None, str(dest))

    def read() -> int:
        ds = ArrowDataset(max_len=1 << 20, datapath=str(dest), on_missing="raise", transfer=transfer)
        for i in range(len(ds)):
            touch(ds[i])
        return len(ds)

    return read


def modelopt(dest: Path, in_place: bool) -> Callable[[], int]:
    from modelopt.torch.speculative.eagle.utils import OfflineSupervisedDataset

    def read() -> int:
        if in_place:
            from hsx_extractor.in_place.modelopt import OfflineDataset

            ds: Any = OfflineDataset(dest, answer_only_loss=True)
        else:
            ds = OfflineSupervisedDataset(sorted(str(p) for p in dest.rglob("*.pt")), answer_only_loss=True)
        for i in range(len(ds)):
            touch(ds[i])
        return len(ds)

    return read


def timed(read: Callable[[], int]) -> tuple[float, float, int]:
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    n = read()
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return wall, r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, n


def main(argv: list[str]) -> int:
    trainer, copied, in_place, rounds = argv[0], Path(argv[1]), Path(argv[2]), int(argv[3])
    make = {"specforge": specforge, "speculators": speculators, "modelopt": modelopt}[trainer]
    readers = {"copied": make(copied, False), "in_place": make(in_place, True)}
    out: dict[str, list[tuple[float, float, int]]] = {name: [] for name in readers}
    for _ in range(rounds):
        for name, read in readers.items():
            out[name].append(timed(read))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

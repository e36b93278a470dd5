"""SpecForge 0.2 reading a run in place: ``data.hidden_states_path: hsx:DEST`` (an in-place export folder).

SpecForge's offline path lists feature files (``offline_reader.list_feature_files``) and loads each one
when its sample is needed (``feature_store.load_feature_file``: its reader, the vocabulary counter and the
loader's prefetch threads all go through these two). :func:`install` wraps both: a path behind
``hsx:`` lists one name per sample, ``hsx:DEST#position``, and loading one returns the sample's tensors
under SpecForge's feature-file keys; every other path goes to SpecForge's own functions. A training
over several processes starts each one through ``python -m hsx_extractor.in_place specforge`` (torchrun
``--no-python``), so every rank has the same routes.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from hsx_extractor.tools.export import TrainerView, open_in_place, specforge_features
from hsx_extractor.tools.trainer_launch import IN_PLACE_PREFIX

_views: dict[str, TrainerView] = {}
_lock = threading.Lock()


def _view(dest: str) -> TrainerView:
    view = _views.get(dest)  # opened once per process; the lock only for the first open
    if view is None:
        with _lock:
            if dest not in _views:
                _views[dest] = open_in_place(dest, "specforge")
            view = _views[dest]
    return view


def _after_fork() -> None:  # a forked worker starts with no lock held by a thread it does not have
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def feature_files(path: str) -> list[str]:
    """One name per sample of the in-place export at ``hsx:DEST``, sorted as SpecForge sorts its files."""
    dest = path[len(IN_PLACE_PREFIX) :]
    return [f"{IN_PLACE_PREFIX}{dest}#{position:012d}" for position in range(len(_view(dest)))]


def load(name: str) -> dict[str, Any]:
    """The sample ``hsx:DEST#position`` as SpecForge's feature file holds it."""
    dest, _, position = name[len(IN_PLACE_PREFIX) :].rpartition("#")
    return specforge_features(_view(dest).sample(int(position)))


def _routed(ours: Callable[[str], Any], theirs: Callable[[str], Any]) -> Callable[[str], Any]:
    def route(path: str) -> Any:
        return ours(path) if isinstance(path, str) and path.startswith(IN_PLACE_PREFIX) else theirs(path)

    route.hsx_routes = theirs  # type: ignore[attr-defined]
    return route


WORKER_PREFIX = (sys.executable, "-m", "hsx_extractor.in_place", "specforge")
TORCHRUN_PREFIX = (sys.executable, "-m", "torch.distributed.run", "--no-python")


def _planned_through_hsx(build: Callable[..., Any]) -> Callable[..., Any]:
    def plan(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("worker_prefix", WORKER_PREFIX)
        kwargs.setdefault("torchrun_prefix", TORCHRUN_PREFIX)
        return build(*args, **kwargs)

    plan.hsx_routes = build  # type: ignore[attr-defined]
    return plan


def install() -> None:
    """Route SpecForge's feature-file listing and loading for ``hsx:`` paths to the run, and start its
    worker processes through hsx's launcher (idempotent)."""
    from specforge import launch_plan
    from specforge.runtime.data_plane import feature_store, offline_reader

    if not hasattr(launch_plan.build_launch_plan, "hsx_routes"):
        launch_plan.build_launch_plan = _planned_through_hsx(launch_plan.build_launch_plan)

    for module, name, ours in (
        (offline_reader, "list_feature_files", feature_files),
        (offline_reader, "load_feature_file", load),
        (feature_store, "load_feature_file", load),
    ):
        theirs = getattr(module, name)
        if not hasattr(theirs, "hsx_routes"):
            setattr(module, name, _routed(ours, theirs))

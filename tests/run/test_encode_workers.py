"""How many threads encode samples: the pod's CPU limit decides, bounded, and the environment overrides."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hsx_extractor.run.engine import encode_workers, usable_cores


@pytest.mark.parametrize(("cores", "threads"), [(0.5, 1), (1.0, 1), (3.6, 4), (8.0, 8), (128.0, 16)])
def test_one_thread_per_usable_core_at_most_sixteen(
    cores: float, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HSX_ENCODE_THREADS", raising=False)
    assert encode_workers(cores) == threads


def test_the_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_ENCODE_THREADS", "3")
    assert encode_workers(64.0) == 3


@pytest.mark.parametrize(("cpu_max", "cores"), [("250000 100000\n", 2.5), ("50000 100000\n", 1.0)])
def test_a_cgroup_cpu_limit_decides(cpu_max: str, cores: float, tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max)
    assert usable_cores(tmp_path) == cores


def test_a_cgroup_v1_cpu_limit_decides(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cores(tmp_path) == 4.0


@pytest.mark.parametrize("cpu_max", ["max 100000\n", None])
def test_without_a_limit_the_cpus_it_may_run_on(cpu_max: str | None, tmp_path: Path) -> None:
    if cpu_max is not None:
        (tmp_path / "cpu.max").write_text(cpu_max)
    assert usable_cores(tmp_path) == len(os.sched_getaffinity(0))


def test_a_bad_override_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HSX_ENCODE_THREADS", "two")
    with pytest.raises(Exception, match="HSX_ENCODE_THREADS must be a positive whole number"):
        encode_workers()

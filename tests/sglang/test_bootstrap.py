"""Activation by environment, in fresh interpreters: the real .pth file, the import finder, the
real batch-result module loaded by the normal import system, and the version pin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hsx_extractor.protocol import DUMP_DIR_ENV
from hsx_extractor.sglang_hook.__main__ import PTH_NAME, install_pth
from hsx_extractor.sglang_hook.launch import SGLANG_VERSION, TARGET_MODULE

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # each test starts an interpreter that imports torch

# Runs in the child: the stand-in finder goes right *after* whatever the .pth installed (so the
# hook's finder sees the import first, as it would see SGLang's); then the target is imported the
# normal way.
CHILD = textwrap.dedent(
    """
    import sys, site
    sys.path[:0] = {paths!r}
    site.addsitedir({site_dir!r})  # processes {pth!r} exactly as site-packages would
    from tests.sglang.standins import StandInFinder, _give_behaviour, _real_parts
    from pathlib import Path
    modules = {{}}
    _give_behaviour(modules, _real_parts(Path({src!r})))
    sys.modules.update(modules)
    hook_finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "HookFinder"]
    sys.meta_path.insert(len(hook_finders), StandInFinder(Path({src!r}), modules))
    print("finders", hook_finders)
    import {target} as m
    method = m.SchedulerBatchResultProcessor._append_prefill_hidden_states
    print("patched", getattr(method, "__hsx_hook__", False), method.__wrapped__.__qualname__ if hasattr(method, "__wrapped__") else "-")
    """
)


def _run_child(
    tmp_path: Path, src: Path, env_extra: dict[str, str], dist_src: Path | None = None
) -> subprocess.CompletedProcess[str]:
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    install_pth(site_dir)
    # With dist_src: the same SGLang source, but another release's metadata found first.
    paths = [str(p) for p in (ROOT, dist_src, src) if p is not None]
    code = CHILD.format(paths=paths, src=str(src), site_dir=str(site_dir), pth=PTH_NAME, target=TARGET_MODULE)
    env = {k: v for k, v in os.environ.items() if k != DUMP_DIR_ENV}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_dump_dir_in_the_environment_patches_the_real_module_on_import(
    sglang_src: Path, tmp_path: Path
) -> None:
    run = _run_child(tmp_path, sglang_src, {DUMP_DIR_ENV: str(tmp_path / "dumps")})
    assert run.returncode == 0, run.stderr
    assert "finders ['HookFinder']" in run.stdout
    assert "patched True SchedulerBatchResultProcessor._append_prefill_hidden_states" in run.stdout


def test_without_the_environment_the_same_install_serves_normally(sglang_src: Path, tmp_path: Path) -> None:
    run = _run_child(tmp_path, sglang_src, {})
    assert run.returncode == 0, run.stderr
    assert "finders []" in run.stdout and "patched False -" in run.stdout


def test_another_sglang_version_fails_at_start_naming_both(sglang_src: Path, tmp_path: Path) -> None:
    fake = tmp_path / "fake-dist"
    info = fake / "sglang-0.5.22.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.22\n")
    run = _run_child(tmp_path, sglang_src, {DUMP_DIR_ENV: str(tmp_path / "dumps")}, dist_src=fake)
    assert run.returncode != 0
    assert "HookVersionError" in run.stderr
    assert f"written for sglang {SGLANG_VERSION} and sglang 0.5.22 is installed" in run.stderr
    assert "patched" not in run.stdout


def test_install_pth_copies_the_activation_line(tmp_path: Path) -> None:
    target = install_pth(tmp_path)
    line = target.read_text().strip()
    assert target.name == PTH_NAME and line.startswith("import os;")
    assert DUMP_DIR_ENV in line and "hsx_extractor.sglang_hook.bootstrap" in line

"""The pinned SGLang release's wheel, fetched without dependencies and unpacked once (cached).

CI cannot install SGLang (it is a CUDA install), so its tests read and run the release's own
source from the wheel instead. Cached under ``${HSX_CACHE:-~/.cache/hsx}/wheels/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from hsx_extractor.sglang_hook.launch import SGLANG_VERSION

WHEEL_NAME = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
# sha256 of that file on PyPI: a changed file means a different release under the same name.
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"


def cache_dir() -> Path:
    return Path(os.environ.get("HSX_CACHE") or Path.home() / ".cache" / "hsx") / "wheels"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_interpreters() -> list[str]:
    """Interpreters that may have pip: this one, the Makefile's uv home, python3 on PATH."""
    candidates = [sys.executable]
    candidates += sorted(str(p) for p in (cache_dir().parent).glob("uv-*/bin/python"))
    found = shutil.which("python3")
    if found:
        candidates.append(found)
    return candidates


def fetch_wheel() -> Path:
    """The pinned wheel, downloaded with pip (no dependencies) when not cached."""
    target = cache_dir() / WHEEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        pip_args = [
            "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--platform", "manylinux_2_34_x86_64", "-d", str(target.parent), "-q",
        ]  # fmt: skip
        errors = []
        for python in _pip_interpreters():
            run = subprocess.run([python, *pip_args], capture_output=True, text=True)
            if run.returncode == 0 and target.exists():
                break
            errors.append(f"{python}: {run.stderr.strip()[-500:]}")
        else:
            raise RuntimeError(f"could not download {WHEEL_NAME}:\n" + "\n".join(errors))
    digest = _sha256(target)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{target} has sha256 {digest}, expected {WHEEL_SHA256}; delete it to refetch")
    return target


def unpacked_source() -> Path:
    """The wheel's Python files and dist-info, unpacked once into the cache."""
    root = cache_dir() / f"sglang-{SGLANG_VERSION}-src"
    if (root / ".complete").exists():
        return root
    wheel = fetch_wheel()
    tmp = root.with_name(f"{root.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(".py") or ".dist-info/" in name:
                zf.extract(name, tmp)
    (tmp / ".complete").write_text(WHEEL_SHA256)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return root

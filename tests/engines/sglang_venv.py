"""The real SGLang release on CPU: where its venv lives, what goes in it, how a process runs in it.

``tests/engines/build_sglang.sh`` builds the venv once per SGLang release into
``${HSX_CACHE:-~/.cache/hsx}/sglang-<version>-cpu/`` from the pinned wheel's own ``Requires-Dist``
(minus packages that exist only for GPUs). The venv holds SGLang, its requirements and hsx's hook
``.pth`` (installed by ``python -m hsx_extractor.sglang_hook install-pth``, as the image does), and
nothing of this checkout: every process started here gets the checkout's hsx (built as a wheel, as
the Dockerfile builds it) and the test ground's ``sgl_kernel`` stand-in through ``PYTHONPATH``, so
the tests always run the current code against a venv that is built once.

Used by the build script (``python -m tests.engines.sglang_venv requirements``), the test fixtures
and ``bench/engines.py``. Imports nothing heavy.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from hsx_extractor.sglang_hook.launch import SGLANG_VERSION

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STANDIN_DIR = HERE / "sgl_kernel_standin"
# The stand-in appends one line per call of any of its functions to the file this names.
STANDIN_LOG_ENV = "HSX_SGL_KERNEL_STANDIN_LOG"
STAMP = ".complete"

# Requirements of the release that exist only for CUDA (kernels, their DSLs and CUDA bindings) or
# for audio/video input; SGLang's CPU path with the torch_native attention backend imports none of
# them at run time (the sgl_kernel import is answered by the stand-in). Patterns match normalised
# names (PEP 503).
GPU_ONLY = (
    "flashinfer*",
    "flash-attn*",
    "sgl-kernel",
    "sglang-kernel",
    "sgl-deep-*",
    "sgl-flash-mla",
    "tilelang",
    "torchaudio",
    "torchcodec",
    "humming-kernels",
    "quack-kernels",
    "nvidia-cutlass-dsl",
    "nvidia-mathdx",
    "nvshmem4py-*",
    "cuda-python",
    "torch-memory-saver",
)
# Added to the release's own list: SGLang imports it on CPU too (its pinned one stays if listed).
EXTRA = ("soundfile",)


def cache_root() -> Path:
    return Path(os.environ.get("HSX_CACHE") or Path.home() / ".cache" / "hsx")


def venv_dir() -> Path:
    return cache_root() / f"sglang-{SGLANG_VERSION}-cpu"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def is_built() -> bool:
    return (venv_dir() / STAMP).is_file() and venv_python().exists()


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional ``Requires-Dist`` (markers kept) minus GPU-only packages, plus EXTRA."""
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
        name = _normalise(m.group(0))
        if any(fnmatch.fnmatchcase(name, pat) for pat in GPU_ONLY):
            continue
        out.append(req)
    names = {_normalise(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in out}  # type: ignore[union-attr]
    out += [e for e in EXTRA if _normalise(e) not in names]
    return out


def pinned_wheel() -> Path:
    """The pinned SGLang wheel, sha256-checked (shared with tests/sglang, cached under HSX_CACHE/wheels)."""
    from tests.sglang.wheel import fetch_wheel

    return fetch_wheel()


def build_hsx_wheel(out_dir: Path) -> Path:
    """A wheel of this checkout, built from the same files the Dockerfile's ``wheel`` stage copies."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hsx-wheel-src-") as tmp:
        src = Path(tmp)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, src / name)
        for name in ("extractor", "operator"):
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        # The project venv has setuptools (a torch requirement): no isolated build env to fetch.
        cmd = [str(_uv()), "build", "-q", "--wheel", "--no-build-isolation", "-p", sys.executable,
               "--out-dir", str(out_dir), str(src)]  # fmt: skip
        _run(cmd)
    wheels = sorted(out_dir.glob("hsx-*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one hsx wheel in {out_dir}, found {wheels}")
    return wheels[0]


def _uv() -> Path:
    found = sorted(cache_root().glob("uv-*/bin/uv"))
    if found:
        return found[-1]
    which = shutil.which("uv")
    if which:
        return Path(which)
    raise RuntimeError(f"no uv under {cache_root()} (make venv installs it)")


def install_hsx(target: Path) -> Path:
    """This checkout's hsx wheel unpacked into ``target`` (``pip install --no-deps --target``)."""
    wheel = build_hsx_wheel(target.parent / f"{target.name}-wheel")
    _run([str(_uv()), "pip", "install", "-q", "--no-deps", "--compile-bytecode", "-p", str(venv_python()),
          "--target", str(target), str(wheel)])  # fmt: skip
    return target


def dockerfile_hook_steps(dockerfile: Path = REPO / "Dockerfile") -> list[str]:
    """The shell commands the Dockerfile's ``sglang`` stage runs after installing the hsx wheel.

    That stage's one RUN is ``pip install --no-deps <hsx wheel> && <steps>``: the steps put the hook's
    ``.pth`` into site-packages and check it. Read from the Dockerfile so the test ground runs what
    the image build runs.
    """
    text = dockerfile.read_text().replace("\\\n", " ")
    runs: dict[str, list[str]] = {}
    current = ""
    for line in text.splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            current = words[-1] if words[-2:-1] == ["AS"] else ""
        elif words[:1] == ["RUN"]:
            runs.setdefault(current, []).append(line.strip()[len("RUN") :])
    stage = runs.get("sglang")
    if not stage or len(stage) != 1:
        raise ValueError(f"{dockerfile}: expected one RUN in the sglang stage, found {stage}")
    parts = [p.strip() for p in stage[0].split("&&")]
    first = parts[0]
    if "pip install" not in first or "--no-deps" not in first or "hsx-" not in first:
        raise ValueError(
            f"{dockerfile}: the sglang stage's RUN does not start with pip install --no-deps hsx: {first}"
        )
    return parts[1:]


def install_hook(hsx_dir: Path) -> list[str]:
    """Run the Dockerfile's hook steps with the SGLang venv's ``python3`` and ``hsx_dir``'s hsx.

    Returns the steps run. Raises RuntimeError (with the step's output) when one fails.
    """
    steps = dockerfile_hook_steps()
    env = process_env(hsx_dir, {})
    for step in steps:
        _run(["bash", "-c", step], env=env)
    return steps


def _run(cmd: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{cmd} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")


def process_env(hsx_dir: Path, extra: dict[str, str], standin_log: Path | None = None) -> dict[str, str]:
    """Environment of a process in the SGLang venv: hsx from ``hsx_dir``, the sgl_kernel stand-in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = os.pathsep.join([str(hsx_dir), str(STANDIN_DIR)])
    env["VIRTUAL_ENV"] = str(venv_dir())
    env["PATH"] = f"{venv_dir() / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    if standin_log is not None:
        env[STANDIN_LOG_ENV] = str(standin_log)
    env.update(extra)
    return env


def main(argv: list[str]) -> int:
    if argv == ["requirements"]:
        print("\n".join(requirements(pinned_wheel())))
        return 0
    if argv == ["wheel"]:
        print(pinned_wheel())
        return 0
    if len(argv) == 2 and argv[0] == "install-hook":
        # This checkout's hsx into argv[1], then the Dockerfile's hook steps in the SGLang venv.
        target = install_hsx(Path(argv[1]))
        for step in install_hook(target):
            print(f"ran: {step}")
        return 0
    if argv == ["venv-dir"]:
        print(venv_dir())
        return 0
    print(
        "usage: python -m tests.engines.sglang_venv requirements|wheel|venv-dir|install-hook DIR",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

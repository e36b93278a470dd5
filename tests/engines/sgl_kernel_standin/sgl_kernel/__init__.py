"""The hsx test ground's stand-in for ``sgl_kernel``: NOT SGLang's kernel package.

SGLang 0.5.23 imports ``sgl_kernel`` at module load on its CPU path (``from sgl_kernel import
copy_all_layer_kv_cache_cpu`` and similar), and no package on the registries ships its CPU kernels.
With this stand-in on the path those imports succeed, and SGLang's CPU engine, with the
``torch_native`` attention backend and float32, runs its plain-PyTorch code for everything the tests
do. Every attribute is a function that must never run: calling one records the call and raises.

Recording: each call appends ``call <name> pid=<pid>`` to the file named by
``HSX_SGL_KERNEL_STANDIN_LOG`` (when set) and writes a marker line to stderr, so a test fails
loudly if SGLang ever took a kernel path (tests/engines/test_sglang_real.py checks the log). Each
first access of a name appends ``access <name> pid=<pid>``, which is only informative.
Installed by nothing: tests/engines put this folder on ``PYTHONPATH`` of every SGLang process.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NoReturn

LOG_ENV = "HSX_SGL_KERNEL_STANDIN_LOG"
MARKER = "HSX-SGL-KERNEL-STANDIN-CALLED"
STANDIN = True  # lets a test tell this package from the real one
__version__ = "0.0.0+hsx-standin"

_made: dict[str, Any] = {}


def _record(line: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(f"{line} pid={os.getpid()}\n")
    except OSError:
        pass


class StandinCalled(RuntimeError):
    """SGLang called a kernel of the stand-in: the CPU test ground cannot run that path."""


def _make(name: str) -> Any:
    def standin(*args: Any, **kwargs: Any) -> NoReturn:
        _record(f"call {name}")
        print(f"{MARKER}: sgl_kernel.{name} called (pid {os.getpid()})", file=sys.stderr, flush=True)
        raise StandinCalled(
            f"sgl_kernel.{name} was called, but sgl_kernel here is the hsx test ground's stand-in "
            "(tests/engines/sgl_kernel_standin), which has no kernels: SGLang took a kernel path "
            "the CPU test ground does not support"
        )

    standin.__name__ = standin.__qualname__ = name
    standin.__module__ = __name__
    return standin


def __getattr__(name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    if name not in _made:
        _record(f"access {name}")
        _made[name] = _make(name)
    return _made[name]

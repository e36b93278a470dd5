"""Switch the hook on in a process: run by ``hsx_sglang_hook.pth`` when ``SGLANG_HS_DUMP_DIR`` is set.

Nothing in SGLang's files changes. :func:`install` checks the installed SGLang version and puts an
import finder first on ``sys.meta_path``; when the scheduler's batch-result module is imported,
the finder lets the normal loader run it and then replaces one method on one class by name.
A different SGLang version makes ``import sglang`` fail with both versions named, so the server
does not start without the hook it was asked to run with.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from hsx_extractor.protocol import DUMP_DIR_ENV, FINAL_POST_NORM, FINAL_PRE_NORM
from hsx_extractor.sglang_hook.launch import (
    FINAL_STATE_ENV,
    FINAL_STATES,
    SGLANG_VERSION,
    TARGET_CLASS,
    TARGET_KWONLY,
    TARGET_METHOD,
    TARGET_MODULE,
)

log = logging.getLogger("hsx.sglang_hook")

QUEUE_ENV = "SGLANG_HS_DUMP_QUEUE"
WRITERS_ENV = "SGLANG_HS_DUMP_WRITERS"


class HookVersionError(ImportError):
    """The installed SGLang is not the release the hook was written for."""


class HookSettingError(ImportError):
    """The hook's environment asks for something it cannot do (an unknown SGLANG_HS_FINAL_STATE)."""


def version_error(installed: str) -> HookVersionError:
    return HookVersionError(
        f"hsx SGLang hook: {DUMP_DIR_ENV} is set, but the hook is written for sglang {SGLANG_VERSION} "
        f"and sglang {installed} is installed. Use the hsx-sglang image (or sglang=={SGLANG_VERSION}), "
        f"or unset {DUMP_DIR_ENV} to serve without extraction."
    )


def installed_sglang_version() -> str | None:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it loaded."""

    def __init__(self, inner: importlib.abc.Loader, after: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._after(module)

    def __getattr__(self, name: str) -> Any:
        # get_source, get_filename, ... keep tracebacks and inspect working.
        return getattr(self._inner, name)


class HookFinder(importlib.abc.MetaPathFinder):
    """Patches the target modules on import; refuses ``sglang`` itself when the version is wrong."""

    def __init__(
        self,
        version_problem: ImportError | None,
        patches: dict[str, Callable[[ModuleType], None]] | None = None,
    ) -> None:
        self.version_problem = version_problem
        self.patches = patches if patches is not None else {TARGET_MODULE: patch_module}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if self.version_problem is not None and fullname == "sglang":
            raise self.version_problem
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def check_target(method: Any) -> None:
    """Refuse to patch a method whose keyword-only parameters are not the ones the hook relies on."""
    params = inspect.signature(method).parameters.values()
    kwonly = tuple(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
    if kwonly != TARGET_KWONLY:
        raise RuntimeError(
            f"hsx SGLang hook: {TARGET_CLASS}.{TARGET_METHOD} takes keyword-only {kwonly}, "
            f"the hook was written for {TARGET_KWONLY} (sglang {SGLANG_VERSION})"
        )


def patch_module(module: ModuleType) -> None:
    """Replace the target method on the target class of ``module`` (idempotent)."""
    from hsx_extractor.sglang_hook.hook import make_wrapper

    cls = getattr(module, TARGET_CLASS, None)
    original = None if cls is None else cls.__dict__.get(TARGET_METHOD)
    if original is None:
        raise RuntimeError(f"hsx SGLang hook: {TARGET_MODULE} has no {TARGET_CLASS}.{TARGET_METHOD}")
    if getattr(original, "__hsx_hook__", False):
        return
    check_target(original)
    setattr(cls, TARGET_METHOD, make_wrapper(original, process_hook))
    log.info("hsx: patched %s.%s; dumps go to %s", TARGET_CLASS, TARGET_METHOD, os.environ.get(DUMP_DIR_ENV))


def final_state(environ: Mapping[str, str]) -> str:
    """The final state this process dumps (FINAL_STATE_ENV; post-norm when unset)."""
    value = environ.get(FINAL_STATE_ENV) or FINAL_POST_NORM
    if value not in FINAL_STATES:
        raise RuntimeError(f"hsx SGLang hook: {FINAL_STATE_ENV} must be one of {FINAL_STATES}, got {value!r}")
    return value


def module_patches(environ: Mapping[str, str]) -> dict[str, Callable[[ModuleType], None]]:
    """Module name -> what to patch in it, for a process with this environment."""
    patches: dict[str, Callable[[ModuleType], None]] = {TARGET_MODULE: patch_module}
    if final_state(environ) == FINAL_PRE_NORM:
        from hsx_extractor.sglang_hook import prenorm

        patches.update(prenorm.PATCHES)
    return patches


_installed = False


def install(environ: dict[str, str] | None = None) -> bool:
    """Activate the hook in this process. Returns whether it was activated."""
    global _installed
    env = os.environ if environ is None else environ
    if not env.get(DUMP_DIR_ENV):
        return False
    if _installed:
        return True
    installed = installed_sglang_version()
    if installed is None:
        return False  # not an SGLang environment (the extractor image, a test runner)
    problem: ImportError | None = None if installed == SGLANG_VERSION else version_error(installed)
    try:
        patches = module_patches(env)
    except RuntimeError as exc:  # a bad setting: refuse to serve, as for a wrong version (never serve unhooked)
        problem, patches = HookSettingError(str(exc)), {}
    if problem is not None:
        print(f"ERROR: {problem}", file=sys.stderr)
    sys.meta_path.insert(0, HookFinder(problem, patches))
    _installed = True
    if problem is None:
        for name, patch in patches.items():
            if name in sys.modules:
                patch(sys.modules[name])
    return True


_hook: Any = None
_hook_lock = threading.Lock()


def process_hook() -> Any:
    """This process's hook, created on first use (so only scheduler processes start a writer)."""
    global _hook
    if _hook is None:
        with _hook_lock:
            if _hook is None:
                _hook = _make_process_hook()
    return _hook


def _make_process_hook() -> Any:
    import atexit

    from hsx_extractor.sglang_hook.hook import ExtractionHook, resolve_capture_info
    from hsx_extractor.sglang_hook.writer import DEFAULT_QUEUE_SIZE, DEFAULT_WRITER_THREADS, DumpWriter

    dump_dir = os.environ.get(DUMP_DIR_ENV)
    if not dump_dir:
        raise RuntimeError(f"hsx SGLang hook: {DUMP_DIR_ENV} is not set in the scheduler process")
    writer = DumpWriter(
        dump_dir,
        _positive_env(QUEUE_ENV, DEFAULT_QUEUE_SIZE),
        _positive_env(WRITERS_ENV, DEFAULT_WRITER_THREADS),
    )
    atexit.register(writer.flush, 30.0)

    def attn_tp_rank() -> int:
        from sglang.srt.runtime_context import get_parallel

        return int(get_parallel().attn_tp_rank)

    def capture_info(processor: Any) -> Any:
        from sglang.srt.runtime_context import get_exec

        ids = get_exec().features.return_aux_hidden_state_layer_ids
        return resolve_capture_info(processor, None if ids is None else list(ids))

    return ExtractionHook(writer, attn_tp_rank, capture_info, final_state(os.environ))


def _positive_env(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise RuntimeError(f"hsx SGLang hook: {name} must be a whole number >= 1, got {value!r}")
    return int(value)

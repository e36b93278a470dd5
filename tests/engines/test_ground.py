"""The engine test ground's own parts, without starting SGLang: the sgl_kernel stand-in, the
requirement list of the SGLang CPU venv, and the Dockerfile steps the hook is installed with."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.engines.sglang_venv import (
    GPU_ONLY,
    STANDIN_DIR,
    STANDIN_LOG_ENV,
    dockerfile_hook_steps,
    pinned_wheel,
    requirements,
)


def load_standin() -> ModuleType:
    # Under a private name: the test process must not get an `sgl_kernel` module.
    path = STANDIN_DIR / "sgl_kernel" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_hsx_sgl_kernel_standin", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_standin_raises_and_records_every_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "calls.log"
    monkeypatch.setenv(STANDIN_LOG_ENV, str(log))
    standin = load_standin()
    assert standin.STANDIN is True
    kernel = standin.copy_all_layer_kv_cache_cpu  # what SGLang's CPU path imports at load
    assert callable(kernel) and kernel.__name__ == "copy_all_layer_kv_cache_cpu"
    with pytest.raises(standin.StandinCalled, match="stand-in"):
        kernel(1, x=2)
    lines = log.read_text().splitlines()
    assert lines[0].startswith("access copy_all_layer_kv_cache_cpu ")
    assert lines[1].startswith("call copy_all_layer_kv_cache_cpu ")
    assert standin.MARKER in capsys.readouterr().err
    with pytest.raises(AttributeError):
        standin.__not_a_kernel__  # noqa: B018 - dunder probes (copy, pickle, inspect) must fail normally


def test_venv_requirements_leave_out_gpu_only_packages() -> None:
    try:
        wheel = pinned_wheel()
    except RuntimeError as exc:  # no registry reachable and nothing cached
        pytest.skip(str(exc))
    reqs = requirements(wheel)
    names = {r.split(";")[0].split("=")[0].split("<")[0].split(">")[0].strip().lower() for r in reqs}
    assert "torch" in names and "transformers" in names and "soundfile" in names
    assert not any(n.startswith(("flashinfer", "flash-attn", "sgl-kernel", "sglang-kernel")) for n in names)
    assert "torchaudio" not in names and "tilelang" not in names
    assert any(r.startswith("torch==") for r in reqs), "SGLang's own torch pin is kept"
    assert GPU_ONLY  # the list the build script leaves out


def test_hook_steps_come_from_the_dockerfile() -> None:
    steps = dockerfile_hook_steps()
    assert steps[0] == "python3 -m hsx_extractor.sglang_hook install-pth"
    assert any("HookFinder" in s and "SGLANG_HS_DUMP_DIR=" in s for s in steps)
    assert not any("pip install" in s for s in steps)

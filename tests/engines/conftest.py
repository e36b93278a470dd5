"""The real SGLang server (the release hsx's hook pins) on CPU, with the hook installed as the image
installs it, for the whole session.

Needs the venv ``tests/engines/build_sglang.sh`` builds (``make test-tools`` runs it); without it
every test here is skipped with the command to run. One server per session (chunked prefill off,
EAGLE-3's default layers, exactly the operator's argv plus CPU flags); tests that need another
configuration start their own with ``sglang_server_factory`` and stop it when they end, because
each start costs about a minute on 2 cores.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# The one import of the tiny-model builder (it may move in a refactor); the output reader's is in
# compare.py. Everything else goes through the hsx CLI, the launcher or the dump protocol.
from hsx_extractor.tools.tinymodel import TinyModelSpec, build_tiny_model
from tests.engines import vllm_venv
from tests.engines.sglang_server import STARTED, SGLangServer
from tests.engines.sglang_venv import install_hook, install_hsx, is_built, venv_dir
from tests.engines.vllm_server import VLLMServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def sglang_venv() -> Path:
    if not is_built():
        pytest.skip(
            f"the SGLang CPU venv is not built at {venv_dir()}: run `bash tests/engines/build_sglang.sh` "
            "(make test-tools does)"
        )
    return venv_dir()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 8 layers, H=64, vocab 512, 4096 positions (SGLang runs it with --context-length 512).
    return build_tiny_model(tmp_path_factory.mktemp("engines-tiny") / "model")


@pytest.fixture(scope="session")
def hsx_for_sglang(sglang_venv: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's hsx as the image has it: its wheel installed --no-deps, then the Dockerfile's
    hook steps (install-pth into the SGLang venv's site-packages, and the image's two checks)."""
    target = install_hsx(tmp_path_factory.mktemp("engines-hsx") / "site")
    install_hook(target)
    return target


@pytest.fixture(scope="session")
def sglang_server_factory(
    tiny_model: Path, hsx_for_sglang: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., SGLangServer]]:
    """``make(name, **SGLangServer fields)``: a started server, stopped at session end at the latest.

    At most one server runs at a time, of either engine: starting one stops the others (each holds
    ~3 GB, and two would share 2 cores with the extractor).
    """
    mine: list[SGLangServer] = []

    def make(name: str, **kw: Any) -> SGLangServer:
        for other in STARTED:  # vLLM's too
            other.stop()
        server = SGLangServer(tiny_model, hsx_for_sglang, tmp_path_factory.mktemp(f"sglang-{name}"), **kw)
        mine.append(server)
        return server.start()

    yield make
    for server in mine:
        server.stop()


# Shared memory the engines make in /dev/shm (torch's file-system storages, SGLang's load reports); a
# server that is SIGKILLed, as several tests here do, leaves them (~400 MB in a full run).
SHM = Path("/dev/shm")
ENGINE_SHM_PREFIXES = ("psm_", "sglang_")


def engine_shm() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir() if p.name.startswith(ENGINE_SHM_PREFIXES)}
    except OSError:
        return set()


def _remove_engine_shm(names: set[str]) -> None:
    for name in names:
        (SHM / name).unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def _engine_shm_removed_at_the_end() -> Iterator[None]:
    """Taken before any server starts (session servers start before a module's fixtures), so what the
    session server left, under a name it reuses on every start, goes too."""
    before = engine_shm()
    yield
    for server in STARTED:
        server.stop()
    _remove_engine_shm(engine_shm() - before)


@pytest.fixture(scope="module", autouse=True)
def _no_server_outlives_its_module() -> Iterator[None]:
    """Stop every server when a module's tests are done: in a full `make test` the rest of the session
    must not share the machine with an idle SGLang (~3 GB). A later module restarts what it needs.
    Then remove the shared memory this module's servers left behind."""
    before = engine_shm()
    yield
    for server in STARTED:
        server.stop()
    _remove_engine_shm(engine_shm() - before)


@pytest.fixture(scope="session")
def _session_server(sglang_server_factory: Callable[..., SGLangServer]) -> SGLangServer:
    return sglang_server_factory("session")


@pytest.fixture
def sglang_server(_session_server: SGLangServer) -> SGLangServer:
    """The session's server: chunked prefill off (the operator's default), EAGLE-3's default layers.
    Started again (same argv, port and dump directory) if a test stopped it."""
    if not _session_server.running():
        _session_server.start()
    return _session_server


@pytest.fixture(scope="session")
def hf_model(tiny_model: Path) -> Any:
    """The same tiny model in transformers, float32, for the reference forward."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def hf_tokenizer(tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model))


# ---------------------------------------------------------------------------------------------
# vLLM (tests/engines/build_vllm.sh builds its venv): the same shape of fixtures as SGLang's.


@pytest.fixture(scope="session")
def vllm_venv_dir() -> Path:
    if not vllm_venv.is_built():
        pytest.skip(
            f"the vLLM CPU venv is not built at {vllm_venv.venv_dir()}: run `bash tests/engines/build_vllm.sh` "
            "(make test-tools does)"
        )
    return vllm_venv.venv_dir()


@pytest.fixture(scope="session")
def vllm_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # vLLM's CPU attention has no kernel for the default tiny model's head size (64 / 4 heads = 16):
    # 2 heads of 32, otherwise the same model.
    return build_tiny_model(
        tmp_path_factory.mktemp("engines-vllm-tiny") / "model", TinyModelSpec(num_heads=2, num_kv_heads=1)
    )


@pytest.fixture(scope="session")
def hsx_for_vllm(vllm_venv_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout's hsx as the vllm image has it: its wheel installed --no-deps."""
    return vllm_venv.install_hsx(tmp_path_factory.mktemp("engines-hsx-vllm") / "site")


@pytest.fixture(scope="session")
def vllm_server_factory(
    vllm_tiny_model: Path, hsx_for_vllm: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[..., VLLMServer]]:
    """``make(name, **VLLMServer fields)``: a started vLLM server; one at a time, as for SGLang."""
    mine: list[VLLMServer] = []

    def make(name: str, **kw: Any) -> VLLMServer:
        for other in STARTED:
            other.stop()
        server = VLLMServer(vllm_tiny_model, hsx_for_vllm, tmp_path_factory.mktemp(f"vllm-{name}"), **kw)
        mine.append(server)
        return server.start()

    yield make
    for server in mine:
        server.stop()


@pytest.fixture(scope="session")
def _vllm_session_server(vllm_server_factory: Callable[..., VLLMServer]) -> VLLMServer:
    return vllm_server_factory("session")


@pytest.fixture
def vllm_server(_vllm_session_server: VLLMServer) -> VLLMServer:
    """The session's vLLM server: chunked prefill off, EAGLE-3's default layers."""
    if not _vllm_session_server.running():
        _vllm_session_server.start()
    return _vllm_session_server


@pytest.fixture(scope="session")
def vllm_hf_model(vllm_tiny_model: Path) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(vllm_tiny_model), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vllm_hf_tokenizer(vllm_tiny_model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(vllm_tiny_model))

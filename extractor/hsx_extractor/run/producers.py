"""Which engine wrote a run's dumps: each engine's producer name, and the engine a producer names."""

from __future__ import annotations

from hsx_extractor import __version__
from hsx_extractor.run.failures import permanent
from hsx_extractor.sglang_hook.launch import HOOK_PRODUCER, SGLANG_VERSION
from hsx_extractor.vllm_hook.launch import PRODUCER as VLLM_PRODUCER
from hsx_extractor.vllm_hook.launch import VLLM_VERSION

# The producer each engine's dumps name (spec.server.engine -> hook/connector).
ENGINE_PRODUCERS = {"sglang": HOOK_PRODUCER, "vllm": VLLM_PRODUCER}


def engine_of(producer: str) -> tuple[str, str]:
    """(engine, version) of a dump producer: SGLang with hsx's hook, or a producer shipped with hsx
    (the reference server), which has hsx's version."""
    if producer == HOOK_PRODUCER:
        return "sglang", SGLANG_VERSION
    if producer == VLLM_PRODUCER:
        return "vllm", VLLM_VERSION
    if producer.startswith("hsx-"):
        return producer, __version__
    raise permanent(f"the server's dumps come from {producer!r}, an engine hsx does not know")

"""One real vLLM server process on CPU, launched the way the operator launches it.

The argv is ``hsx_extractor.vllm_hook.launch.launcher_args(...)`` (the operator's command: hsx's
launcher, which reads the model's config and execs vLLM's server) with ``python3`` replaced by the
vLLM venv's python and the CPU flags below as extra args; the environment is ``server_env(...)``
plus vLLM's CPU settings (vllm_venv.CPU_ENV). The process lifecycle is SGLangServer's.
"""

from __future__ import annotations

from dataclasses import dataclass

from hsx_extractor.model import capture_layers, model_dims, read_model_config
from hsx_extractor.vllm_hook.launch import launcher_args, server_args, server_env
from tests.engines.sglang_server import SGLangServer
from tests.engines.vllm_venv import process_env, venv_python

# What vLLM needs to serve the tiny model on CPU: float32 so captures compare with transformers
# tightly; eager mode, since compiling the graphs costs minutes on 2 cores and is not what is tested.
CPU_ARGS = ("--dtype", "float32", "--enforce-eager", "--max-num-seqs", "16")
CONTEXT_LENGTH = 512
START_TIMEOUT_S = 420.0


@dataclass
class VLLMServer(SGLangServer):
    """A vLLM server; ``layer_ids`` are the spec's (hsx's) ids, as for SGLang. ``hook=False`` starts
    plain vLLM (no extraction flags, no connector, prefix caching still off): bench/engines.py's baseline."""

    engine = "vllm"
    engine_name = "vLLM"

    def capture_layers(self) -> list[int]:
        dims = model_dims(read_model_config(self.model))
        return capture_layers(dims.architecture, dims.num_layers, self.layer_ids)

    def argv(self) -> list[str]:
        """The operator's command (hsx's launcher, which execs vLLM's server with the venv's python3)."""
        if not self.hook:
            plain = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model), "--host", "127.0.0.1",
                     "--port", str(self.port), "--no-enable-prefix-caching", "--max-model-len", str(CONTEXT_LENGTH)]  # fmt: skip
            return [str(venv_python()), *plain, *CPU_ARGS, *self.extra_args]
        argv = launcher_args(
            str(self.model),
            1,
            self.port,
            self.layer_ids,
            [*CPU_ARGS, *self.extra_args],
            chunked_prefill_size=self.chunked_prefill_size,
            context_length=CONTEXT_LENGTH,
        )
        if argv[0] != "python3":
            raise AssertionError(f"launcher_args no longer starts with python3: {argv[:3]}")
        return [str(venv_python()), *argv[1:]]

    def vllm_argv(self) -> list[str]:
        """What the launcher execs (its own log line says the same)."""
        dims = model_dims(read_model_config(self.model))
        return server_args(str(self.model), 1, self.port, self.capture_layers(), dims.num_layers,
                           [*CPU_ARGS, *self.extra_args], chunked_prefill_size=self.chunked_prefill_size,
                           context_length=CONTEXT_LENGTH)  # fmt: skip

    def env(self) -> dict[str, str]:
        extra = {"HF_HUB_OFFLINE": "1"}
        if self.hook:
            assert self.dump_dir is not None
            extra.update(server_env(str(self.dump_dir)))
        return process_env(self.hsx_dir, extra)

    def start(self, timeout: float = START_TIMEOUT_S) -> VLLMServer:
        super().start(timeout)
        return self

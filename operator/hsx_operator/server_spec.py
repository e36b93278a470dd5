"""spec.server of the ExtractionJob: the inference server that runs the model, one pod or a group of pods."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from hsx_extractor.sglang_hook.launch import OWNED_FLAGS
from hsx_extractor.vllm_hook.launch import OWNED_FLAGS as VLLM_OWNED_FLAGS
from hsx_operator.cel import cel
from hsx_operator.pod_settings import MAX_TEXT as _STR
from hsx_operator.pod_settings import QUANTITY_PATTERN, EnvVar, Resources
from hsx_operator.server_flags import EXTRA_ARGS_RULE, IS_VLLM

# The server image of each engine (server.engine), used when server.image is not set.
DEFAULT_SERVER_IMAGES = {"sglang": "ghcr.io/hsx-dev/hsx-sglang:0.1.0", "vllm": "ghcr.io/hsx-dev/hsx-vllm:0.1.0"}

# Upper bound of server.shmSize: past it a value is a typo, not a node.
MAX_SHM = "4Ti"
# A group is one Kueue workload whose pod sets are the leader and one per worker rank; Kueue allows 8.
MAX_NODES = 8
_LIST = 64


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ServerSpec(_Spec):
    """The extraction server (SGLang with hsx's hook, or vLLM with hsx's connector), run as a native
    sidecar that owns the GPUs."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.tensorParallel) || self.gpus % self.tensorParallel == 0",
                    "server.gpus must be a multiple of server.tensorParallel (the rest is data parallel)",
                ),
                cel(
                    "!has(self.resources) || (!('nvidia.com/gpu' in self.resources.?requests.orValue({})) && "
                    "!('nvidia.com/gpu' in self.resources.?limits.orValue({})))",
                    "set server.gpus instead of nvidia.com/gpu in server.resources",
                ),
                cel(
                    EXTRA_ARGS_RULE,
                    "server.extraArgs may not set flags extraction mode owns (SGLang: "
                    + ", ".join(sorted(OWNED_FLAGS))
                    + "; vLLM: "
                    + ", ".join(sorted(VLLM_OWNED_FLAGS))
                    + ") nor any abbreviation of them (SGLang reads --tp-siz as --tp-size), nor --config (a "
                    "file of arguments); use model, server.gpus, server.tensorParallel and server.port instead",
                ),
                cel(
                    f"!{IS_VLLM} || !has(self.tensorParallel) || self.tensorParallel == self.gpus",
                    "server.engine vllm runs one tensor-parallel group per pod: leave server.tensorParallel "
                    "unset or equal to server.gpus (use parallelism for more replicas)",
                ),
                cel(
                    "!has(self.resources) || !('memory' in self.resources.?limits.orValue({})) || "
                    "!isQuantity(self.resources.limits['memory']) || !isQuantity(self.shmSize) || "
                    "quantity(self.resources.limits['memory']).compareTo(quantity(self.shmSize)) > 0",
                    "server.resources.limits.memory must be larger than server.shmSize: the dumps and NCCL "
                    "buffers in /dev/shm count against the server's memory limit",
                ),
                cel(
                    "!has(self.shmSize) || !isQuantity(self.shmSize) || "
                    f"quantity(self.shmSize).compareTo(quantity('{MAX_SHM}')) <= 0",
                    f"server.shmSize must be at most {MAX_SHM} (the largest node memory hsx sizes for); "
                    "the dumps waiting for the extractor need extractor.dumpDirMaxBytes of it",
                ),
                cel(
                    "self.nodes == 1 || !has(self.tensorParallel) || self.tensorParallel == self.gpus",
                    "with server.nodes > 1 the server is one tensor-parallel group over every node's GPUs: leave "
                    "server.tensorParallel unset or equal to server.gpus (a data-parallel replica on a worker node "
                    "would write its dumps where no extractor reads; use parallelism for more groups)",
                ),
                cel(
                    f"!{IS_VLLM} || self.nodes == 1",
                    "server.nodes > 1 needs server.engine sglang: vLLM 0.32 spans nodes only through a Ray "
                    "cluster, which hsx does not run (docs/operator-design.md)",
                ),
                cel(
                    "!has(self.env) || self.env.all(e, e.name != 'SGLANG_HS_DUMP_DIR')",
                    "SGLANG_HS_DUMP_DIR is set by the operator and cannot be overridden in server.env",
                ),
            ]
        }
    )

    engine: Literal["sglang", "vllm"] = Field(
        default="sglang",
        description="The server's engine: sglang (SGLang 0.5.23 with hsx's hook; final state after the model's "
        "final norm) or vllm (vLLM 0.32 with hsx's KV connector; final state before it). docs/vllm.md.",
    )
    image: str | None = Field(
        default=None,
        description="Server image; defaults to the cluster's (the chart's clusterDefaults), else hsx's image of the "
        f"engine ({', '.join(f'{k}: {v}' for k, v in DEFAULT_SERVER_IMAGES.items())}).",
        min_length=1,
        max_length=_STR,
    )
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent",
                                                                      description="When the node pulls the server image.")  # fmt: skip
    gpus: int = Field(default=8, ge=1, le=16, description="nvidia.com/gpu limit of the server container (one pod).")
    tensorParallel: int | None = Field(default=None, ge=1, le=16, description="Tensor-parallel size (--tp). "
                                       "Defaults to gpus; gpus/tensorParallel is the data-parallel size. With "
                                       "nodes > 1 it is the size per node: the server's --tp is nodes times it.")  # fmt: skip
    nodes: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description="Nodes one server spans (SGLang --nnodes). With nodes > 1 each replica is a group of pods, "
        "one per node with server.gpus GPUs each, run as one JobSet admitted and restarted as a whole: the leader "
        "runs rank 0, the extractor and the preflight; the others run the server's other ranks only. "
        "docs/operator-design.md.",
    )
    port: int = Field(default=30000, ge=1024, le=65535, description="Port the server listens on inside the pod.")
    extraArgs: list[str] = Field(
        default_factory=list,
        description="Extra arguments appended to the server's command line (for example --mem-fraction-static 0.8).",
        max_length=_LIST,
        json_schema_extra={"items": {"type": "string", "maxLength": 1024}},
    )
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment of the server container.",
                              max_length=_LIST)  # fmt: skip
    startupTimeoutSeconds: int = Field(
        default=1800,
        ge=10,
        le=86400,
        description="Budget of the server's startup probe on /health (weights loading, CUDA graphs). When it "
        "runs out the server is killed and the run fails (ServerExited), as when the server exits before ready.",
    )
    resources: Resources = Field(
        default_factory=Resources,
        description="CPU and memory of the server container; GPUs come from gpus.",
        json_schema_extra={"default": {}},
    )
    shmSize: str = Field(
        default="16Gi",
        description="Size of the shared-memory volume (/dev/shm) that holds NCCL buffers and the dumps waiting "
        "for the extractor. It counts against the pod's memory.",
        pattern=QUANTITY_PATTERN,
        max_length=64,
    )

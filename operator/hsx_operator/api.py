"""The ExtractionJob resource (hsx.dev/v1alpha1) as pydantic models: the one definition of the spec.

crds/extractionjobs.hsx.dev.yaml is generated from these models by :mod:`hsx_operator.crdgen`.
Descriptions become ``kubectl explain`` text; ``x-kubernetes-validations`` (CEL) hold the checks
the API server enforces across fields. The dataset, output and validation blocks are the
extractor's own config models, so the CRD and ``hsx extract`` cannot disagree.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from hsx_extractor.config import (
    RUN_ID_PATTERN,
    DatasetSpec,
    ExtractConfig,
    GenerationSpec,
    OutputSpec,
    ValidationSpec,
)
from hsx_operator.cel import cel, location_rules
from hsx_operator.placement import SchedulingSpec
from hsx_operator.pod_settings import (
    EXTRACTOR_ENV_DOC,
    EXTRACTOR_ENV_RULE,
    EXTRACTOR_OWN_ENV,
    EnvVar,
    PodSettings,
    Resources,
)
from hsx_operator.pod_settings import MAX_TEXT as _STR
from hsx_operator.server_spec import DEFAULT_SERVER_IMAGES, ServerSpec

GROUP = "hsx.dev"
VERSION = "v1alpha1"
KIND = "ExtractionJob"
PLURAL = "extractionjobs"
SINGULAR = "extractionjob"
SHORT_NAMES = ("xj",)

DEFAULT_EXTRACTOR_IMAGE = "ghcr.io/hsx-dev/hsx-extractor:0.1.0"

ABS_PATH_PATTERN = r"^/.*$"

# Fields the operator passes through to each pod's extractor config take that config's defaults.
_EXTRACT_DEFAULTS = ExtractConfig.model_fields

# Upper bounds of sizes: past them a value is a typo, not a node (the API server says the range).
MAX_DUMP_DIR_BYTES = 4 << 40

# Bounds keep CEL's estimated cost within the API server's budget (it prices by maximum size).
_LIST = 64


class _Spec(BaseModel):
    # Unknown fields are errors, as in the extractor's config.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class PVCSource(_Spec):
    """A PersistentVolumeClaim holding the model weights."""

    claimName: str = Field(description="Name of the PersistentVolumeClaim in the job's namespace.", min_length=1,
                           max_length=253)  # fmt: skip
    subPath: str | None = Field(default=None, description="Directory inside the volume to mount instead of its root.",
                                max_length=_STR)  # fmt: skip


class HostPathSource(_Spec):
    """A directory on the node holding the model weights (single-node clusters, pre-staged nodes)."""

    path: str = Field(description="Absolute directory on the node.", pattern=ABS_PATH_PATTERN, max_length=_STR)


class ImageSource(_Spec):
    """An OCI image holding the model weights, mounted as an image volume (read-only)."""

    reference: str = Field(description="Image reference, for example registry.example.com/models/llama:3.1-8b.",
                           min_length=1, max_length=_STR)  # fmt: skip
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the node pulls the image: Always, IfNotPresent or Never."
    )


class ModelSource(_Spec):
    """Where the weights come from. Set exactly one of pvc, hostPath and image."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "[has(self.pvc), has(self.hostPath), has(self.image)].filter(x, x).size() == 1",
                    "model.source needs exactly one of pvc, hostPath or image",
                )
            ]
        }
    )

    pvc: PVCSource | None = Field(default=None, description="Mount a PersistentVolumeClaim.")
    hostPath: HostPathSource | None = Field(default=None, description="Mount a directory of the node.")
    image: ImageSource | None = Field(
        default=None,
        description="Mount an OCI image as a volume. Needs Kubernetes image volumes (the ImageVolume feature: "
        "1.31+, behind its feature gate where it is not on by default); the chart's kubeVersion (>=1.29) "
        "does not imply it, and a cluster without it refuses the pod.",
    )


class ModelSpec(_Spec):
    """The target model whose hidden states are captured."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    # Inside means at or below: /models-other is not inside /models.
                    "!has(self.source) || self.path == self.mountPath || self.path.startsWith("
                    "self.mountPath.endsWith('/') ? self.mountPath : self.mountPath + '/')",
                    "model.path must lie inside model.mountPath when model.source is set (at or below it: "
                    "/models-other is not inside /models)",
                ),
                cel(
                    "!has(self.auxLayerIds) || "
                    "self.auxLayerIds.all(x, self.auxLayerIds.filter(y, y == x).size() == 1)",
                    "model.auxLayerIds must be distinct: list each layer once",
                ),
            ]
        }
    )

    path: str = Field(
        description="Model directory inside the containers (config.json, weights, tokenizer). With a source, "
        "it lies under mountPath; without one, the weights are baked into the server image.",
        pattern=ABS_PATH_PATTERN,
        max_length=_STR,
    )
    source: ModelSource | None = Field(
        default=None,
        description="Volume holding the weights, mounted read-only at mountPath in both containers.",
    )
    mountPath: str = Field(
        default="/models",
        description="Where the model volume is mounted.",
        pattern=ABS_PATH_PATTERN,
        max_length=_STR,
    )
    auxLayerIds: list[int] | None = Field(
        default=None,
        description="Layer ids for --return-aux-hidden-state-layer-ids (SGLang's convention: an id names the "
        "layer whose output is captured). Omit for EAGLE-3's default: inputs of layers 2, N/2 and N-3.",
        min_length=1,
        max_length=8,
        json_schema_extra={"items": {"type": "integer", "minimum": 0, "maximum": 1023}},
    )
    finalState: Literal["post-norm", "pre-norm"] | None = Field(
        default=None,
        description="The final layer's state to capture: post-norm (after the model's final norm; SGLang's default) "
        "or pre-norm (its input: what speculators trains on; vLLM's only). The manifest's capture.finalState says which.",
    )


class ExtractorSpec(_Spec):
    """The hsx extractor, the pod's main container."""

    image: str | None = Field(default=None, min_length=1, max_length=_STR, description=f"Extractor image; defaults to "
                              f"the cluster's (the chart's clusterDefaults), else {DEFAULT_EXTRACTOR_IMAGE}.")  # fmt: skip
    imagePullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(default="IfNotPresent",
                                                                      description="When the node pulls the extractor image.")  # fmt: skip
    resources: Resources = Field(
        default_factory=Resources,
        description="CPU and memory of the extractor container.",
        json_schema_extra={"default": {}},
    )
    workers: int | None = Field(
        default=None,
        ge=1,
        le=32,
        description="Extractor processes in the pod, each with its own interpreter, leasing shards like a pod "
        "of its own (one is capped near 4 GB/s of hidden states by its GIL). Unset: one per 4 cores of the "
        "extractor's CPU request (or limit), at least one.",
    )
    progressPort: int = Field(
        default=_EXTRACT_DEFAULTS["progressPort"].default,
        ge=1024,
        le=65535,
        description="Port of the extractor's /progress and /metrics.",
    )
    dumpDirMaxBytes: int = Field(
        default=_EXTRACT_DEFAULTS["dumpDirMaxBytes"].default,
        ge=1 << 20,
        le=MAX_DUMP_DIR_BYTES,
        description="Back-pressure: fewer requests are sent while waiting dumps exceed this many bytes.",
    )
    env: list[EnvVar] = Field(default_factory=list, description=EXTRACTOR_ENV_DOC, max_length=_LIST,
                              json_schema_extra={"x-kubernetes-validations": [EXTRACTOR_ENV_RULE]})  # fmt: skip

    @field_validator("env")
    @classmethod
    def _not_hsx_own(cls, env: list[EnvVar]) -> list[EnvVar]:  # the CRD's rule, for `hsx render` and the operator
        if taken := sorted({e.name for e in env} & set(EXTRACTOR_OWN_ENV)):
            raise ValueError(f"extractor.env may not set hsx's own variables: {taken}")
        return env


# Fields that are always present (required or defaulted) compare directly; optional scalars through
# CEL optionals (the API server prices optional *objects* as unbounded).
_LOCKED_FIELDS = (
    "model",
    "server",
    "extractor",
    "dataset",
    "output",
    "validation",
    "concurrency",
    "backoffLimit",
    "scheduling",
    "pod",
)
_LOCKED_OPTIONAL = ("activeDeadlineSeconds", "startupDeadlineSeconds", "ttlSecondsAfterFinished")
# A run's spec is fixed while its runId stays (parallelism aside: pods lease shards, so the fleet may
# grow or shrink mid-run): change runId to run again with other settings.
_LOCK_RULE = (
    "self.runId != oldSelf.runId || ("
    + " && ".join(
        [f"self.{f} == oldSelf.{f}" for f in _LOCKED_FIELDS]
        + [f"self.?{f} == oldSelf.?{f}" for f in _LOCKED_OPTIONAL]
    )
    + ")"
)


class ExtractionJobSpec(_Spec):
    """An extraction run: a model, a dataset and where the hidden states go."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    _LOCK_RULE,
                    "only runId, suspend and parallelism may change; to run with other settings, change runId too",
                    reason="FieldValueForbidden",
                ),
                cel(
                    "self.server.nodes == 1 || self.runId != oldSelf.runId || self.parallelism == oldSelf.parallelism",
                    "with server.nodes > 1 the run's groups are one JobSet, fixed for the run: change runId to "
                    "run with another parallelism",
                    reason="FieldValueForbidden",
                ),
                cel(
                    "has(self.model.source) || has(self.dataset.tokenizer)",
                    "the extractor needs the tokenizer: set model.source (mounted in both containers) or dataset.tokenizer",
                ),
                cel(
                    "!has(self.startupDeadlineSeconds) || !has(self.activeDeadlineSeconds) || "
                    "self.startupDeadlineSeconds < self.activeDeadlineSeconds",
                    "startupDeadlineSeconds must be shorter than activeDeadlineSeconds",
                ),
                *location_rules("dataset"),
                *location_rules("output"),
                cel("self.runId != 'manifest'", "runId 'manifest' is reserved"),
                cel(
                    "!has(self.responses) || self.responses != 'regenerate' || ((!has(self.dataset.format) || "
                    "self.dataset.format != 'tokens') && (!has(self.dataset.expandTurns) || !self.dataset.expandTurns))",
                    "responses: regenerate needs conversations (not dataset.format tokens) and no dataset.expandTurns",
                ),
                cel(
                    "!has(self.responses) || self.responses != 'regenerate' || !has(self.server.engine) || "
                    "self.server.engine != 'vllm' || !has(self.generation.temperature) || self.generation.temperature == 0.0",
                    "responses: regenerate with server.engine vllm needs generation.temperature 0: vLLM in extraction "
                    "mode samples other tokens than the model's (greedy is exact); use engine sglang to sample",
                ),
                cel(
                    "!has(self.continueFrom) || self.continueFrom != self.runId",
                    "continueFrom names an earlier runId, not this one",
                ),
                # Apart from the lock rule, and without CEL optionals: the API server prices an optional
                # string as unbounded, past its cost budget.
                cel(
                    "self.runId != oldSelf.runId || (has(self.continueFrom) == has(oldSelf.continueFrom) && "
                    "(!has(self.continueFrom) || self.continueFrom == oldSelf.continueFrom))",
                    "continueFrom is fixed while runId stays: change runId too",
                    reason="FieldValueForbidden",
                ),
                cel(
                    "!has(self.model.finalState) || self.model.finalState == 'pre-norm' || "
                    "!has(self.server.engine) || self.server.engine != 'vllm'",
                    "model.finalState post-norm needs server.engine sglang: vLLM dumps only pre-norm "
                    "(hsx export --model applies the final norm)",
                ),
                cel(
                    "self.server.port != self.extractor.progressPort",
                    "server.port and extractor.progressPort must differ: both listen in the same pod",
                ),
                cel(
                    "!isQuantity(self.server.shmSize) || "
                    "quantity(self.server.shmSize).asApproximateFloat() > double(self.extractor.dumpDirMaxBytes)",
                    "extractor.dumpDirMaxBytes must be smaller than server.shmSize: the waiting dumps live in "
                    "/dev/shm next to NCCL's buffers (for example shmSize 48Gi with dumpDirMaxBytes 32Gi)",
                ),
            ]
        }
    )

    runId: str = Field(
        description="Identifies one run; output goes under {output.uri}/{runId}/. Change it to run again "
        "(a new Job, a new output prefix; earlier runs' data is kept). Lowercase letters, digits and '-'.",
        pattern=RUN_ID_PATTERN,
        max_length=40,
    )
    continueFrom: str | None = Field(
        default=None,
        description="Continue an earlier run that failed or was stopped (a deadline, backoffLimit): this run (a new "
        "runId, a new Job) writes under {output.uri}/{continueFrom}/, keeps every shard committed there and "
        "extracts the rest. The stored plan, dataset digests and model facts are checked as on any resume, so a "
        "changed dataset or model fails instead of mixing. The output's runId stays continueFrom.",
        pattern=RUN_ID_PATTERN,
        max_length=40,
    )
    model: ModelSpec = Field(description="The target model and where its weights come from.")
    server: ServerSpec = Field(
        default_factory=ServerSpec,  # type: ignore[arg-type]
        description="The extraction server (patched SGLang) sidecar.",
        json_schema_extra={"default": {}},
    )
    extractor: ExtractorSpec = Field(
        default_factory=ExtractorSpec,  # type: ignore[arg-type]
        description="The extractor main container.",
        json_schema_extra={"default": {}},
    )
    dataset: DatasetSpec = Field(description="Where the samples come from and how they become tokens.")
    output: OutputSpec = Field(description="Where shards go and how they are stored.")
    validation: ValidationSpec = Field(
        default_factory=ValidationSpec,  # type: ignore[arg-type]
        description="How strictly dumps are checked against what was sent.",
        json_schema_extra={"default": {}},
    )
    responses: Literal["dataset", "regenerate"] = Field(
        default=_EXTRACT_DEFAULTS["responses"].default, description=_EXTRACT_DEFAULTS["responses"].description
    )
    generation: GenerationSpec = Field(default_factory=GenerationSpec,  # type: ignore[arg-type]
                                       description="How the target regenerates the responses (responses: regenerate).",
                                       json_schema_extra={"default": {}})  # fmt: skip
    concurrency: int = Field(default=_EXTRACT_DEFAULTS["concurrency"].default, ge=1, le=1024,
                             description="Requests in flight at each pod's server.")  # fmt: skip
    parallelism: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Number of pods, each with its own server. Shards are leased, not assigned: each pod takes the "
        "next unclaimed shard, and may change while the run goes on (more pods join, fewer release their shards).",
    )
    backoffLimit: int = Field(
        default=3, ge=0, le=100, description="Pod failures retried before the run fails; evictions and disruptions do not count."
    )
    activeDeadlineSeconds: int | None = Field(
        default=None,
        ge=1,
        description="Longest the run may take from its Job's start (a JobSet's: its restarts do not start it "
        "again); then it fails with DeadlineExceeded.",
    )
    startupDeadlineSeconds: int | None = Field(
        default=None,
        ge=1,
        description="Longest the run may take from its Job's start (Kueue's admission, not the time queued) to "
        "get every server ready (scheduling, image pulls, weights loading); then it fails with StartupDeadlineExceeded.",
    )
    suspend: bool = Field(
        default=False,
        description="true stops the pods (committed shards are kept); false again resumes from what the bucket holds.",
    )
    ttlSecondsAfterFinished: int | None = Field(
        default=None,
        ge=0,
        description="Delete the finished Job (and its pods) this long after it ends. The ExtractionJob and its "
        "status stay, and a finished run is never started again.",
    )
    scheduling: SchedulingSpec = Field(
        default_factory=SchedulingSpec,  # type: ignore[arg-type]
        description="Node selection, tolerations, affinity, priority and Kueue queue.",
        json_schema_extra={"default": {}},
    )
    pod: PodSettings = Field(
        default_factory=PodSettings,  # type: ignore[arg-type]
        description="Pod settings: service account (cloud identity for S3), image pull secrets, labels, annotations, "
        "runtime class, a CA bundle for HTTPS to S3.",
        json_schema_extra={"default": {}},
    )

    def output_run_id(self) -> str:
        """The run the output belongs to: continueFrom's, or this runId's."""
        return self.continueFrom or self.runId

    def tensor_parallel(self) -> int:
        return self.server.tensorParallel or self.server.gpus

    def server_image(self) -> str:
        return self.server.image or DEFAULT_SERVER_IMAGES[self.server.engine]

    def extractor_image(self) -> str:
        return self.extractor.image or DEFAULT_EXTRACTOR_IMAGE

"""The extractor's configuration, in the same field names as the ExtractionJob spec.

The operator imports :class:`DatasetSpec`, :class:`OutputSpec` and :class:`ValidationSpec` into
its CRD; ``hsx extract --config FILE`` reads the same names from YAML or JSON. Every field is
documented where it is declared: these descriptions become ``kubectl explain`` text.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from hsx_extractor.model import final_state_problem
from hsx_extractor.usage import UsageError

RUN_ID_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$"


# Anything that looks like "scheme:" but is not one hsx reads: "s3:/bucket" would otherwise be a
# relative local path and write into the working directory.
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_SCHEMES = ("s3://", "file://")
# s3:// must name a bucket: no empty name, no whitespace (a pasted newline).
S3_URI_PATTERN = r"^s3://[^/\s]+(/\S*)?$"
# AWS regions and S3-compatible stores' names (us-east-1, fr-par, garage): no spaces or newlines.
REGION_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,62}[A-Za-z0-9])?$"


def check_uri(uri: str) -> str:
    """A dataset or output URI hsx can read: s3://bucket/key, file:///path or a path."""
    if _SCHEME.match(uri) and not uri.startswith(_SCHEMES):
        raise ValueError(f"unsupported URI {uri!r}: use s3://bucket/key, file:///path or a local path")
    if uri.startswith("s3://") and not re.match(S3_URI_PATTERN, uri):
        raise ValueError(f"URI {uri!r} must be s3://bucket/key: a bucket name, no spaces or line breaks")
    return uri


def check_local_directory(text: str, what: str) -> Path:
    """A local directory named on the command line; an ``s3://`` URI or anything else that looks
    like one (``s3:/bucket``, which a path would turn into ``./s3:/bucket``) is a :class:`UsageError`."""
    if _SCHEME.match(text) and not text.startswith("file://"):
        raise UsageError(
            f"{what} {text!r} must be a local directory: hsx writes it locally (copy it to object storage "
            "afterwards, e.g. aws s3 cp --recursive)"
        )
    return Path(text.removeprefix("file://"))


def check_endpoint(url: str | None) -> str | None:
    if url is not None and not url.startswith(("http://", "https://")):
        raise ValueError(f"endpoint {url!r} must be an http:// or https:// URL")
    return url


class _Spec(BaseModel):
    # Unknown fields are errors: a typo must not be silently ignored.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class DatasetSpec(_Spec):
    """Where the samples come from and how they become tokens."""

    uri: str = Field(
        description="Dataset: a local path, file:// or s3://bucket/key URI, read as a stream. JSONL (plain, "
        ".gz or .zst) with one sample per line, or Parquet (.parquet) with one sample per row: "
        '{"id", "messages"} or ShareGPT {"id", "conversations": [{"from", "value"}]} (rendered with the chat '
        'template, optional "tools"), or {"id", "input_ids", "loss_mask"} (pre-tokenized).',
        min_length=1,
    )
    format: Literal["auto", "messages", "tokens"] = Field(
        "auto",
        description="Row format. auto decides per row: rows with input_ids are pre-tokenized, rows with "
        "messages or conversations are rendered with the chat template; a row with both is quarantined.",
    )
    chatTemplate: str | None = Field(
        None,
        description="Jinja chat template to use instead of the tokenizer's own. With "
        "{% generation %} ... {% endgeneration %} blocks the loss mask is what they mark; without them "
        "(stock templates) it comes from rendering each conversation up to every assistant turn with and "
        "without that turn, and a conversation the template does not render prefix-stably is quarantined "
        "(template_not_prefix_stable).",
    )
    expandTurns: bool = Field(
        False,
        description="One sample per assistant turn: the conversation up to and including that turn, loss "
        "only on it. For templates that render earlier turns differently from how the model produced them "
        "(reasoning templates that drop earlier turns' thinking).",
    )
    specialTokensInContent: Literal["text", "allow", "quarantine"] = Field(
        "text",
        description="Special-token strings (the tokenizer's added tokens, e.g. <|eot_id|> or <think>) inside "
        "message content: text keeps them as ordinary text (never their special ids), quarantine "
        "quarantines such rows (special_tokens_in_content), allow lets them become special ids.",
    )
    tokenizer: str | None = Field(
        None,
        description="Directory holding tokenizer.json and tokenizer_config.json. Defaults to the model path.",
    )
    maxLength: int = Field(
        8192,
        ge=1,
        le=1_048_576,
        description="Longest sample in tokens; longer samples are quarantined "
        "with reason too_long, never truncated.",
    )
    expectedTokenizerFingerprint: str | None = Field(
        None,
        description="Fingerprint of the tokenizer the dataset was prepared with (hsx fingerprint DIR). "
        "When set, the run fails at start if the tokenizer in use differs.",
        pattern=r"^[0-9a-f]{16,64}$",
    )
    limit: int | None = Field(None, ge=1, description="Use only the first N rows (for trial runs).")
    endpoint: str | None = Field(
        None, description="S3 endpoint URL of the dataset's store. Defaults to output.endpoint."
    )
    region: str | None = Field(
        None,
        description="S3 region of the dataset's store. Defaults to output.region.",
        pattern=REGION_PATTERN,
        max_length=64,
    )
    pathStyle: bool | None = Field(
        None, description="Path-style addressing for the dataset's store. Defaults to output.pathStyle."
    )
    credentialsSecret: str | None = Field(
        None,
        description="Secret with AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (optionally AWS_SESSION_TOKEN) "
        "for reading the dataset. Defaults to output.credentialsSecret.",
    )

    _uri = field_validator("uri")(check_uri)
    _endpoint = field_validator("endpoint")(check_endpoint)


class OutputSpec(_Spec):
    """Where shards go and how they are stored."""

    uri: str = Field(
        description="Output prefix: s3://bucket/prefix for object storage, or a local directory (tests, "
        "demo). Each run writes under {uri}/{runId}/.",
        min_length=1,
    )
    endpoint: str | None = Field(
        None, description="S3 endpoint URL for S3-compatible stores (MinIO, SeaweedFS, Ceph)."
    )
    region: str | None = Field(
        None,
        description="S3 region. Defaults to the AWS configuration chain.",
        pattern=REGION_PATTERN,
        max_length=64,
    )
    pathStyle: bool = Field(
        False,
        description="Use path-style addressing (bucket in the path), needed by most S3-compatible stores.",
    )
    credentialsSecret: str | None = Field(
        None,
        description="Name of a Secret in the job's namespace holding AWS_ACCESS_KEY_ID and "
        "AWS_SECRET_ACCESS_KEY (and optionally AWS_SESSION_TOKEN). The operator passes it to the pod "
        "as environment; it never reads it.",
    )
    shardTargetBytes: int = Field(
        1 << 30,
        ge=1 << 20,
        le=4 << 30,
        description="Target size of one shard in bytes (before compression). Samples are assigned to "
        "shards by dataset position, so the same dataset always yields the same shards.",
    )
    compression: Literal["none", "bf16-zstd", "fp8-e4m3"] = Field(
        "bf16-zstd",
        description="Compression of hidden states: bf16-zstd (lossless) compresses each value's high byte "
        "(sign and exponent) with zstd and stores the low byte raw; none stores raw bf16; fp8-e4m3 (lossy, "
        "about half the size) stores each token's values as FP8 E4M3 with one float32 scale per token.",
    )
    partSizeBytes: int = Field(
        64 << 20,
        ge=5 << 20,
        le=5 << 30,
        description="Largest multipart upload part in bytes. A smaller object is cut into "
        "uploadConcurrency parts (of at least 5 MiB), so one shard alone keeps every connection busy.",
    )
    uploadConcurrency: int = Field(16, ge=1, le=256, description="Parts uploaded in parallel per pod.")
    maxOpenShards: int = Field(
        6,
        ge=2,
        le=64,
        description="Shards a pod holds on its scratch disk at once, being filled or waiting to upload: "
        "reading waits while this many are open, so a slow store never fills /scratch. The pod's /scratch "
        "sizeLimit is maxOpenShards x shardTargetBytes plus 1 GiB.",
    )

    _uri = field_validator("uri")(check_uri)
    _endpoint = field_validator("endpoint")(check_endpoint)


DEFAULT_CONSISTENCY_SAMPLES = 2


class ConsistencySpec(_Spec):
    """Whether the captured final states agree with the model's own next-token predictions."""

    # None, not 2: a default the API server writes into the object would read as the user's choice,
    # and only a choice made by the user fails a run that cannot check (vLLM, no readable weights).
    samplesPerShard: int | None = Field(
        None,
        ge=0,
        le=64,
        description="Requests per shard (chosen by sample index, the same on every attempt) that also ask "
        "the server for the prompt's top next-token logprobs; their captured final state, through the "
        "model's lm_head (read from modelPath with numpy), must rank the same tokens with logprobs within "
        f"tolerance. 0 turns the check off. Unset: {DEFAULT_CONSISTENCY_SAMPLES} where the check can run "
        "(engine sglang, weights readable by the extractor), else off with a warning; set, a run that "
        "cannot check fails.",
    )

    @property
    def samples_per_shard(self) -> int:
        return DEFAULT_CONSISTENCY_SAMPLES if self.samplesPerShard is None else self.samplesPerShard

    @property
    def asked(self) -> bool:
        """Whether the user set the check explicitly (then a run that cannot check fails)."""
        return self.samplesPerShard is not None

    positions: int = Field(
        4, ge=1, le=64, description="Prompt positions compared per checked request, spread over its tail."
    )
    topK: int = Field(5, ge=1, le=20, description="Top next-token logprobs compared at each position.")
    logprobTolerance: float = Field(
        0.05,
        gt=0,
        le=10,
        description="Absolute part of the allowed logprob difference (nats) between the server and the "
        "captured state.",
    )
    logprobRelTolerance: float = Field(
        0.008,
        ge=0,
        le=1,
        description="Relative part, times the largest |logit| at the position: a bf16 server rounds logits "
        "by up to 2^-9 of their size, and the target's logit and the normaliser each carry that error.",
    )
    maxFailureRate: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="The run fails (CaptureInconsistent) when more than this fraction of checked requests "
        "disagree, judged once minChecks requests were checked and again at the end of the run.",
    )
    minChecks: int = Field(
        4, ge=1, description="Checked requests needed before the failure rate can fail the run early."
    )


class ValidationSpec(_Spec):
    """How strictly dumps are checked against what was sent."""

    onMismatch: Literal["quarantine", "fail"] = Field(
        "quarantine",
        description="What a mismatching dump does: quarantine the sample (with its reason) and go on, "
        "or fail the run at once.",
    )
    maxMismatchRate: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="The run stops when more than this fraction of samples in the gate window mismatch.",
    )
    gateWindow: int = Field(
        200, ge=1, description="Number of most recent samples over which the mismatch rate is measured."
    )
    maxRejectedRowRate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="The run fails (DatasetRejected) when more than this fraction of its samples were set aside "
        "by the dataset checks (invalid_json, too_long, template_error, ...; with responses regenerate also the "
        "generation's, truncated_generation, ...; not the server's mismatches): judged "
        "once 1000 samples were done and again at the end, so a dataset that is all wrong never ends Succeeded. "
        "1 turns it off.",
    )
    gateMinSamples: int = Field(
        20, ge=1, description="The gate only trips once at least this many samples were checked."
    )
    dumpTimeoutSeconds: float = Field(
        300.0, gt=0, description="How long to wait for a request's dump after the server answered."
    )
    maxRetries: int = Field(
        2,
        ge=0,
        le=10,
        description="Retries of a request whose dump did not arrive before quarantine (no_dump).",
    )
    consistency: ConsistencySpec = Field(
        default_factory=ConsistencySpec,  # type: ignore[arg-type]
        description="Check sampled captures against the model's own next-token logprobs.",
        json_schema_extra={"default": {}},
    )


class GenerationSpec(_Spec):
    """How the target regenerates the responses (``responses: regenerate``); docs/training.md."""

    turns: Literal["last", "each"] = Field(
        "last",
        description="last: only the final assistant turn is regenerated (a row ending in a user or tool turn gets a "
        "new assistant turn); each: every assistant turn, in order, each from the conversation regenerated so far. "
        "Assistant turns that call tools are kept as the dataset has them.",
    )
    maxNewTokens: int = Field(
        2048, ge=1, le=1 << 20, description="Most tokens generated per turn (less where dataset.maxLength leaves less)."
    )
    temperature: float = Field(0.0, ge=0, le=100, description="Sampling temperature; 0 is greedy.")
    topP: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: the smallest set of tokens with this mass.")
    seed: int | None = Field(
        None,
        ge=0,
        le=(1 << 62),
        description="Row i samples with seed + i, so a row's generation does not depend on what it was batched "
        "with. SGLang honours it only when started with --enable-deterministic-inference (server.extraArgs); "
        "vLLM regenerates greedily (temperature 0), where no seed matters.",
    )
    stop: list[str] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra={"items": {"type": "string", "minLength": 1, "maxLength": 256}},
        description="Strings that end a turn besides the model's end-of-turn tokens; the stop string stays in the "
        "regenerated text, so it re-renders to the generated ids.",
    )
    onTruncated: Literal["quarantine", "keep"] = Field(
        "quarantine",
        description="A turn that reached maxNewTokens without stopping: quarantine the row as truncated_generation, "
        "or keep it (its turn ends where the tokens ran out, closed by the template).",
    )

    @field_validator("stop")
    @classmethod
    def _stops_short(cls, v: list[str]) -> list[str]:
        if any(not s or len(s) > 256 for s in v):
            raise ValueError("each stop string must be 1 to 256 characters")
        return v


# What a regenerating run refuses, in one place for the extractor (and, as CEL, the CRD).
def regenerate_problem(responses: str, dataset: DatasetSpec, engine: str, generation: GenerationSpec) -> str | None:
    if responses != "regenerate":
        return None
    if engine == "vllm" and generation.temperature > 0:
        # Its extract_hidden_states speculative method (how hsx captures) proposes the sampled token again
        # as the draft; a sampled draft's verification then emits near-uniform tokens (tests/engines).
        return ("responses: regenerate with engine vllm needs generation.temperature 0: vLLM 0.32 in extraction "
                "mode samples other tokens than the model's; use greedy decoding, or engine sglang to sample")
    if dataset.format == "tokens":
        return "responses: regenerate needs conversations: dataset.format tokens has no turns to regenerate"
    if dataset.expandTurns:
        return "responses: regenerate does not combine with dataset.expandTurns yet; regenerate first, then expand"
    return None


class ExtractConfig(_Spec):
    """Everything ``hsx extract`` needs. The operator writes this file for each pod."""

    runId: str = Field(
        description="Run identifier; output goes under {output.uri}/{runId}/.", pattern=RUN_ID_PATTERN
    )
    dataset: DatasetSpec
    output: OutputSpec
    validation: ValidationSpec = Field(default_factory=ValidationSpec)  # type: ignore[arg-type]
    responses: Literal["dataset", "regenerate"] = Field(
        "dataset",
        description="dataset: capture the responses the dataset holds. regenerate: the server first generates each "
        "row's assistant turns from its prompt (generation), stored under the run, then captures prompt + generated "
        "response (on-policy data for the drafter).",
    )
    generation: GenerationSpec = Field(default_factory=GenerationSpec)  # type: ignore[arg-type]
    concurrency: int = Field(32, ge=1, le=1024, description="Requests in flight at the server.")
    serverUrl: str = Field("http://127.0.0.1:30000", description="Base URL of the extraction server.")
    serverStartTimeoutSeconds: float = Field(
        600.0,
        gt=0,
        description="How long to wait for the server's /health before failing (weights loading); the log and "
        "/progress lastError say what is awaited and the last connection error meanwhile.",
    )
    engine: Literal["sglang", "vllm"] = Field(
        "sglang",
        description="The extraction server's engine: its request API (SGLang /generate, vLLM /v1/completions).",
    )
    dumpDir: str = Field(
        "/dev/shm/hsx", description="Directory the server writes dumps into (shared memory)."
    )
    dumpDirMaxBytes: int = Field(
        8 << 30,
        ge=1 << 20,
        description="Back-pressure: fewer requests are sent while this run's dumps waiting in "
        "dumpDir (and those its requests in flight will write) exceed this many bytes. Other runs' "
        "files are not counted; a wait over 30 s is reported in the progress lastError.",
    )
    modelPath: str | None = Field(
        None, description="Model directory (tokenizer and config are read from it)."
    )
    auxLayerIds: list[int] | None = Field(
        None,
        description="The server's --return-aux-hidden-state-layer-ids (None: EAGLE-3's default). SGLang's "
        "/get_model_info does not report the capture layers, so the extractor derives them from these.",
    )
    finalState: Literal["post-norm", "pre-norm"] | None = Field(
        None,
        description="The final layer's state the server dumps: after the model's final norm (post-norm) or its "
        "input (pre-norm, what speculators trains on). None: the engine's own (SGLang post-norm, vLLM pre-norm); "
        "SGLang dumps pre-norm when started with it (launch.server_env), vLLM only pre-norm.",
    )
    replicaIndex: int = Field(0, ge=0, description="This pod's index among parallel replicas (past replicaCount in a scaled-up run).")
    replicaCount: int = Field(
        1, ge=1, description="Number of parallel replicas the run was started with (shards are leased, "
        "not assigned: any replica works on any shard; the manifest records this count)."
    )
    workers: int = Field(
        1, ge=1, le=32, description="Extractor processes (each its own interpreter, leasing shards on its own) "
        "that `hsx extract` runs and supervises; their progress is served as one.",
    )
    workerIndex: int | None = Field(
        None, ge=0, lt=32, description="Set by the supervisor for each of its workers; not for users.",
    )
    leaseSeconds: float = Field(
        60.0, gt=0, le=3600, description="A shard lease not renewed for this long (as each replica observes "
        "it, on its own clock) is taken over by another replica (run/leases.py); renewed every quarter of it.",
    )
    progressPort: int = Field(8080, ge=0, le=65535, description="Port of /progress and /metrics (0: off).")
    progressHost: str = Field("0.0.0.0", description="Address the progress server binds to.")
    logIntervalSeconds: float = Field(10.0, gt=0, description="Seconds between progress log lines.")
    terminationMessagePath: str | None = Field(
        None,
        description="File that receives the final progress as JSON when the run ends (Kubernetes' "
        "terminationMessagePath, /dev/termination-log); None: not written.",
    )

    @field_validator("runId")
    @classmethod
    def _run_id_not_reserved(cls, v: str) -> str:
        if v == "manifest":
            raise ValueError(f"runId {v!r} is reserved")
        return v

    @model_validator(mode="after")
    def _settings_combine(self) -> ExtractConfig:
        problem = final_state_problem(self.engine, self.finalState) or regenerate_problem(
            self.responses, self.dataset, self.engine, self.generation
        )
        if problem:
            raise ValueError(problem)
        return self


def with_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` with dotted-key overrides set (``{"output.uri": "s3://b/p"}``), in place."""
    for dotted, value in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise UsageError(f"cannot set {dotted}: {p} is a {type(node).__name__}, not a group of fields")
        node[leaf] = value
    return data


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ExtractConfig:
    """Read an ExtractConfig from YAML or JSON, then apply dotted-key overrides (``output.uri``)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    return ExtractConfig.model_validate(with_overrides(data, overrides or {}))

"""What a run's pod asks for when the spec does not say: the containers' requests, the extractor's
worker processes and its scratch space. Pure functions of the spec."""

from __future__ import annotations

from hsx_operator.api import ExtractionJobSpec

# What the extractor asks the scheduler (and Kueue's quota) for when the spec names neither a request
# nor a limit of that resource: the guide's sizing for ~1 GB/s of hidden states (1.6-2 cores per GB/s)
# and its encode buffers, tokenizer and in-flight dumps' metadata.
EXTRACTOR_DEFAULT_REQUESTS = {"cpu": "2", "memory": "4Gi"}


def server_default_requests(gpus: int) -> dict[str, str]:
    """What the server asks for when the spec names neither a request nor a limit of that resource: a
    core per GPU process plus the tokenizer, detokenizer and HTTP processes, 8 GiB of host memory per
    GPU (CUDA contexts, pinned staging, the weights' read-ahead), so the scheduler and Kueue count it."""
    return {"cpu": str(gpus + 2), "memory": f"{8 * gpus}Gi"}


CORES_PER_WORKER = 4


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity in cores: ``500m`` -> 0.5, ``4`` -> 4.0."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def extractor_workers(spec: ExtractionJobSpec) -> int:
    """Extractor processes in each pod: spec.extractor.workers, else one per CORES_PER_WORKER cores the
    extractor requests (or is limited to), at least one."""
    if spec.extractor.workers:
        return spec.extractor.workers
    r = spec.extractor.resources
    cpu = r.requests.get("cpu") or r.limits.get("cpu") or EXTRACTOR_DEFAULT_REQUESTS["cpu"]
    return max(1, int(cpu_cores(cpu) // CORES_PER_WORKER))


# Room on /scratch beside the open shards' spool files (tokenizer caches, the interpreter's temp files).
SCRATCH_SLACK_BYTES = 1 << 30


def scratch_size_limit(spec: ExtractionJobSpec) -> int:
    """Bytes the extractor's /scratch may hold: per worker at most output.maxOpenShards spool files, each
    about a shard (the engine waits for a seal before opening more), plus slack; past it the kubelet
    evicts this pod for its own overuse, not a neighbour's."""
    shards = extractor_workers(spec) * spec.output.maxOpenShards
    return shards * spec.output.shardTargetBytes + SCRATCH_SLACK_BYTES

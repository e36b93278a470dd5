"""Deterministic activation-like samples for storage tests (no model needed)."""

from __future__ import annotations

import numpy as np

from hsx_extractor.storage.shard_format import SampleRecord


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as uint16."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def activations(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    """Per-channel scales, a few outlier channels, per-token scale: like a residual stream."""
    channel = rng.lognormal(0.0, 0.6, cols).astype(np.float32)
    channel[rng.choice(cols, size=max(1, cols // 128), replace=False)] *= 40.0
    token = rng.lognormal(0.0, 0.3, (rows, 1)).astype(np.float32)
    return bf16_bits(rng.standard_normal((rows, cols), dtype=np.float32) * channel * token)


def record(index: int, seq_len: int, hidden: int = 64, num_aux: int = 3, seed: int = 0) -> SampleRecord:
    """The same sample for the same arguments, in every process."""
    rng = np.random.default_rng([seed, index])
    aux = activations(rng, seq_len, num_aux * hidden)
    return SampleRecord(
        index=index,
        sample_id=f"row-{index}",
        input_ids=rng.integers(0, 32000, seq_len, dtype=np.int32),
        loss_mask=(rng.random(seq_len) < 0.6).astype(np.uint8),
        aux_hidden_states=aux,
        hidden_states=activations(rng, seq_len, hidden),
    )


def assert_same(a: SampleRecord, b: SampleRecord) -> None:
    assert (a.index, a.sample_id) == (b.index, b.sample_id)
    for name, array in a.tensors().items():
        other = b.tensors()[name]
        assert other.dtype == array.dtype and other.shape == array.shape, name
        assert other.tobytes() == array.tobytes(), name


def plan_for(num_samples: int, per_shard: int) -> dict[str, list[dict[str, int]]]:
    """A plan.json body: consecutive index ranges of ``per_shard`` samples."""
    starts = range(0, num_samples, per_shard)
    return {
        "shards": [
            {"index": k, "start": s, "stop": min(s + per_shard, num_samples)} for k, s in enumerate(starts)
        ]
    }


# What the reference server's runs record (layers [2, 4, 5] of the tiny model): readers need it.
CAPTURE = {
    "engine": "hsx-reference",
    "engineVersion": "0.1.0",
    "layerIds": [2, 4, 5],
    "layerConvention": "layer-input",
    "finalState": "post-norm",
    "dtype": "bfloat16",
}


def finalize_run(store, run_info: dict):  # type: ignore[no-untyped-def]
    """``store.finalize`` with the shards of the run's stored plan.json, as the run does; ``run_info``
    is the manifest's ``run`` section, the capture section is :data:`CAPTURE`."""
    from hsx_extractor.run.plan import PLAN_NAME, planned_shards

    return store.finalize(planned_shards(store.get_json(PLAN_NAME)), {"run": run_info, "capture": CAPTURE})


def seq_len_of(index: int) -> int:
    return 5 + (index * 37) % 60


def write_run(store, plan, hidden: int = 64, quarantine: frozenset[int] = frozenset(), seed: int = 0):  # type: ignore[no-untyped-def]
    """Write every uncommitted shard of ``plan`` the way the pipeline does; returns the commits."""
    from hsx_extractor.storage.commit_record import QuarantineEntry

    store.put_json_if_absent("plan.json", plan)
    done = store.committed_shards()
    commits = []
    for shard in plan["shards"]:
        if shard["index"] in done:
            continue
        builder = store.open_shard(shard["index"], range(shard["start"], shard["stop"]))
        for i in reversed(range(shard["start"], shard["stop"])):  # out of order on purpose
            if i in quarantine:
                builder.quarantine(QuarantineEntry(i, f"row-{i}", "too_long", "longer than maxLength"))
            else:
                builder.add(record(i, seq_len_of(i), hidden, seed=seed))
        commits.append(builder.seal())
    return commits

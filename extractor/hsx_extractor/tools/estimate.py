"""How much a run will write, before it starts: ``hsx estimate``.

Per token a run stores the captured aux layers plus the final hidden state, each ``hidden_size``
bf16 values, plus the int32 token id and a uint8 loss-mask entry. Hidden states dominate::

    bytes ~= tokens x (aux layers + 1) x hidden_size x 2 / compression ratio

The rest (shard headers, commit records, plan) is computed by laying the shards out with the shard format's
own functions (run/plan.py, storage/shard_format.py): exact up to the digits of the numbers in it. The
lossless ratio depends on the activations: the estimate states the one it assumes, and a trial run with
``dataset.limit`` measures the real one; fp8-e4m3's size is exact. A ratio is applied to the bytes it was
measured on: the default (``DEFAULT_RATIOS``) divides the hidden-state bytes; a trial's manifest ratio
(``compression.ratio``, also in ``hsx verify``) is raw tensor bytes over the stored shard objects, so it
divides the raw tensor bytes and stands for the whole shards (commit records, plan, manifest added after).
``--trial RUN`` reads the trial's shard headers instead and measures the hidden states' own ratio.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hsx_extractor.run.plan import build_plan
from hsx_extractor.storage import fp8
from hsx_extractor.storage.commit_record import QuarantineEntry, ShardCommit
from hsx_extractor.storage.compress import CODEC_FP8, CODEC_RAW
from hsx_extractor.storage.shard_format import (
    ALIGN,
    AUX,
    COMPRESSION_CODECS,
    FINAL,
    INPUT_IDS,
    LOSS_MASK,
    SampleEntry,
    TensorEntry,
    layout_shard,
)

BF16_BYTES = 2
TOKEN_ID_BYTES = 4
LOSS_MASK_BYTES = 1
# Measured ratio of bf16-zstd (high-byte plane through zstd-1, low byte raw) on activation-like
# bf16 data with per-channel scales and outlier channels: 1.43-1.47x (shared/research.md).
# The low byte is stored raw, so no data beats 2x.
DEFAULT_RATIOS: dict[str, float] = {"none": 1.0, "bf16-zstd": 1.45, "fp8-e4m3": 2.0}
# What the run writes besides shards and commit records (plan.json's settings, manifest.json's
# totals): a few hundred bytes, plus per-shard lines in the manifest.
PER_RUN_BYTES = 2048
PER_SHARD_MANIFEST_BYTES = 256
# A quarantine entry's reason and detail text, which the dataset alone cannot predict exactly.
PER_QUARANTINED_BYTES = 160
# Shard headers are laid out for this many samples; beyond, their size is scaled.
_SIMULATE_SAMPLES = 20_000
# What a ratio was measured on: hidden states alone (defaults, benchmark) or whole shards (a trial).
RatioBasis = Literal["hidden", "shards"]


class EstimateError(ValueError):
    """The inputs cannot give an estimate (missing model dimensions, bad numbers)."""


@dataclass(frozen=True)
class Rows:
    """The dataset as the run's pre-pass sees it: per row its token count and id (None: rejected)."""

    lengths: tuple[int | None, ...]
    ids: tuple[str | None, ...]

    @classmethod
    def uniform(cls, samples: int, tokens: int) -> Rows:
        """``samples`` rows sharing ``tokens`` as evenly as possible (when only totals are known)."""
        if samples < 1 or tokens < samples:
            raise EstimateError(f"need 1 <= samples <= tokens, got {samples} samples, {tokens} tokens")
        base, extra = divmod(tokens, samples)
        lengths = tuple(base + (1 if i < extra else 0) for i in range(samples))
        return cls(lengths, tuple(f"#{i}" for i in range(samples)))


@dataclass(frozen=True)
class StorageEstimate:
    """Bytes a run writes, split by what they hold."""

    samples: int  # samples that will be written
    tokens: int  # their tokens
    quarantined: int  # rows known to be quarantined before reaching the server
    hidden_size: int
    num_aux_layers: int
    shards: int
    hidden_bytes: int  # aux layers + final state, raw bf16
    token_bytes: int  # ids, loss masks and per-sample padding
    index_bytes: int  # shard headers, commit records, plan, manifest
    compression: str
    assumed_ratio: float  # raw / stored under `compression`, of the bytes `ratio_basis` names
    header_bytes: int = 0  # of index_bytes, the shard headers (inside the shard objects)
    ratio_basis: RatioBasis = "hidden"

    @property
    def tensor_bytes(self) -> int:
        """Raw bytes of every stored tensor (hidden states, ids, loss masks): a manifest's bytesRaw."""
        return self.hidden_bytes + self.tokens * (TOKEN_ID_BYTES + LOSS_MASK_BYTES)

    @property
    def raw_bytes(self) -> int:
        """What the run writes with compression none."""
        return self.hidden_bytes + self.token_bytes + self.index_bytes

    @property
    def stored_bytes(self) -> int:
        """What the run writes under ``compression``, the ratio applied to the bytes it was measured on:
        the hidden states (basis ``hidden``), or the raw tensor bytes, giving the shard objects whole
        (basis ``shards``: what a trial's manifest reports, headers and padding in its stored bytes)."""
        if self.ratio_basis == "shards":
            outside = self.index_bytes - self.header_bytes  # commit records, plan, manifest
            return math.ceil(self.tensor_bytes / self.assumed_ratio) + outside
        return math.ceil(self.hidden_bytes / self.assumed_ratio) + self.token_bytes + self.index_bytes


def _check_ratio(compression: str, ratio: float | None) -> float:
    if compression not in COMPRESSION_CODECS:
        raise EstimateError(f"unknown compression {compression!r}; known: {', '.join(COMPRESSION_CODECS)}")
    assumed = DEFAULT_RATIOS[compression] if ratio is None else float(ratio)
    if compression == "none" and assumed != 1.0:
        raise EstimateError("compression none stores raw bf16: its ratio is 1")
    if not 1.0 <= assumed <= 2.0:  # bf16-zstd stores the low byte raw; fp8 halves bf16 at best
        raise EstimateError(f"a {compression} ratio must lie in [1, 2], got {assumed}")
    return assumed


def _sample_entry(
    index: int, sample_id: str, length: int, num_aux: int, hidden: int, codec: str, ratio: float
) -> SampleEntry:
    # The index row the shard writer makes for this sample; compressed lengths are guessed from the ratio.
    def stored(values: int) -> int:
        if codec == CODEC_FP8:
            return fp8.encoded_length(values, length)
        return 2 * values if codec == CODEC_RAW else math.ceil(2 * values / ratio)

    names = [
        (INPUT_IDS, "I32", (length,), CODEC_RAW, 4 * length),
        (LOSS_MASK, "U8", (length,), CODEC_RAW, length),
        (AUX, "BF16", (length, num_aux * hidden), codec, stored(length * num_aux * hidden)),
        (FINAL, "BF16", (length, hidden), codec, stored(length * hidden)),
    ]
    tensors, offset = [], 0
    for name, dtype, shape, used, nbytes in names:
        tensors.append(TensorEntry(name, dtype, shape, used, offset, nbytes))
        offset += nbytes
    padded = offset + (-offset % ALIGN)
    return SampleEntry(index, sample_id, 0, padded, length, "0" * 16, tuple(tensors))


def _shard_index_bytes(
    shard: int, entries: Sequence[SampleEntry], quarantined: Sequence[int]
) -> tuple[int, int]:
    """Header bytes, and the bytes of its commit record and manifest lines, of one shard, built with
    the format's own code."""
    header, placed = layout_shard(shard, entries)
    commit = ShardCommit(
        shard_index=shard,
        samples=len(placed),
        quarantined=len(quarantined),
        bytes_stored=len(header) + sum(e.length for e in placed),
        bytes_raw=sum(e.raw_bytes for e in placed),
        key=f"shards/shard-{shard:06d}.safetensors",
        checksum="0" * 16,
        sample_indices=tuple(e.index for e in placed),
        quarantine=tuple(QuarantineEntry(i, None, "", "") for i in quarantined),
    )
    record = json.dumps(commit.to_json(), separators=(",", ":"))
    return len(header), len(record) + len(quarantined) * PER_QUARANTINED_BYTES + PER_SHARD_MANIFEST_BYTES


def estimate_storage(
    rows: Rows,
    hidden_size: int,
    num_aux_layers: int,
    compression: str,
    shard_target_bytes: int,
    ratio: float | None = None,
    ratio_basis: RatioBasis = "hidden",
) -> StorageEstimate:
    """The storage a run over ``rows`` writes. Pure.

    ``ratio`` (default: ``DEFAULT_RATIOS``, measured on hidden states) was measured on the bytes
    ``ratio_basis`` names: ``hidden`` states alone, or whole ``shards`` (a trial's manifest ratio)."""
    if hidden_size < 1 or num_aux_layers < 1:
        raise EstimateError("hidden_size and the number of aux layers must be >= 1")
    assumed = _check_ratio(compression, ratio)
    codec = COMPRESSION_CODECS[compression]
    plan = build_plan({}, rows.lengths, rows.ids, num_aux_layers, hidden_size, shard_target_bytes)
    written = [
        i
        for i, (n, sid) in enumerate(zip(rows.lengths, rows.ids, strict=True))
        if n is not None and sid is not None and i not in plan.duplicates
    ]
    written_set = set(written)
    tokens = sum(rows.lengths[i] or 0 for i in written)
    hidden = tokens * (num_aux_layers + 1) * hidden_size * BF16_BYTES
    if codec == CODEC_FP8 and ratio is None and tokens:
        # Exact: a byte per value and a float32 scale per token in each of the two hidden-state tensors.
        assumed = hidden / (hidden // BF16_BYTES + 2 * fp8.SCALE_BYTES * tokens)
    # Lay shards out one by one; past _SIMULATE_SAMPLES samples the rest is scaled (it is < 0.1% of the data).
    headers = records = padding = simulated = 0
    for k, (start, end) in enumerate(plan.shards):
        if simulated >= _SIMULATE_SAMPLES:
            break
        members = [i for i in range(start, end) if i in written_set]
        rejected = [i for i in range(start, end) if i not in written_set]
        entries = [
            _sample_entry(
                i, rows.ids[i] or "", rows.lengths[i] or 0, num_aux_layers, hidden_size, codec, assumed
            )
            for i in members
        ]
        header, record = _shard_index_bytes(k, entries, rejected)
        headers += header
        records += record
        padding += sum(e.length - sum(t.length for t in e.tensors) for e in entries)
        simulated += max(1, len(members))
    if simulated and simulated < len(written):
        headers = headers * len(written) // simulated
        records = records * len(written) // simulated
        padding = padding * len(written) // simulated
    index = PER_RUN_BYTES + len(json.dumps(plan.to_json(), separators=(",", ":"))) + headers + records
    return StorageEstimate(
        samples=len(written),
        tokens=tokens,
        quarantined=len(rows.lengths) - len(written),
        hidden_size=hidden_size,
        num_aux_layers=num_aux_layers,
        shards=len(plan.shards),
        hidden_bytes=hidden,
        token_bytes=tokens * (TOKEN_ID_BYTES + LOSS_MASK_BYTES) + padding,
        index_bytes=index,
        compression=compression,
        assumed_ratio=assumed,
        header_bytes=headers,
        ratio_basis=ratio_basis if compression != "none" else "hidden",
    )


def human_bytes(n: float, digits: int = 2) -> str:
    """1536 -> '1.50 KiB' (``digits`` after the point; whole bytes below 1 KiB)."""
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
    step = 0
    while abs(n) >= 1024 and step < len(units) - 1:
        n /= 1024
        step += 1
    return f"{n:.0f} B" if step == 0 else f"{n:.{digits}f} {units[step]}"


def format_estimate(est: StorageEstimate) -> str:
    """The lines ``hsx estimate`` prints."""
    per_token = (est.num_aux_layers + 1) * est.hidden_size * BF16_BYTES
    quarantined = f" (+{est.quarantined:,} rows that will be quarantined)" if est.quarantined else ""
    lines = [
        f"samples   {est.samples:,}{quarantined}",
        f"tokens    {est.tokens:,}",
        f"per token ({est.num_aux_layers} aux + 1 final) x {est.hidden_size} x 2 B = {per_token:,} B "
        "(+5 B id and loss mask)",
        f"shards    {est.shards:,}",
        f"raw       {human_bytes(est.raw_bytes)} ({est.raw_bytes:,} B: hidden states {est.hidden_bytes:,}, "
        f"ids+mask {est.token_bytes:,}, index {est.index_bytes:,})",
    ]
    if est.compression == "none":
        lines.append(f"stored    {human_bytes(est.stored_bytes)} (compression none: stored = raw)")
    elif est.ratio_basis == "shards":
        lines.append(
            f"stored    {human_bytes(est.stored_bytes)} ({est.stored_bytes:,} B with {est.compression}: "
            f"{est.tensor_bytes:,} B of tensors / {est.assumed_ratio:.4g}x, the trial's ratio of raw tensor "
            f"bytes to stored shards, + {est.index_bytes - est.header_bytes:,} B commit records, plan, manifest)"
        )
    else:
        lines.append(
            f"stored    {human_bytes(est.stored_bytes)} ({est.stored_bytes:,} B with {est.compression}, "
            f"assuming {est.assumed_ratio:.2f}x on hidden states; measure yours with a trial run and pass "
            "its manifest's compression.ratio (hsx verify prints it) as --compression-ratio)"
        )
    return "\n".join(lines)


def estimate_to_json(est: StorageEstimate) -> dict[str, Any]:
    """The estimate as JSON (``hsx estimate --json``)."""
    return {
        "samples": est.samples,
        "tokens": est.tokens,
        "quarantined": est.quarantined,
        "hiddenSize": est.hidden_size,
        "auxLayers": est.num_aux_layers,
        "shards": est.shards,
        "hiddenBytes": est.hidden_bytes,
        "tokenBytes": est.token_bytes,
        "indexBytes": est.index_bytes,
        "headerBytes": est.header_bytes,
        "rawBytes": est.raw_bytes,
        "compression": est.compression,
        "assumedRatio": est.assumed_ratio,
        "ratioMeasuredOn": est.ratio_basis,
        "tensorBytes": est.tensor_bytes,
        "storedBytes": est.stored_bytes,
    }


# ------------------------------------------------------------------------------ I/O at the edges


def rows_from_samples(samples: Iterable[Any]) -> Rows:
    """Rows from dataset.read_samples output (Prepared or Rejected, in order)."""
    from hsx_extractor.run.dataset import Prepared

    lengths: list[int | None] = []
    ids: list[str | None] = []
    for s in samples:
        ok = isinstance(s, Prepared)
        lengths.append(s.length if ok else None)
        ids.append(s.sample_id if ok else None)
    return Rows(tuple(lengths), tuple(ids))


def trial_ratio(run_uri: str) -> tuple[float, int]:
    """Raw / stored bytes of the hidden-state (BF16) tensors of a trial run's committed shards, read
    from their headers, and how many samples that is."""
    from hsx_extractor.config import OutputSpec
    from hsx_extractor.storage.layout import split_run_uri
    from hsx_extractor.storage.store import open_store

    output_uri, run_id = split_run_uri(run_uri.rstrip("/"))
    store = open_store(OutputSpec.model_validate({"uri": output_uri}), run_id, writing=False)
    raw = stored = samples = 0
    try:
        for k in sorted(store.committed_shards()):
            for sample in store.read_header(k).samples:
                samples += 1
                for t in sample.tensors:
                    if t.dtype == "BF16":
                        raw, stored = raw + t.raw_length, stored + t.length
    finally:
        store.close()
    if not stored:
        raise EstimateError(f"{run_uri}: no committed shard with hidden states to measure a ratio on")
    return raw / stored, samples


@dataclass(frozen=True)
class Decode:
    """What ``responses: regenerate`` generates before capturing (prefill of the prompts, then decode)."""

    rows: int
    turns: int
    prompt_tokens: int  # prefilled to generate (each turn's prompt)
    max_new_tokens: int  # decode at most: every turn running to generation.maxNewTokens (or maxLength)
    new_tokens: int  # decode expected: turns x --mean-new-tokens (the bound when not given)

    def to_json(self) -> dict[str, int]:
        return {"rows": self.rows, "turns": self.turns, "promptTokens": self.prompt_tokens,
                "maxNewTokens": self.max_new_tokens, "newTokens": self.new_tokens}  # fmt: skip

    def text(self) -> str:
        return (f"generate  {self.rows:,} rows, {self.turns:,} turns: prefill {self.prompt_tokens:,} prompt tokens, "
                f"decode {self.new_tokens:,} tokens (at most {self.max_new_tokens:,}); the samples above are "
                "prompt + that many generated tokens")  # fmt: skip


def count_dataset(
    uri: str,
    tokenizer_dir: Path,
    chat_template: Path | None,
    max_length: int,
    limit: int | None,
    fmt: str = "auto",
    expand: bool = False,
    special: str = "text",
    generation: Any = None,
    mean_new_tokens: int | None = None,
) -> tuple[Rows, Decode | None]:
    """Tokenize the dataset exactly as ``hsx extract`` does (same template, same rejections). With
    ``generation`` (config.GenerationSpec: responses regenerate) each row is its prompt plus the turns
    the target generates, ``mean_new_tokens`` each (default: maxNewTokens, the most a run can write)."""
    from hsx_extractor.run.dataset import read_samples
    from hsx_extractor.run.regenerate import END_OF_TURN_TOKENS, Prompt, prompt_preparer
    from hsx_extractor.run.row_bounds import row_bytes_limit
    from hsx_extractor.run.sources import iter_rows
    from hsx_extractor.run.tokens import ChatTokenizer

    template = chat_template.read_text() if chat_template else None
    tokenizer = ChatTokenizer(tokenizer_dir, template, special)  # type: ignore[arg-type]
    rows = iter_rows(uri, None, row_bytes_limit(max_length))
    if generation is None:  # streamed: only the counts are kept
        return rows_from_samples(read_samples(rows, tokenizer, max_length, fmt, limit, expand)), None  # type: ignore[arg-type]
    if expand:
        raise EstimateError("--responses regenerate does not combine with --expand-turns (a run refuses it too)")
    prepare = prompt_preparer(generation)
    samples = list(read_samples(rows, tokenizer, max_length, fmt, limit, False, None, prepare))  # type: ignore[arg-type]
    prompts = [s for s in samples if isinstance(s, Prompt)]
    mean = min(mean_new_tokens or generation.maxNewTokens, generation.maxNewTokens)
    turns = sum(len(p.targets) for p in prompts)
    # A sample as the run writes it: its prompt (or conversation) and `mean` tokens per generated turn.
    lengths = [min(s.context + len(s.targets) * (mean + END_OF_TURN_TOKENS), max_length)
               if isinstance(s, Prompt) else None for s in samples]  # fmt: skip
    ids = [s.sample_id if isinstance(s, Prompt) else None for s in samples]
    room = sum(min(len(p.targets) * generation.maxNewTokens, max_length - len(p.input_ids) - END_OF_TURN_TOKENS)
               for p in prompts)  # fmt: skip
    decode = Decode(len(prompts), turns, sum(len(p.input_ids) for p in prompts), room, min(turns * mean, room))
    return Rows(tuple(lengths), tuple(ids)), decode

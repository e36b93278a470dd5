"""What makes two writers' shards the same shard: the same samples (ids, token ids, loss masks, quarantined
rows and why), whatever their hidden states. On GPUs the states are not bit-deterministic, so a second
writer of a shard (a duplicate pod, a lease taken over) holds other bytes; it adopts the committed shard
when the samples agree, and only different samples are a conflict."""

from __future__ import annotations

from collections.abc import Callable

import xxhash

from hsx_extractor.storage.backends import ObjectSource
from hsx_extractor.storage.commit_record import ShardCommit
from hsx_extractor.storage.shard_format import INPUT_IDS, LOSS_MASK, ShardHeader, header_length, parse_header

ReadAt = Callable[[int, int], bytes | bytearray]


def token_digest(header: ShardHeader, read_at: ReadAt) -> str:
    """One xxh3-64 over every sample's index, id, and the stored bytes of its input_ids and loss_mask
    (raw, so equal tokens are equal bytes), read with ranged reads: hidden states are never read."""
    h = xxhash.xxh3_64()
    for sample in header.samples:
        h.update(f"{sample.index}\0{sample.sample_id}\0{sample.seq_len}\0".encode())
        for name in (INPUT_IDS, LOSS_MASK):
            tensor = sample.tensor(name)
            h.update(read_at(header.data_start + sample.offset + tensor.offset, tensor.length))
    return h.hexdigest()


def same_rows(ours: ShardCommit, theirs: ShardCommit) -> bool:
    """The records agree on everything but the stored states: range, stored samples, quarantined rows
    and their reasons, loss-masked token counts."""
    def rows(c: ShardCommit) -> tuple[object, ...]:
        quarantined = tuple((q.index, q.sample_id, q.reason) for q in c.quarantine)
        return c.shard_index, c.start, c.stop, c.sample_indices, quarantined, c.token_counts

    return rows(ours) == rows(theirs)


def source_header(source: ObjectSource) -> ShardHeader:
    """The header of a shard object not yet uploaded (a writer's spooled file)."""
    head = bytes(source.read_at(0, min(8, source.size)))
    return parse_header(bytes(source.read_at(0, min(header_length(head), source.size))))


def same_samples(
    ours: ShardCommit,
    source: ObjectSource,
    theirs: ShardCommit,
    their_header: Callable[[], ShardHeader],
    their_read: ReadAt,
) -> bool:
    """Whether the committed shard (``theirs``) holds our samples: equal rows in the records first (no
    read), then equal token ids and masks in the two objects."""
    if not same_rows(ours, theirs):
        return False
    return token_digest(source_header(source), source.read_at) == token_digest(their_header(), their_read)

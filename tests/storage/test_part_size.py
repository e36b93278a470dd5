"""How objects are cut into multipart parts."""

from __future__ import annotations

from hsx_extractor.storage.s3 import MIN_PART_BYTES, part_size_for
from hsx_extractor.storage.s3_client import S3TransferConfig

MiB = 1 << 20


def test_a_large_object_uses_the_configured_part_size() -> None:
    config = S3TransferConfig(part_size=64 * MiB, concurrency=16)
    assert part_size_for(4096 * MiB, config) == 64 * MiB


def test_a_smaller_object_is_cut_so_every_connection_gets_a_part() -> None:
    config = S3TransferConfig(part_size=64 * MiB, concurrency=16)
    size = 136 * MiB
    step = part_size_for(size, config)
    assert step < 64 * MiB and -(-size // step) == 16


def test_parts_never_go_under_the_s3_minimum() -> None:
    config = S3TransferConfig(part_size=64 * MiB, concurrency=16)
    assert part_size_for(20 * MiB, config) == MIN_PART_BYTES
    # At or under the minimum the object is one part: a single PUT.
    assert part_size_for(MIN_PART_BYTES, config) >= MIN_PART_BYTES

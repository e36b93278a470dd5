"""How objects are cut into multipart parts."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("size_mib", [5.5, 20, 65, 136, 741.3, 1000, 4096.7])
@pytest.mark.parametrize("part_mib", [5, 8, 64])
def test_the_parts_of_an_object_are_equal_but_for_a_few_bytes(size_mib: float, part_mib: int) -> None:
    """So one buffer per part thread fits every part of an upload (s3.part_body_buffer)."""
    config = S3TransferConfig(part_size=part_mib * MiB, concurrency=16)
    size = int(size_mib * MiB)
    step = part_size_for(size, config)
    lengths = [min(step, size - offset) for offset in range(0, size, step)]
    assert sum(lengths) == size and max(lengths) <= max(part_mib * MiB, MIN_PART_BYTES)
    assert all(n >= MIN_PART_BYTES for n in lengths[:-1])
    if len(lengths) > 1 and -(-size // len(lengths)) >= MIN_PART_BYTES:  # else equal parts are too small for S3
        assert step - lengths[-1] < len(lengths)

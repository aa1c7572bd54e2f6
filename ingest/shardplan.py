"""Where shards start: a function of the records' sizes, in sample order, and shard_size.

FORMAT.md's rule: a new shard starts when adding the next record would take the sum of
record sizes in the current shard over ``shard_size`` (a larger record gets a shard of its
own). Nothing else decides a boundary (not the workers, not which process wrote what),
so any build that knows the ordered sizes (the local one as it goes, the Ray one from its
first pass) cuts the same shards.
"""

from __future__ import annotations

from collections.abc import Iterable


def rolls_over(shard_bytes: int, shard_count: int, size: int, shard_size: int) -> bool:
    """Whether a record of ``size`` bytes starts a new shard after a shard holding
    ``shard_count`` records of ``shard_bytes`` bytes."""
    return shard_count > 0 and shard_bytes + size > shard_size


def shard_starts(sizes: Iterable[int], shard_size: int) -> list[int]:
    """The position (among the records, in order) at which each shard starts."""
    starts: list[int] = []
    nbytes = count = 0
    for i, size in enumerate(sizes):
        if count == 0 or rolls_over(nbytes, count, size, shard_size):
            starts.append(i)
            nbytes = count = 0
        nbytes += size
        count += 1
    return starts

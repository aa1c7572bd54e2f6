"""Where shards start: a function of the records' sizes, in sample order, and shard_size.

docs/FORMAT.md's rule: a new shard starts when adding the next record would take the sum of
record sizes in the current shard over ``shard_size`` (a larger record gets a shard of its
own). Nothing else decides a boundary (not the workers, not which process wrote what),
so any build that knows the ordered sizes (the local one as it goes, the Ray one from its
first pass) cuts the same shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def rolls_over(shard_bytes: int, shard_count: int, size: int, shard_size: int) -> bool:
    """Whether a record of ``size`` bytes starts a new shard after a shard holding
    ``shard_count`` records of ``shard_bytes`` bytes."""
    return shard_count > 0 and shard_bytes + size > shard_size


def shard_starts(sizes: Sequence[int] | np.ndarray, shard_size: int) -> list[int]:
    """The position (among the records, in order) at which each shard starts.

    The same cuts as applying ``rolls_over`` record by record, found a shard at a time:
    with prefix sums ``c``, the shard starting at ``i`` ends at the largest ``j`` with
    ``c[j] - c[i] <= shard_size`` (at least one record), by binary search. So a cut of
    400 M records costs the driver a cumulative sum and a search per shard, not a loop
    in Python over every record.
    """
    ends = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    n = len(ends) - 1
    starts: list[int] = []
    i = 0
    while i < n:
        starts.append(i)
        j = int(np.searchsorted(ends, ends[i] + shard_size, side="right")) - 1
        i = max(j, i + 1)
    return starts

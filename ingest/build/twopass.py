"""The two passes of a build, shared by its drivers (a local fork pool, a Ray cluster).

1. check: a task per contiguous range of samples verifies and normalises them and keeps a
   plan of the range in OUT/.partial (``tasks.check_range``);
2. write: a task per shard makes its records again and writes and seals the shard
   (``tasks.write_shard``).

Here: the ranges and their plan files, the shards cut from the plans (as the plans come,
in sample order), recording a sealed shard, and the end of the build from the plans.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np

from ingest import format as fmt
from ingest.build.process import known_records
from ingest.build.run import Run
from ingest.build.shardplan import shard_starts


def ranges(n: int, range_items: int | None = None) -> list[tuple[int, int]]:
    """Contiguous ranges of samples, a function of the sample count only (so that a rerun
    finds the plans of the first run, whatever the workers or the cluster)."""
    size = range_items or min(max(64, -(-n // 10_000)), 50_000)
    return [(a, min(a + size, n)) for a in range(0, n, size)]


def plan_path(run: Run, a: int, b: int) -> Path:
    # "plan2": plans with index rows; an older ingest looks for "plan-" files, and never
    # meets these (it would fail on them), nor this one its.
    return run.partial / f"plan2-{a:012d}-{b:012d}.msgpack"


def load_plan(path: Path, a: int, b: int) -> dict | None:
    """The plan a task kept for samples a..b-1, or None when there is none (or a broken one)."""
    try:
        plan = msgpack.unpackb(path.read_bytes(), raw=False)
    except (OSError, ValueError):
        return None
    ok = isinstance(plan, dict) and plan.get("first") == a and plan.get("end") == b
    if not ok or not plan.keys() >= _PLAN_KEYS:
        return None
    # Its columns, of the same records (a plan that decodes may still be cut short).
    n = len(plan["kept"]) // 8 if isinstance(plan["kept"], bytes) else -1
    sizes = [len(plan[key]) if isinstance(plan[key], bytes) else -1 for key in _COLUMNS]
    return plan if n >= 0 and sizes == [n * size for size in _COLUMNS.values()] else None


_PLAN_KEYS = {"first", "end", "kept", "rows", "stored", "rejects", "stats"}
_COLUMNS = {"kept": 8, "rows": fmt.INDEX_DTYPE.itemsize, "stored": 4}  # bytes per record


class ShardCuts:
    """The shards of a build, cut by docs/FORMAT.md's rule from the plans given in sample order.

    ``add`` takes the next plan and returns the shards it completed, as (k, a, b): shard
    ``k`` holds the stored records a..b-1 (numbered among the stored ones). A shard is
    complete once the first record after it is known, or at ``finish``. Each cut looks at
    the records of the open shard only, so cutting costs the same whatever the build's size.
    """

    def __init__(self, shard_size: int, num_items: int) -> None:
        self.shard_size = shard_size
        self.kept = np.zeros(num_items, "<u8")  # the stored records' samples
        self.rows = np.zeros(num_items, fmt.INDEX_DTYPE)  # and their index rows
        self.stored = np.zeros(num_items, "<u4")  # and stored image sizes (process.Known)
        self.count = 0  # records known
        self.shards = 0  # shards cut
        self.open = 0  # first record of the shard not cut yet

    def add(self, plan: dict) -> list[tuple[int, int, int]]:
        n = len(plan["kept"]) // 8
        end = self.count + n
        self.kept[self.count : end] = np.frombuffer(plan["kept"], "<u8")
        self.rows[self.count : end] = np.frombuffer(plan["rows"], fmt.INDEX_DTYPE)
        self.stored[self.count : end] = np.frombuffer(plan["stored"], "<u4")
        self.count = end
        starts = shard_starts(self.rows["nbytes"][self.open : self.count], self.shard_size)
        return self._cut([self.open + s for s in starts[1:]])

    def finish(self) -> list[tuple[int, int, int]]:
        """The last shard, once every plan was added."""
        return self._cut([self.count] if self.count > self.open else [])

    def _cut(self, ends: list[int]) -> list[tuple[int, int, int]]:
        done = []
        for end in ends:
            done.append((self.shards, self.open, end))
            self.shards, self.open = self.shards + 1, end
        return done

    def work(self, run: Run, src: Path, a: int, b: int) -> tuple[list, list]:
        """The (jobs, expect) of ``write_shard`` for the records a..b-1."""
        items = run.tree.items
        jobs = [(os.path.join(src, rel), rel, label) for rel, label in
                (items[pos] for pos in self.kept[a:b].tolist())]  # fmt: skip
        return jobs, known_records(self.rows[a:b], self.stored[a:b])


def record_sealed(run: Run, entry: dict) -> None:
    """Count a shard that a write task sealed into OUT (saved with the build state)."""
    run.state["shards"].append(entry)
    run.state["cursor"] += entry["count"]


def finish(run: Run, plans: list[dict]) -> dict:
    """The rejects and counts of the plans, the shards in order: then as every build ends
    (rejects, index, paths, the manifest last)."""
    run.state["rejects"] = [
        {"path": fmt.path_text(path), "reason": reason}
        for plan in plans
        for path, reason in plan["rejects"]
    ]
    run.state["stats"] = dict(sum((Counter(p["stats"]) for p in plans), Counter()))
    run.state["shards"].sort(key=lambda s: s["first"])
    run.stats = Counter(run.state["stats"])
    return run.finish()

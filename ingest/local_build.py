"""The passes of a local build on a pool of forked workers, the second overlapping the first.

The tasks are the Ray build's (ray_tasks.py): workers verify ranges of samples, then write
whole shards themselves, so that the records never pass through this process and the
shards are written on as many cores as there are shards ready. A shard is written as soon
as the plans before and after it cut it; write tasks go first to an idle worker, so that
the shards keep pace with the checks.
"""

from __future__ import annotations

import logging
from collections import deque
from pathlib import Path

from tqdm import tqdm

from ingest import format as fmt
from ingest import ray_tasks, twopass
from ingest.build import Run
from ingest.parallel import ForkPool, InlinePool, can_fork

log = logging.getLogger(__name__)


def convert(run: Run, src: Path, workers: int, progress: bool | None) -> dict:
    """Check every sample and write every shard not sealed yet; return the manifest."""
    items = run.tree.items
    spans = twopass.ranges(len(items))
    plans = {span: twopass.load_plan(twopass.plan_path(run, *span), *span) for span in spans}
    checks = deque(span for span, plan in plans.items() if plan is None)
    done = sum(b - a for (a, b), plan in plans.items() if plan is not None)
    bar = tqdm(total=len(items), initial=done, unit="img", desc="ingest", smoothing=0.05,
               disable=None if progress is None else not progress)  # fmt: skip
    with _pool(workers) as pool, bar:
        _run(run, src, pool, spans, plans, checks, bar)
    return twopass.finish(run, [plans[span] for span in spans])


def _pool(workers: int) -> InlinePool:
    if workers <= 1:
        return InlinePool()
    if not can_fork():
        log.warning("ingest: no fork() on this platform; converting in one process")
        return InlinePool()
    return ForkPool(workers)


def _run(run: Run, src: Path, pool, spans: list, plans: dict, checks: deque, bar) -> None:
    cuts = twopass.ShardCuts(run.options.shard_size, len(run.tree.items))
    sealed = {s["name"] for s in run.state["shards"]}
    writes: deque = deque()
    fed = 0  # plans given to ``cuts``, in sample order
    while True:
        while fed < len(spans) and plans[spans[fed]] is not None:
            fed += 1
            ready = cuts.add(plans[spans[fed - 1]]) + (cuts.finish() if fed == len(spans) else [])
            writes.extend(s for s in ready if fmt.shard_name(s[0]) not in sealed)
        while pool.idle and (writes or checks):
            if writes:
                k, a, b = writes.popleft()
                pool.submit(k, ray_tasks.write_shard, *_write_args(run, src, cuts, k, a, b))
            else:
                a, b = checks.popleft()
                plan = twopass.plan_path(run, a, b)
                items = run.tree.items[a:b]
                pool.submit((a, b), ray_tasks.check_range, src, items, a, run.options, plan, None)
        if not pool.busy:
            return
        for key, result in pool.wait():
            if isinstance(key, tuple):
                plans[key] = result
                bar.update(key[1] - key[0])
            else:  # a shard was sealed: record it now, so that a rerun keeps it
                twopass.record_sealed(run, result)
                fmt.write_json_atomic(run.out / fmt.BUILD_STATE, run.state)


def _write_args(run: Run, src: Path, cuts: twopass.ShardCuts, k: int, a: int, b: int) -> tuple:
    jobs, expect = cuts.work(run, src, a, b)
    return src, run.out, k, a, jobs, expect, run.options, run.map_size, run.build, None

"""``build``: a build on this machine, its two passes on a pool of forked workers, the
second overlapping the first.

The tasks are the Ray build's (tasks.py): workers verify ranges of samples, then write
whole shards themselves, so that the records never pass through this process and the
shards are written on as many cores as there are shards ready. A shard is written as soon
as the plans before and after it cut it; write tasks go first to an idle worker, so that
the shards keep pace with the checks. The shard still open (in a small store, the only
one) is written by one more worker as its ranges are checked (``tasks.stream_shard``), so
that no shard is left to write on one core after the last check.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from ingest import format as fmt
from ingest.build import resume, tasks, twopass
from ingest.build.failures import writing
from ingest.build.options import BuildOptions, default_map_size
from ingest.build.outdir import Claim
from ingest.build.run import Run, start
from ingest.build.scan import Scan
from ingest.cores import usable_cores
from ingest.parallel import ForkPool, InlinePool, can_fork, ordered

log = logging.getLogger(__name__)


def build(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: BuildOptions | None = None,
    *,
    workers: int | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    map_size: int | None = None,
) -> dict:
    """Convert the ImageFolder tree ``src`` into a store at ``out``; return its manifest.

    Resumes an interrupted build of the same inputs and options from its sealed shards.

    Args:
        options: what decides the store's content (same options, same records).
        workers: processes that verify images and write the shards (default: all cores;
            1: everything in this process).
        overwrite: replace a complete store at ``out``.
        progress: show a progress bar (default: when stderr is a terminal).
        map_size: initial LMDB map size of a shard (default: 1.25 x shard_size); grows as needed.
    """
    options = options or BuildOptions()
    claim = Claim(Path(src), Path(out), overwrite)
    with make_pool(workers or usable_cores(), stream=True) as pool:
        try:
            facts = functools.partial(facts_on_workers, pool)
            tree, state = start(src, claim, options, "local", facts)
            if state is None:  # an --overwrite cut short in its swap: that store is this one
                return fmt.read_manifest(claim.out)
            run = Run(tree, claim.target, options, state, map_size or default_map_size(options))
            with writing(claim.out):
                manifest = convert(run, Path(src), pool, progress)
                claim.commit()
            return manifest
        finally:
            claim.release()


def convert(run: Run, src: Path, pool: InlinePool, progress: bool | None) -> dict:
    """Check every sample and write every shard not sealed yet on the workers of ``pool``
    (``make_pool``); return the manifest."""
    items = run.tree.items
    spans = twopass.ranges(len(items))
    plans = {span: twopass.load_plan(twopass.plan_path(run, *span), *span) for span in spans}
    checks = deque(span for span, plan in plans.items() if plan is None)
    done = sum(b - a for (a, b), plan in plans.items() if plan is not None)
    bar = tqdm(total=len(items), initial=done, unit="img", desc="ingest", smoothing=0.05,
               disable=None if progress is None else not progress)  # fmt: skip
    with bar:
        _run(run, src, pool, spans, plans, checks, bar)
    return twopass.finish(run, [plans[span] for span in spans])


def make_pool(workers: int, stream: bool = False) -> InlinePool:
    """``workers`` forked workers (and, with ``stream``, one more for the open shard's
    writer, mostly waiting for checks); none (tasks run in this process) for one."""
    if workers <= 1:
        return InlinePool()
    if not can_fork():
        log.warning("ingest: no fork() on this platform; converting in one process")
        return InlinePool()
    pool = ForkPool(workers + stream)
    pool.streams = stream
    return pool


def facts_on_workers(pool: InlinePool, tree: Scan, chunk: int = 500) -> Iterator[bytes]:
    """``resume.file_facts`` of the items of ``tree``, made on the workers, in order: the
    build's fingerprint stats every file, which would be the longest part of the build
    that runs on one core."""
    root = str(tree.root)
    spans = twopass.ranges(len(tree.items), chunk)
    return ordered(pool, resume.file_facts, [(root, tree.items[a:b]) for a, b in spans])


def _run(run: Run, src: Path, pool, spans: list, plans: dict, checks: deque, bar) -> None:
    cuts = twopass.ShardCuts(run.options.shard_size, len(run.tree.items))
    sealed = {s["name"] for s in run.state["shards"]}
    writes: deque = deque()
    stream = _Stream(run, src, spans, getattr(pool, "streams", False))
    fed = 0  # plans given to ``cuts``, in sample order
    state = _State(run)
    try:
        while True:
            while fed < len(spans) and plans[spans[fed]] is not None:
                fed += 1
                ready = cuts.add(plans[spans[fed - 1]])
                ready += cuts.finish() if fed == len(spans) else []
                writes.extend(s for s in ready if fmt.shard_name(s[0]) not in sealed
                              and not stream.takes(s))  # fmt: skip
            stream.start(pool, cuts, fed, sealed)
            _submit(run, src, pool, cuts, writes, checks, stream.spare)
            if not pool.busy:
                return
            for key, result in pool.wait():
                if isinstance(key, tuple):
                    plans[key] = result
                    bar.update(key[1] - key[0])
                else:
                    stream.ended(key)
                    state.sealed(result)
    finally:
        state.save()


def _submit(run: Run, src: Path, pool, cuts, writes: deque, checks: deque, spare: int) -> None:
    """Give every idle worker but ``spare`` a task: a shard to write first, else a range
    to check."""
    while pool.idle > spare and (writes or checks):
        if writes:
            k, a, b = writes.popleft()
            pool.submit(k, tasks.write_shard, *_write_args(run, src, cuts, k, a, b))
        else:
            a, b = checks.popleft()
            plan = twopass.plan_path(run, a, b)
            items = run.tree.items[a:b]
            pool.submit((a, b), tasks.check_range, src, items, a, run.options, plan, None)


class _Stream:
    """The open shard's writer (``tasks.stream_shard``) on the pool's worker kept for it:
    one at a time, for the shards open within the last ``STREAM_ITEMS`` samples (its task
    carries their items)."""

    STREAM_ITEMS = 50_000

    def __init__(self, run: Run, src: Path, spans: list, on: bool) -> None:
        self.run, self.src, self.spans, self.on = run, src, spans, on
        self.k: int | None = None  # the shard being streamed
        self.done: set[int] = set()  # shards streamed (whether or not cut yet)

    @property
    def spare(self) -> int:
        """Idle workers to leave for the stream: its own, while no stream runs."""
        return int(self.on and self.k is None)

    def takes(self, shard: tuple[int, int, int]) -> bool:
        """Whether the shard cut is (or was) the stream's to write."""
        return shard[0] == self.k or shard[0] in self.done

    def start(self, pool, cuts: twopass.ShardCuts, fed: int, sealed: set) -> None:
        """Stream the open shard, where there is one to and the stream's worker is free."""
        if not self.on or self.k is not None or not pool.idle or fed == len(self.spans):
            return
        k, items = cuts.shards, self.run.tree.items
        if k in self.done or fmt.shard_name(k) in sealed:
            return
        left = len(items) - self.spans[fed][0]  # samples not yet known, at most
        if left > self.STREAM_ITEMS or self._many_shards_left(cuts, left):
            return
        jobs, expect = cuts.work(self.run, self.src, cuts.open, cuts.count)
        rest = [(twopass.plan_path(self.run, a, b), a, items[a:b]) for a, b in self.spans[fed:]]
        pool.submit(-1 - k, tasks.stream_shard, self.src, self.run.out, k, cuts.open,
                    jobs, expect, rest, self.run.options, self.run.map_size,
                    self.run.build, None)  # fmt: skip
        self.k = k

    def _many_shards_left(self, cuts: twopass.ShardCuts, left: int) -> bool:
        """Whether ``left`` samples of the sizes seen last would fill more than a few
        shards: those are cut and written in parallel anyway, and a stream for each would
        carry the items left again and again (small shards: a task per record or two)."""
        if cuts.count == 0:
            return False
        recent = cuts.rows["nbytes"][max(0, cuts.count - 4096) : cuts.count]
        return left * float(recent.mean()) > 4 * self.run.options.shard_size

    def ended(self, key: int) -> None:
        """A write task ended: key ``-1 - k`` is the stream's, of shard ``k``."""
        if key < 0:
            self.done.add(-1 - key)
            self.k = None


class _State:
    """The build state, saved at most once a second as shards seal (it grows with them),
    and once more at the end, also of a failed build: a build killed meanwhile writes
    again only the shards of its last second."""

    def __init__(self, run: Run) -> None:
        self.run, self.saved, self.dirty = run, float("-inf"), False

    def sealed(self, entry: dict) -> None:
        twopass.record_sealed(self.run, entry)
        self.dirty = True
        if time.monotonic() - self.saved >= 1.0:
            self.save()

    def save(self) -> None:
        if self.dirty:
            fmt.write_json_atomic(self.run.out / fmt.BUILD_STATE, self.run.state)
            self.saved, self.dirty = time.monotonic(), False


def _write_args(run: Run, src: Path, cuts: twopass.ShardCuts, k: int, a: int, b: int) -> tuple:
    jobs, expect = cuts.work(run, src, a, b)
    return src, run.out, k, a, jobs, expect, run.options, run.map_size, run.build, None

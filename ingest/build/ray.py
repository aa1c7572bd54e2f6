"""``build_ray``: the build on a Ray cluster, giving the very store a local build gives.

Where a shard starts depends on the sizes of all the records before it, known only once
each image is verified and normalised; so the build makes two passes of many tasks
(twopass.py, tasks.py). Check: a task per range of samples keeps a plan of it in
OUT/.partial (the records' index rows, rejects; no record). Write: the driver cuts the
shards from the plans, and a task per shard makes its records again, checks them against
the plan and seals the shard. Ranges that waited for the shard start before them would run
one at a time; records kept between the passes would cross the shared filesystem twice.
The driver writes the manifest last and records sealed shards as they come: a driver
killed mid-build resumes from the plans and shards already sealed.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lmdb
from tqdm import tqdm

from ingest import format as fmt
from ingest.build import twopass
from ingest.build.failures import writing
from ingest.build.options import BuildOptions, default_map_size
from ingest.build.outdir import Claim
from ingest.build.resume import OutputError
from ingest.build.run import Run, start
from ingest.build.scan import SourceError
from ingest.build.tasks import Fault, check_range, write_shard

INSTALL = "pip install 'imfeed[ray]'"
RETRIES = 5  # attempts after the first, for a task whose worker or node died


class ClusterError(RuntimeError):
    """The Ray build cannot go on (Ray missing, a task that kept dying)."""


def import_ray():
    """Ray, imported on first use: it is an optional dependency."""
    try:
        import ray
    except ImportError:
        raise ClusterError(f"--ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


def build_ray(
    src: str | os.PathLike,
    out: str | os.PathLike,
    options: BuildOptions | None = None,
    *,
    address: str | None = None,
    overwrite: bool = False,
    progress: bool | None = None,
    map_size: int | None = None,
    range_items: int | None = None,
    fault: Fault | None = None,
) -> dict:
    """Convert the ImageFolder tree ``src`` into a store at ``out`` with Ray tasks; return
    its manifest. Same inputs and options, same store as ``build``.

    ``out`` must be on a filesystem that every node of the cluster sees at the same path.

    Args:
        options: what decides the store's content.
        address: a Ray cluster to join (``HOST:PORT``); None: this process's Ray if it
            has one, else a new local Ray instance, shut down at the end.
        overwrite: replace a complete store at ``out``.
        progress: show progress bars (default: when stderr is a terminal).
        map_size: initial LMDB map size of a shard (default: 1.25 x shard_size).
        range_items: samples per task of the first pass (default: from the sample count).
        fault: for tests: called in the tasks before each sample (may kill the worker).
    """
    ray = import_ray()
    if address:
        _check_reachable(address)  # before OUT is touched or SRC scanned
    options = options or BuildOptions()
    out = Path(out).absolute()  # the tasks may run in another directory, on other nodes
    src = Path(src).absolute()
    claim = Claim(src, out, overwrite)
    started = False
    try:
        tree, state = start(src, claim, options, mode="ray")
        if state is None:  # an --overwrite cut short in its swap: that store is this one
            return fmt.read_manifest(out)
        run = Run(tree, claim.target, options, state, map_size or default_map_size(options))
        started = _connect(ray, address)
        with writing(out):
            plans = _check_all(ray, run, src, range_items, progress, fault)
            _write_all(ray, run, src, plans, progress, fault)
            manifest = twopass.finish(run, plans)
            claim.commit()
        return manifest
    finally:
        if started:
            ray.shutdown()  # its tasks stopped before another build may own OUT
        claim.release()


def _check_reachable(address: str) -> None:
    """Fail in one line, at once, when nothing listens at a HOST:PORT address (Ray itself
    would retry for minutes, logging from C++ on the terminal)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", ray://..., or what Ray itself will judge
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except OSError as e:
        raise ClusterError(
            f"no Ray cluster answers at {address} ({e.strerror or e}): start one there with "
            "`ray start --head --port 6379`, or check the address"
        ) from None


def _connect(ray, address: str | None) -> bool:
    """Join ``address``, or start a local instance; True when this call connected."""
    if ray.is_initialized():
        return False
    ray.init(
        address=address or "local", include_dashboard=False, log_to_driver=False,
        logging_level=logging.ERROR,
    )  # fmt: skip
    return True


# --- the first pass: check ---------------------------------------------------------------


def _check_all(ray, run: Run, src: Path, range_items, progress, fault) -> list[dict]:
    """Every range's plan, in sample order: those kept by an earlier run, the rest made."""
    items = run.tree.items
    ranges = twopass.ranges(len(items), range_items)
    plans = {(a, b): twopass.load_plan(twopass.plan_path(run, a, b), a, b) for a, b in ranges}
    task = ray.remote(max_retries=RETRIES)(check_range)

    def submit(a: int, b: int):
        return task.remote(src, items[a:b], a, run.options, twopass.plan_path(run, a, b), fault)

    todo = (((a, b), functools.partial(submit, a, b)) for (a, b), p in plans.items() if p is None)
    done = sum(b - a for (a, b), plan in plans.items() if plan is not None)
    with _bar(len(items), done, "ingest: check", progress) as bar:
        for batch in _as_completed(ray, todo):
            for key, plan in batch:
                plans[key] = plan
                bar.update(key[1] - key[0])
    return [plans[r] for r in ranges]


# --- the second pass: write --------------------------------------------------------------


def _write_all(ray, run: Run, src: Path, plans: list[dict], progress, fault) -> None:
    """Write every shard not sealed yet, recording each in the build state as it seals."""
    cuts = twopass.ShardCuts(run.options.shard_size, len(run.tree.items))
    shards = [s for plan in plans for s in cuts.add(plan)] + cuts.finish()
    sealed = {s["name"] for s in run.state["shards"]}
    task = ray.remote(max_retries=RETRIES)(write_shard)

    def submit(k: int, a: int, b: int):
        jobs, expect = cuts.work(run, src, a, b)
        opts = (run.options, run.map_size, run.build, fault)
        return task.remote(src, run.out, k, a, jobs, expect, *opts)

    todo = (
        (b - a, functools.partial(submit, k, a, b))
        for k, a, b in shards
        if fmt.shard_name(k) not in sealed
    )
    done = sum(s["count"] for s in run.state["shards"])
    saved = float("-inf")
    with _bar(cuts.count, done, "ingest: write", progress) as bar:
        for batch in _as_completed(ray, todo):
            for count, entry in batch:
                _check_sealed(run.out / entry["name"])
                twopass.record_sealed(run, entry)
                bar.update(count)
            # At most every 2 s (the state grows with the shards): a driver killed now
            # redoes only the shards sealed since.
            if time.monotonic() - saved >= 2.0:
                fmt.write_json_atomic(run.out / fmt.BUILD_STATE, run.state)
                saved = time.monotonic()
    fmt.write_json_atomic(run.out / fmt.BUILD_STATE, run.state)


def _check_sealed(shard: Path) -> None:
    if not (shard / "data.mdb").is_file():
        raise OutputError(
            f"{shard} was written by a Ray task but is not there for this process: put OUT "
            "on storage every node of the Ray cluster sees at the same path"
        )


# --- the driver's loop --------------------------------------------------------------------


def _as_completed(ray, todo: Iterator[tuple[Any, Callable]]) -> Iterator[list[tuple]]:
    """Submit the tasks of ``todo`` (key, submit) with a few per CPU of the cluster in
    flight (their arguments, the sample paths, stay out of memory until then); yield
    [(key, result)] as tasks end. A task's error is raised here as the error the task
    raised (a full disk, a changed file...)."""
    limit = 4 * max(1, int(ray.cluster_resources().get("CPU", 1)))
    keys: dict = {}
    try:
        while True:
            for key, submit in itertools.islice(todo, limit - len(keys)):
                keys[submit()] = key
            if not keys:
                return
            ready, _ = ray.wait(list(keys), num_returns=len(keys), timeout=0.2)
            if ready:
                yield [(keys.pop(ref), _get(ray, ref)) for ref in ready]
    except KeyboardInterrupt:
        raise  # this process ends, and Ray ends its tasks with it
    except BaseException:
        # The build failed but this process may go on (the Python API): let the tasks
        # in flight end first, so that none of them writes into OUT after build_ray
        # raised. (Not ray.cancel: racing a task's end, it can abort this process.)
        with contextlib.suppress(Exception):
            ray.wait(list(keys), num_returns=len(keys))
        raise


def _get(ray, ref):
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, (SourceError, OutputError, fmt.StoreError, OSError, lmdb.Error)):
            raise cause from None
        raise
    except ray.exceptions.RayError as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterError(
            f"a Ray task failed {RETRIES + 1} times ({first_line}); run the same command "
            "again: it resumes from the shards already sealed"
        ) from e


def _bar(total: int, initial: int, desc: str, progress: bool | None) -> tqdm:
    disable = None if progress is None else not progress
    return tqdm(total=total, initial=initial, unit="img", desc=desc, disable=disable,
                smoothing=0.05, mininterval=0.5)  # fmt: skip

"""The two tasks of a build, run on a local build's workers and a Ray cluster's alike.

Plain functions: ray.py wraps them with ``ray.remote`` (so this module never imports
Ray). Each writes only under OUT/.partial and its own shard, through names of its own
process, so a retried attempt and the attempt it replaces never write the same file.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from ingest import format as fmt
from ingest.build.options import BuildOptions
from ingest.build.process import Known, format_mix, known_records, process_file, stored_again
from ingest.build.resume import OutputError
from ingest.build.run import seal_shard
from ingest.build.scan import SourceError
from ingest.build.shardplan import rolls_over
from ingest.build.twopass import load_plan
from ingest.build.writer import ShardWriter

Fault = Callable[[str, int, int], None]  # tests: (pass, range or shard, item) in a task


def check_range(src: Path, items: list, first: int, options: BuildOptions, plan: Path,
                fault: Fault | None) -> dict:  # fmt: skip
    """A Ray task: verify and normalise the samples ``first, first+1, ...`` (``items``)
    and keep what the second pass needs in the file ``plan`` (the kept samples' index
    rows and stored image sizes, the rejects); return it."""
    _check_visible(src, plan.parent)
    kept, rows, stored, rejects, stats = [], [], [], [], Counter()
    for i, (rel, label) in enumerate(items):
        if fault:
            fault("check", first, i)
        header, _ = process_file((os.path.join(src, rel), rel, label), options)
        if header[0] == "reject":
            rejects.append(header[1:])  # the path as stored: bytes when it is not UTF-8
            continue
        _, row, fixes, size = header
        kept.append(first + i)
        rows.append((row[0], 0, *row[1:]))
        stored.append(size)
        stats.update("fix " + fix.split(":")[0] for fix in fixes)
    table = np.array(rows, dtype=fmt.INDEX_DTYPE)
    stats.update(format_mix(table))
    result = {
        "first": first, "end": first + len(items), "kept": np.array(kept, "<u8").tobytes(),
        "rows": table.tobytes(), "stored": np.array(stored, "<u4").tobytes(),
        "rejects": rejects, "stats": dict(stats),
    }  # fmt: skip
    tmp = plan.with_name(f"{plan.name}.{os.getpid()}.tmp")  # a retry may write it too
    tmp.write_bytes(msgpack.packb(result, use_bin_type=True))
    os.replace(tmp, plan)
    return result


def write_shard(src: Path, out: Path, k: int, first: int, jobs: list, expect: list,
                options: BuildOptions, map_size: int, build: str,
                fault: Fault | None) -> dict:  # fmt: skip
    """A Ray task: make the records of shard ``k`` (samples ``first, first+1, ...``) again,
    check them against the plan, write and seal the shard; return its manifest entry."""
    shard = _Shard(src, out, k, first, options, map_size, build, fault)
    shard.put(jobs, expect)
    return shard.seal()


def stream_shard(src: Path, out: Path, k: int, first: int, jobs: list, expect: list,
                 spans: list, options: BuildOptions, map_size: int, build: str,
                 fault: Fault | None) -> dict:  # fmt: skip
    """A local build's task: write shard ``k`` while the ranges after it are still being
    checked, so that the last shards are not written on one core after every check.

    ``jobs``/``expect``: the shard's records known so far; ``spans``: the ranges after
    them in order, each (plan file, its first sample, the items from there). Each range's
    records are written as its plan appears, up to the first that docs/FORMAT.md's rule
    (``rolls_over``) puts in the next shard, or to the last range: the same records in the
    same order as ``write_shard``, so the same bytes."""
    shard = _Shard(src, out, k, first, options, map_size, build, fault)
    shard.put(jobs, expect)
    held = sum(want.nbytes for want in expect)  # bytes in the shard so far
    for path, a, items in spans:
        plan = _wait_for_plan(path, a, a + len(items))
        rows = np.frombuffer(plan["rows"], fmt.INDEX_DTYPE)
        take = 0
        for size in rows["nbytes"].tolist():
            if rolls_over(held, len(shard.rows) + take, size, options.shard_size):
                break
            held, take = held + size, take + 1
        kept = np.frombuffer(plan["kept"], "<u8")[:take].tolist()
        stored = np.frombuffer(plan["stored"], "<u4")[:take]
        shard.put(
            [(os.path.join(src, items[pos - a][0]), *items[pos - a]) for pos in kept],
            known_records(rows[:take], stored),
        )
        if take < len(rows):  # cut inside this range: the rest is the next shard's
            break
    return shard.seal()


def _wait_for_plan(path: Path, a: int, b: int) -> dict:
    """The plan of samples a..b-1, once a check task has written it (the driver stops
    this task with the build, should that never happen)."""
    while (plan := load_plan(path, a, b)) is None:
        time.sleep(0.002)
    return plan


class _Shard:
    """A shard being written by a task: its records made again and checked, then sealed."""

    def __init__(self, src: Path, out: Path, k: int, first: int, options: BuildOptions,
                 map_size: int, build: str, fault: Fault | None) -> None:  # fmt: skip
        name = fmt.shard_name(k)
        self.partial = out / fmt.PARTIAL_DIR
        _check_visible(src, self.partial)
        tmp = self.partial / f"{name}.{os.uname().nodename}-{os.getpid()}"  # one per attempt
        self.writer = ShardWriter(tmp, out / name, first, map_size, build)
        self.k, self.first, self.fault, self.options = k, first, fault, options
        self.light = dataclasses.replace(options, verify=False)
        self.rows: list = []
        self.paths: list = []

    def put(self, jobs: list, expect: list) -> None:
        for job, want in zip(jobs, expect, strict=True):
            i = len(self.rows)
            if self.fault:
                self.fault("write", self.k, i)
            row, value = _again(job, want, self.options, self.light)
            self.writer.put(self.first + i, value)
            self.rows.append((row[0], self.k, *row[1:]))
            self.paths.append(fmt.path_value(job[1]))

    def seal(self) -> dict:
        entry, _ = seal_shard(self.writer, self.rows, self.paths, self.partial)
        return entry


def _check_visible(src: Path, partial: Path) -> None:
    """Refuse to run on a node that does not see SRC and OUT: its files would all be
    rejected as missing, its shards written where the driver never finds them."""
    for path, shown, error in ((src, src, SourceError), (partial, partial.parent, OutputError)):
        if not path.is_dir():
            raise error(
                f"{shown} is not there on node {os.uname().nodename}: put SRC and OUT on "
                "storage every node of the Ray cluster sees at the same path"
            )


def _again(
    job: tuple, want: Known, options: BuildOptions, light: BuildOptions
) -> tuple[list, bytes]:
    """The record of ``job`` made again, as the first pass made it: (index row, record).
    ``light`` is ``options`` without verification."""
    if want.stored:  # stored as it is: from the file's first bytes, parsed and checked once
        made = stored_again(job, want, options)
        if made is not None and _same(made[0], want):
            return made
    # A file stored as it is was decoded once already, and so was one stored as pixels
    # (decoded again here to make them, but checked once): the light way first, the CRC-32
    # tells whether it made the same record. One to convert is made again whole.
    converted = want.flags & fmt.FLAG_REENCODED and want.format != fmt.FORMAT_CODES["raw"]
    for opts in (options,) if converted or not options.verify else (light, options):
        header, value = process_file(job, opts)
        if header[0] == "ok" and _same(header[1], want):
            return header[1], value
    raise SourceError(
        f"{job[0]} changed while the build ran (its record is not the one the first pass "
        "made); run the same command again: it starts over with the file as it is now"
    )


def _same(row: list, want: Known) -> bool:
    """Whether an index row (without shard) is of the record the first pass made."""
    return (row[1], row[4]) == (want.nbytes, want.crc32)

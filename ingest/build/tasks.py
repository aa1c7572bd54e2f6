"""The two tasks of a build, run on a local build's workers and a Ray cluster's alike.

Plain functions: ray.py wraps them with ``ray.remote`` (so this module never imports
Ray). Each writes only under OUT/.partial and its own shard, through names of its own
process, so a retried attempt and the attempt it replaces never write the same file.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from ingest import format as fmt
from ingest.build.options import BuildOptions
from ingest.build.process import format_mix, process_file
from ingest.build.resume import OutputError
from ingest.build.run import seal_shard
from ingest.build.scan import SourceError
from ingest.build.writer import ShardWriter

Fault = Callable[[str, int, int], None]  # tests: (pass, range or shard, item) in a task


def check_range(src: Path, items: list, first: int, options: BuildOptions, plan: Path,
                fault: Fault | None) -> dict:  # fmt: skip
    """A Ray task: verify and normalise the samples ``first, first+1, ...`` (``items``)
    and keep what the second pass needs in the file ``plan``; return it."""
    _check_visible(src, plan.parent)
    kept, nbytes, crcs, reencoded, rejects = [], [], [], [], []
    rows, stats = [], Counter()
    for i, (rel, label) in enumerate(items):
        if fault:
            fault("check", first, i)
        header, value = process_file((os.path.join(src, rel), rel, label), options)
        if header[0] == "reject":
            rejects.append(header[1:])  # the path as stored: bytes when it is not UTF-8
            continue
        _, row, fixes = header
        kept.append(first + i)
        nbytes.append(len(value))
        crcs.append(row[4])
        reencoded.append(bool(row[6] & fmt.FLAG_REENCODED))
        rows.append((row[0], 0, *row[1:]))
        stats.update("fix " + fix.split(":")[0] for fix in fixes)
    stats.update(format_mix(np.array(rows, dtype=fmt.INDEX_DTYPE)))
    result = {
        "first": first, "end": first + len(items),
        "kept": np.array(kept, "<u8").tobytes(), "nbytes": np.array(nbytes, "<u4").tobytes(),
        "crc32": np.array(crcs, "<u4").tobytes(), "reencoded": np.array(reencoded, "u1").tobytes(),
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
    name = fmt.shard_name(k)
    partial = out / fmt.PARTIAL_DIR
    _check_visible(src, partial)
    tmp = partial / f"{name}.{os.uname().nodename}-{os.getpid()}"  # one per attempt
    writer = ShardWriter(tmp, out / name, first, map_size, build)
    rows, paths = [], []
    light = dataclasses.replace(options, verify=False)
    for i, (job, want) in enumerate(zip(jobs, expect, strict=True)):
        if fault:
            fault("write", k, i)
        row, value = _again(job, want, options, light)
        writer.put(first + i, value)
        rows.append((row[0], k, *row[1:]))
        paths.append(fmt.path_value(job[1]))
    entry, _ = seal_shard(writer, rows, paths, partial)
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
    job: tuple, want: tuple, options: BuildOptions, light: BuildOptions
) -> tuple[list, bytes]:
    """The record of ``job`` made again, as the first pass made it: (index row, record).
    ``light`` is ``options`` without verification."""
    nbytes, crc, reencoded = want
    # A file stored as it is was decoded once already; one to convert is made again whole.
    for opts in (options,) if reencoded or not options.verify else (light, options):
        header, value = process_file(job, opts)
        if header[0] == "ok" and (header[1][1], header[1][4]) == (nbytes, crc):
            return header[1], value
    raise SourceError(
        f"{job[0]} changed while the build ran (its record is not the one the first pass "
        "made); run the same command again: it starts over with the file as it is now"
    )

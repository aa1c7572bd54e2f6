"""One build's OUT from start to end: ``start`` (scan SRC, take OUT, resume or begin),
``Run`` (its state and sealed shards; the end: rejects, index, paths, the manifest last)
and ``seal_shard`` (a shard sealed, its index rows kept for that end). Both drivers,
local and Ray, build on it."""

from __future__ import annotations

import io
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import msgpack
import numpy as np

from ingest import format as fmt
from ingest.build.failures import writing
from ingest.build.options import BuildOptions
from ingest.build.outdir import Claim
from ingest.build.resume import fingerprint, identity, load_state
from ingest.build.scan import Scan, SourceError, scan
from ingest.build.writer import ShardWriter, check_shard_size
from ingest.format.safeio import sha256_file

log = logging.getLogger(__name__)


def start(
    src, claim: Claim, options: BuildOptions, mode: str, facts: Callable | None = None
) -> tuple[Scan, dict]:
    """Scan SRC and take OUT (``claim``): a fresh build, or the sealed progress of an
    interrupted one of the same inputs, options and ``mode`` ("local" or "ray").
    ``facts(scan)`` gives the fingerprint's facts of the files (``resume.fingerprint``).
    The state is None where OUT already holds this very build (``Claim.finished``)."""
    check_shard_size(options.shard_size)  # one this process cannot map, before anything
    claim.check()  # before the scan, which may take minutes: nothing is written yet
    tree = scan(Path(src))
    for rel, reason in tree.skipped:
        log.warning("ingest: skipped %s: %s", fmt.shown(rel), reason)
    with writing(claim.out):  # a folder this user may not write, a read-only or full disk
        claim.take()
    digest = fingerprint(tree, options.output_affecting(), facts(tree) if facts else None)
    with writing(claim.out):
        if claim.finished(identity(digest)) is not None:
            return tree, None
        return tree, load_state(claim.target, digest, mode)


class Run:
    """One build's OUT: its state, its sealed shards and their partial index; the end of
    the build (rejects, index, paths, the manifest last)."""

    def __init__(self, tree: Scan, out: Path, options: BuildOptions, state: dict, map_size: int):
        self.tree, self.out, self.options, self.state = tree, out, options, state
        self.map_size = map_size
        self.build = identity(state["fingerprint"])  # same inputs, same identity
        self.partial = out / fmt.PARTIAL_DIR
        self.partial.mkdir(exist_ok=True)
        self.stats = Counter(state["stats"])

    def finish(self) -> dict:
        with open(self.out / fmt.REJECTS, "w", encoding="utf-8") as f:
            for rej in self.state["rejects"]:
                f.write(fmt.json_line(rej) + "\n")
        if not self.state["shards"]:  # nothing to store: a failed build, never a store
            # Recorded as failed, not as interrupted: a rerun starts over without calling
            # it an interrupted build. The rejects stay: the error points to them.
            failed = {"fingerprint": self.state["fingerprint"], "failed": True}
            fmt.write_json_atomic(self.out / fmt.BUILD_STATE, failed)
            shutil.rmtree(self.partial, ignore_errors=True)
            raise SourceError(
                f"no valid image in {self.tree.root}: {len(self.state['rejects'])} file(s) "
                f"rejected (reasons in {self.out / fmt.REJECTS}), {self.tree.num_ignored} "
                "ignored; no store was written"
            )
        index, paths = self._gather()
        np.save(self.out / fmt.INDEX, index)
        with open(self.out / fmt.PATHS, "wb") as f:
            f.write(msgpack.packb(paths, use_bin_type=True))
        manifest = self._manifest(len(index))
        for name in (fmt.INDEX, fmt.PATHS, fmt.REJECTS):  # on disk before the manifest says
            fmt.fsync_path(self.out / name, data_only=True)  # they are (a power cut)
        fmt.write_json_atomic(self.out / fmt.MANIFEST, manifest)  # last: the store is complete
        (self.out / fmt.BUILD_STATE).unlink()
        shutil.rmtree(self.partial, ignore_errors=True)
        return manifest

    def _gather(self) -> tuple[np.ndarray, list[str]]:
        parts, paths = [], []
        for s in self.state["shards"]:
            stem = self.partial / s["name"]
            parts.append(np.load(f"{stem}.index.npy", allow_pickle=False))
            with open(f"{stem}.paths.msgpack", "rb") as f:
                paths.extend(msgpack.unpackb(f.read(), raw=False))
        index = np.concatenate(parts) if parts else np.zeros(0, fmt.INDEX_DTYPE)
        return index, paths

    def _file_entry(self, name: str) -> dict:
        path = self.out / name
        return {"file": name, "sha256": sha256_file(path), "bytes": path.stat().st_size}

    def _manifest(self, num_samples: int) -> dict:
        rejected, ignored = len(self.state["rejects"]), self.tree.num_ignored
        return {
            "format": fmt.FORMAT_NAME,
            "version": fmt.written_version(self.options.encoding),
            "num_samples": num_samples,
            "num_classes": len(self.tree.classes),
            "classes": self.tree.classes,
            "num_seen": num_samples + rejected + ignored,
            "num_rejected": rejected,
            "num_ignored": ignored,
            "ignored_by_reason": dict(sorted(self.tree.ignored.items())),
            "shards": self.state["shards"],
            "index": self._file_entry(fmt.INDEX),
            "paths": self._file_entry(fmt.PATHS),
            "rejects": self._file_entry(fmt.REJECTS),
            "build": self.build,
            "skipped": [{"path": p, "reason": r} for p, r in self.tree.skipped],
            "record_bytes": sum(s["record_bytes"] for s in self.state["shards"]),
            "stats": dict(sorted(self.stats.items())),
            "options": self.options.output_affecting(),
        }


def seal_shard(
    writer: ShardWriter, rows: list[tuple], paths: list, partial: Path
) -> tuple[dict, np.ndarray]:
    """Seal a shard and keep its index rows and paths in ``partial`` for the index written
    at the end; return its manifest entry and its rows."""
    table = np.array(rows, dtype=fmt.INDEX_DTYPE)
    stem = partial / writer.final_dir.name
    buf = io.BytesIO()
    np.save(buf, table)
    _write_new(Path(f"{stem}.index.npy"), buf.getvalue())
    _write_new(Path(f"{stem}.paths.msgpack"), msgpack.packb(paths, use_bin_type=True))
    entry = writer.seal()
    entry["digest"] = fmt.records_digest(entry["first"], table["crc32"], table["nbytes"])
    entry["map_growths"] = writer.map_growths
    return entry, table


def _write_new(path: Path, data: bytes) -> None:
    """Write ``path`` whole or not at all: through a name of this process's own, since a
    retried Ray task may write the same file while the attempt it replaces still runs."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

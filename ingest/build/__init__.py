"""build(): scan SRC -> verify/normalise and write shards on all cores -> index -> manifest last."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import logging
import os
import shutil
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lmdb
import msgpack
import numpy as np

from ingest import format as fmt
from ingest.format.codec import Compression, compress, pack_record, record_limit
from ingest.cores import usable_cores
from ingest.cstderr import captured
from ingest.images.normalize import DEFAULT_MAX_PIXELS, OBJECT_AT, Options, Reject, convert
from ingest.build.outdir import Claim
from ingest.build.resume import OutputError, fingerprint, identity, load_state
from ingest.format.safeio import FileRefused, read_regular, sha256_file
from ingest.build.scan import Scan, SourceError, scan
from ingest.build.writer import MiB, ShardWriter, check_shard_size, initial_map_size

log = logging.getLogger(__name__)

Result = tuple[list, bytes]  # process_file's: (header, record)


@dataclass(frozen=True)
class BuildOptions:
    shard_size: int = 512 * MiB
    compression: Compression = field(default_factory=Compression)
    max_size: int | None = None
    quality: int = 95
    verify: bool = True
    max_pixels: int = DEFAULT_MAX_PIXELS  # larger images are rejected (decompression bombs)
    max_file_bytes: int = 1 << 30  # larger source files are rejected, unread

    def output_affecting(self) -> dict:
        d = asdict(self)
        d["compression"] = str(self.compression)
        return d


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
    from ingest.build import local as local_build  # its tasks are built on this module

    options = options or BuildOptions()
    claim = Claim(Path(src), Path(out), overwrite)
    with local_build.make_pool(workers or usable_cores()) as pool:
        try:
            facts = functools.partial(local_build.file_facts, pool)
            tree, state = start(src, claim, options, "local", facts)
            if state is None:  # an --overwrite cut short in its swap: that store is this one
                return fmt.read_manifest(claim.out)
            run = Run(tree, claim.target, options, state, map_size or default_map_size(options))
            with writing(claim.out):
                manifest = local_build.convert(run, Path(src), pool, progress)
                claim.commit()
            return manifest
        finally:
            claim.release()


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


def default_map_size(options: BuildOptions) -> int:
    return initial_map_size(int(options.shard_size))


_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM)


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """Failures to write OUT as one-line OutputErrors (``write_failure``); others as they
    are, with their tracebacks."""
    try:
        yield
    except (lmdb.Error, OSError) as e:
        failure = write_failure(out, e)
        if failure is None:
            raise
        raise failure from e


def write_failure(out: Path, e: Exception) -> OutputError | None:
    """A one-line OutputError for a failure to write OUT (a full disk, an I/O error), or
    None for an error that is not about writing (it keeps its traceback)."""
    if isinstance(e, OSError) and e.errno not in (*_FULL, *_DENIED, errno.EIO, errno.EROFS):
        return None
    if getattr(e, "errno", None) in _DENIED:
        return OutputError(
            f"output {out}: this user may not write there ({e.strerror}: "
            f"{fmt.shown(str(e.filename or out))}); give it write access, or choose another folder"
        )
    try:
        st = os.statvfs(out)
        full = st.f_bavail * st.f_frsize < 64 * MiB
    except OSError:
        full = False
    if full or getattr(e, "errno", None) in _FULL:
        return OutputError(
            f"output {out}: its filesystem is full ({e}); free some space and run the same "
            "command again: it resumes from the last completed shard"
        )
    return OutputError(
        f"output {out}: writing failed ({e}); check the disk, then run the same command "
        "again: it resumes from the last completed shard"
    )


def process_file(job: tuple, options: BuildOptions) -> Result:
    """One source file: (["ok", index row without shard, fixes], record) or
    (["reject", path, reason], b"")."""
    path, rel, label = job
    stored = fmt.path_value(rel)
    try:
        data = read_regular(path, options.max_file_bytes)
        opts = Options(options.verify, options.max_size, options.quality, options.max_pixels)
        with captured() as warnings:  # what libjpeg, libtiff... print: never on the terminal
            conv = convert(data, opts)
        if warnings and conv.source_format == "jpeg":
            warning = warnings[0].removeprefix("Corrupt JPEG data: ")
            raise Reject(f"corrupt JPEG data: the decoder warns: {warning}")
    except FileRefused as e:
        hint = " (--max-file-size)" if str(e).startswith("too large") else ""
        return ["reject", stored, f"{e}{hint}"], b""
    except Reject as e:
        return ["reject", stored, str(e)], b""
    except Exception as e:  # a decoder's surprise on one file rejects that file, not the build
        said = OBJECT_AT.sub("", str(e))  # the same reason in every build
        return ["reject", stored, f"could not convert: {type(e).__name__}: {said}"], b""
    record = {
        "image": compress(conv.payload, options.compression),
        "label": label,
        "path": stored,
        "height": conv.height,
        "width": conv.width,
        "channels": conv.channels,
        "format": conv.format,
        "source_format": conv.source_format,
        "progressive": conv.progressive,
        "subsampling": conv.subsampling,
        "compression": None if options.compression.name == "none" else options.compression.name,
        "fixes": conv.fixes,
    }
    value = pack_record(record)
    limit = record_limit(conv.height, conv.width)
    if len(value) > limit:  # as every reader would refuse it, unread
        why = f"{len(value)} bytes for {conv.width}x{conv.height} pixels (at most {limit})"
        return ["reject", stored, f"too many bytes for its pixels: {why}"], b""
    flags = (
        fmt.FLAG_PROGRESSIVE * conv.progressive
        | fmt.FLAG_REENCODED * (not data.startswith(conv.payload))
        | fmt.FLAG_COMPRESSED * (record["compression"] is not None)
    )
    row = [label, len(value), conv.height, conv.width, zlib.crc32(value),
           fmt.FORMAT_CODES[conv.format], flags, conv.channels,
           fmt.SUBSAMPLING_CODES.get(conv.subsampling or "", 0)]  # fmt: skip
    return ["ok", row, conv.fixes], value


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
            "version": fmt.FORMAT_VERSION,
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


def format_mix(rows: np.ndarray) -> Counter:
    """The format mix of some index rows, as counted in the manifest's stats."""
    jpeg = rows["format"] == fmt.FORMAT_CODES["jpeg"]
    progressive = (rows["flags"] & fmt.FLAG_PROGRESSIVE) != 0
    counts = {
        "jpeg baseline": jpeg & ~progressive,
        "jpeg progressive": jpeg & progressive,
        "png": rows["format"] == fmt.FORMAT_CODES["png"],
        "re-encoded": (rows["flags"] & fmt.FLAG_REENCODED) != 0,
    }
    return Counter({name: int(mask.sum()) for name, mask in counts.items() if mask.any()})

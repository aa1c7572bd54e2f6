"""verify_store(): check every shard against its build-time checksums and decode every record."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import cv2
import lmdb
import numpy as np
from tqdm import tqdm

from ingest import format as fmt
from ingest.cstderr import captured
from ingest.format.checksum import crc32
from ingest.format.codec import image_bytes, payload_limit, row_problem, size_problem, unpack_record
from ingest.format.pages import open_lmdb, pages_problem
from ingest.format.safeio import FileRefused, sha256_file
from ingest.images.normalize import Reject, check_jpeg
from ingest.images.png import PngError, plain_png
from ingest.images.probe import header_problem


def verify_store(
    root: str | os.PathLike,
    *,
    decode: bool = True,
    progress: bool | None = None,
    max_pixels: int | None = None,
) -> list[str]:
    """Return every problem found in the store at ``root`` (empty: the store is sound).

    Checks every file through ``ingest.format.store_file`` (named as the format says,
    inside the store, a regular file of the recorded size), the SHA-256 of the index,
    paths and rejects files and the index against the manifest; then each shard's LMDB
    pages (``ingest.format.pages``) and every record of every shard, checking its key, its
    CRC-32 and length (recorded in the index), its fields, the size its image's header
    gives against the index's (as readers refuse it) and, with ``decode``, that its
    image decodes without a warning to the recorded size; and each shard's build
    identity and content checksum (``ingest.format.records_digest``) against the
    manifest. Problems name the shard, and
    the key where one record is at fault.
    ``progress`` shows a progress bar, as ``ingest build`` does (default: when stderr is
    a terminal). Images are decoded within the pixel limit a reader applies
    (``ingest.format.pixel_limit``, ``max_pixels`` as the reader's).

    Raises:
        ingest.format.StoreError: ``root`` is not a complete store (no valid manifest),
            or this user may not read one of its files (``ingest.format.AccessDenied``).
        ingest.format.PixelLimitError: the store holds an image over ``max_pixels``, as a
            reader refuses it (not a damaged store: the message says what to pass).
        ValueError: ``max_pixels`` is not a positive integer.
    """
    root = Path(root)
    manifest = fmt.read_manifest(root)
    _require_readable(root, manifest)
    problems = [p for what in ("paths", "rejects") if (p := _file_problem(root, manifest, what))]
    try:  # the index file, its rows against the manifest, its SHA-256
        index = fmt.load_index(root, mmap=False, manifest=manifest)
    except fmt.StoreError as e:  # without a sound index the records cannot be checked
        return [_relative(root, e), *problems]
    limit = fmt.pixel_limit(root, manifest, index, max_pixels)  # the readers' refusal
    bar = tqdm(
        total=len(index), unit="img", desc="verify", smoothing=0.05,
        disable=None if progress is None else not progress,
    )  # fmt: skip
    with bar:
        for shard in range(len(manifest["shards"])):
            problems.extend(
                _check_shard_apart(root, manifest, shard, (index, decode, limit), bar.update)
            )
    return problems


def _require_readable(root: Path, manifest: dict) -> None:
    """Raise AccessDenied for the first file of the store this user may not read: its
    permissions are wrong, not its content, which cannot be checked."""
    for what in ("index", "paths", "rejects", *range(len(manifest["shards"]))):
        try:
            fmt.store_file(root, manifest, what)
        except fmt.AccessDenied:
            raise
        except fmt.StoreError:  # a problem of the file itself: reported with the others
            pass


_TICKS = 256  # records checked between two progress messages from a shard's process


def _check_shard_apart(
    root: Path, manifest: dict, shard: int, checked: tuple[np.ndarray, bool, int], tick
) -> list[str]:
    """``_check_shard`` in a process of its own. LMDB trusts its pages: a shard damaged in
    place (its size unchanged) can kill the process that reads it (SIGBUS past the end of
    the file, an assertion's abort). ``ingest.format.pages`` refuses such pages before LMDB
    reads them; should a damage it does not foresee get past it, the tool that checks a
    damaged store must still not die of it. The child's death is this shard's problem;
    what it wrote to fd 2 (LMDB's assertion) is quoted, never shown."""
    ctx = multiprocessing.get_context("fork")  # the index and manifest, not pickled
    reader, writer = ctx.Pipe(duplex=False)
    with tempfile.TemporaryFile() as err:
        child = ctx.Process(target=_shard_child, args=(writer, err, root, manifest, shard, checked))
        child.start()
        writer.close()
        outcome = None
        try:
            while outcome is None:
                try:
                    kind, value = reader.recv()
                except EOFError:  # the child died without an answer
                    break
                if kind == "tick":
                    tick(value)
                else:
                    outcome = (kind, value)
        finally:
            reader.close()
            child.join()
        err.seek(0)
        said = err.read(4096).decode("utf-8", "replace").strip().splitlines()
    name = manifest["shards"][shard]["name"]
    if outcome is None:
        code = child.exitcode
        how = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
        quoted = f": {fmt.shown(said[0])}" if said else ""
        return [f"{name}: reading its LMDB pages killed the reader ({how}{quoted}): the shard "
                "is damaged; rebuild the store"]  # fmt: skip
    kind, value = outcome
    if kind == "error":  # a fault of this code, not of the store: as if raised here
        raise RuntimeError(f"ingest verify failed on {name}: {value}")
    return value


def _shard_child(writer, err, root, manifest, shard, checked) -> None:
    """In the child: check the shard, report progress every ``_TICKS`` records, then the
    problems (or the error) through ``writer``; fd 2 goes to ``err``, and Python's fault
    handler (the user's or pytest's, on a descriptor of its own) is off: the parent
    reports this process's death."""
    faulthandler.disable()
    os.dup2(err.fileno(), 2)
    pending = 0

    def tick(n: int) -> None:
        nonlocal pending
        pending += n
        if pending >= _TICKS:
            writer.send(("tick", pending))
            pending = 0

    try:
        problems = _check_shard(root, manifest, shard, checked, tick)
        if pending:
            writer.send(("tick", pending))
        writer.send(("problems", problems))
    except Exception as e:
        writer.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        writer.close()


def _relative(root: Path, e: Exception) -> str:
    """A StoreError's message without the leading store path (the CLI prints it)."""
    return str(e).removeprefix(f"{root}/")


def _file_problem(root: Path, manifest: dict, what: str) -> str | None:
    try:
        path = fmt.store_file(root, manifest, what)
        if sha256_file(path) != manifest[what]["sha256"]:
            return f"{manifest[what]['file']}: checksum mismatch"
    except (fmt.StoreError, FileRefused) as e:
        return _relative(root, e)
    return None


def _check_shard(
    root: Path, manifest: dict, shard: int, checked: tuple[np.ndarray, bool, int], tick=None
) -> list:
    """The problems of one shard; ``checked`` is (the index, whether to decode, the pixel
    limit)."""
    entry = manifest["shards"][shard]
    name = entry["name"]
    try:
        data = fmt.store_file(root, manifest, shard)
        problem = pages_problem(data)  # before LMDB trusts them
    except (fmt.StoreError, OSError) as e:
        return [_relative(root, e)]
    if problem is not None:
        return [f"{name}: damaged LMDB pages ({problem}); rebuild the store"]
    path = data.parent
    crcs: list[int] = []
    sizes: list[int] = []
    try:
        problems = list(_check_records(path, name, entry, checked, crcs, sizes, tick))
        problems += _build_problem(path, name, manifest)
    except lmdb.Error as e:
        return [f"{name}: LMDB cannot read the shard: {e}"]
    if fmt.records_digest(entry["first"], np.array(crcs), np.array(sizes)) != entry["digest"]:
        problems.append(f"{name}: content checksum mismatch (records changed since the build)")
    return problems


def _build_problem(path: Path, name: str, manifest: dict) -> list[str]:
    if "build" not in manifest:  # a version 1 store
        return []
    env = open_lmdb(path, readonly=True, lock=False, readahead=False)
    try:
        with env.begin() as txn:
            build = txn.get(fmt.BUILD_KEY)
    finally:
        env.close()
    if build != manifest["build"].encode():
        return [f"{name}: written by another build than the manifest's (a mixed store)"]
    return []


def _check_records(
    path: Path,
    name: str,
    entry: dict,
    checked: tuple[np.ndarray, bool, int],
    crcs: list,
    sizes: list,
    tick=None,
) -> Iterator[str]:
    env = open_lmdb(path, readonly=True, lock=False, readahead=False)
    try:
        with env.begin() as txn:
            expected = entry["first"]
            for i, value in fmt.shard_records(txn):
                if i != expected:
                    yield f"{name}: key {i} found where key {expected} was expected"
                    expected = i
                crcs.append(crc32(value))
                sizes.append(len(value))
                # Readers look each record up by its key, where the walk reads the leaves
                # in order: a damaged branch page misroutes the lookup alone.
                found = txn.get(fmt.encode_key(i))
                if found is None or len(found) != len(value):
                    problem = _MISROUTED
                else:
                    problem = _check_record(i, value, crcs[-1], *checked)
                if problem:
                    yield f"{name}: key {i}: {problem}"
                if tick is not None:
                    tick(1)
                expected += 1
            last = entry["first"] + entry["count"] - 1
            if expected - 1 != last:
                yield f"{name}: ends at key {expected - 1}, expected key {last}"
    finally:
        env.close()


_MISROUTED = (
    "not found by a lookup, where a walk of the shard finds it (damaged LMDB branch pages); "
    "rebuild the store"
)


def _check_record(
    i: int, value: bytes, crc: int, index: np.ndarray, decode: bool, max_pixels: int
) -> str | None:
    """What is wrong with record ``i`` (``value``), checked as a reader checks it, or None."""
    if not 0 <= i < len(index):
        return "key outside the index"
    row = index[i]
    problem = size_problem(int(row["height"]), int(row["width"]), int(row["nbytes"]), max_pixels)
    if problem:  # as a reader refuses it: unread
        return problem
    if len(value) != row["nbytes"] or crc != row["crc32"]:
        return "record bytes differ from those recorded at build time (CRC-32 mismatch)"
    try:
        rec = unpack_record(value)
        problem = fmt.check_record(rec)
        if problem:
            return f"malformed record: {problem}"
        img = image_bytes(rec, payload_limit(rec["format"], int(row["height"]), int(row["width"])))
    except Exception as e:  # msgpack and zstd raise several types
        return f"record does not unpack: {type(e).__name__}: {e}"
    if rec["label"] != row["label"]:
        return f"label {rec['label']} differs from the index ({row['label']})"
    problem = row_problem(rec, row) or header_problem(
        img, rec["format"], int(row["height"]), int(row["width"]), int(row["channels"])
    )
    if problem:  # as a reader refuses it: undecoded
        return problem
    return _decode_problem(img, rec) if decode else None


def _decode_problem(img: bytes, rec: dict) -> str | None:
    """Decode like a reader would, a warning included as a failure."""
    where = fmt.shown(rec.get("path", "?"))
    if rec["format"] == "raw":  # pixels: their length, checked already, is all there is
        return None
    if rec["format"] == "jpeg":
        try:
            shape = check_jpeg(img)
        except Reject as e:
            return f"{e} ({where})"
    else:
        try:
            img = plain_png(img)  # as the loader reads it: its critical chunks, checked
            with captured() as warnings:
                pixels = cv2.imdecode(np.frombuffer(img, np.uint8), cv2.IMREAD_UNCHANGED)
        except PngError as e:
            return f"the PNG is damaged: {e} ({where})"
        except cv2.error as e:  # an empty payload, among others, raises
            return f"the decoder fails: {getattr(e, 'err', None) or e} ({where})"
        if warnings:
            return f"the decoder warns: {warnings[0]} ({where})"
        shape = None if pixels is None else pixels.shape[:2]
    if shape != (rec["height"], rec["width"]):
        return f"image does not decode to {rec['width']}x{rec['height']} ({where})"
    return None

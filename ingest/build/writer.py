"""One shard: an LMDB environment filled in key order, its map grown on demand, sealed once.

A shard is mapped in memory whole while it is written (LMDB's map, 1.25x the shard size,
doubled when small records' pages outgrow it): ``check_shard_size`` refuses at the door a
shard size whose map this process could not make, rather than fail at the first shard.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import mmap
import numbers
import os
import resource
import shutil
import sys
import threading
from pathlib import Path

import lmdb

from ingest.build.resume import OutputError
from ingest.format import BUILD_KEY, encode_key, fsync_path
from ingest.format.pages import open_lmdb

MiB = 1 << 20
TXN_BYTES = 16 * MiB  # commit this often: bounds the dirty pages LMDB keeps in memory
# A map grows by doubling (``_commit``); once is enough: small records' pages take up to
# twice their bytes (one 2.1 KB or 4.1 KB record a 4 KiB page, or two), and the map starts
# at 1.25x the shard size.
MAP_GROWTH = 2
_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10))
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (glibc)
_heap_kept: set[int] = set()  # processes where keep_heap() ran


class ShardWriter:
    """Writes records into a fresh LMDB environment at ``tmp_dir``; ``seal`` moves it to
    ``final_dir`` only once it is complete and synced, so a crash never leaves a shard
    that looks finished.
    """

    def __init__(
        self, tmp_dir: Path, final_dir: Path, first: int, map_size: int, build: str = ""
    ) -> None:
        if tmp_dir.exists():
            shutil.rmtree(tmp_dir)
        tmp_dir.mkdir(parents=True)
        self.tmp_dir, self.final_dir, self.first = tmp_dir, final_dir, first
        self.build = build  # the build identity, written into the shard when it is sealed
        self.count = 0
        self.nbytes = 0
        self.map_growths = 0
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_bytes = 0
        self._flusher: threading.Thread | None = None
        keep_heap()
        with _mapping(final_dir.name, map_size):
            self._env = open_lmdb(
                tmp_dir, map_size=map_size, subdir=True, sync=False, metasync=False,
                readahead=False, max_dbs=0,
            )  # fmt: skip

    def put(self, index: int, value: bytes) -> None:
        if index != self.first + self.count:
            raise ValueError(f"shard expects key {self.first + self.count}, got {index}")
        self._pending.append((encode_key(index), value))
        self._pending_bytes += len(value)
        self.count += 1
        self.nbytes += len(value)
        if self._pending_bytes >= TXN_BYTES:
            self._commit()

    def _commit(self) -> None:
        while True:
            try:
                with self._env.begin(write=True) as txn:
                    txn.cursor().putmulti(self._pending, append=True)  # one call: less overhead
                break
            except lmdb.MapFullError:
                # The failed transaction was aborted: grow the map and write it again.
                grown = self._env.info()["map_size"] * MAP_GROWTH
                with _mapping(self.final_dir.name, grown):
                    self._env.set_mapsize(grown)
                self.map_growths += 1
        self._pending.clear()
        self._pending_bytes = 0
        self._flush_behind()

    def _flush_behind(self) -> None:
        """Start writing committed pages to disk now, in a thread (fdatasync drops the GIL),
        so that the sync at seal time waits for the last few only."""
        if self._flusher is not None and self._flusher.is_alive():
            return
        sync = functools.partial(_quiet_fsync, self.tmp_dir / "data.mdb")
        self._flusher = threading.Thread(target=sync)
        self._flusher.start()

    def seal(self) -> dict:
        """Commit, sync, close, drop the lock file and rename into place; return its entry."""
        if self.build:  # not a record: its key is not 8 bytes long (docs/FORMAT.md)
            self._pending.append((BUILD_KEY, self.build.encode("ascii")))
        self._commit()
        self._flusher.join()
        self._env.sync(True)
        self._env.close()
        lock = self.tmp_dir / "lock.mdb"
        if lock.exists():
            lock.unlink()
        data = self.tmp_dir / "data.mdb"
        size = data.stat().st_size
        _replace_dir(self.tmp_dir, self.final_dir)
        fsync_path(self.final_dir.parent)
        return {
            "name": self.final_dir.name,
            "first": self.first,
            "count": self.count,
            "record_bytes": self.nbytes,
            "file_bytes": size,
        }


class ShardSizeError(OutputError):
    """A shard size (or map size) whose map this process cannot make; the message says the
    most it can."""


def initial_map_size(shard_size: int) -> int:
    """The LMDB map a shard of ``shard_size`` bytes starts with: its records, LMDB's
    pages around them and 1 MiB."""
    return shard_size + shard_size // 4 + MiB


def check_shard_size(size: int, given: str | None = None) -> None:
    """Refuse a shard size that this process could not build, before anything is written.

    Args:
        size: the shard size in bytes.
        given: the option as the caller wrote it, for the message (default
            ``shard_size=<size>``; the CLI passes ``--shard-size <text>``).

    Raises:
        ShardSizeError: ``size`` is not a whole number of bytes of at least 1, or the map of
            its shard, grown once (``MAP_GROWTH``), is more than this process can map at
            once (its largest free block of address space, within ``ulimit -v``).
    """
    given = given or f"shard_size={size!r}"
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ShardSizeError(f"{given} is invalid: pass a whole number of bytes, at least 1")
    if not mappable(MAP_GROWTH * initial_map_size(int(size))):
        room, advice = _room()
        raise ShardSizeError(
            f"{given}: a shard is mapped in memory whole while it is written (1.25x its "
            f"size, doubled if small records outgrow that), and {room}; pass {advice}"
        )


def _room() -> tuple[str, str]:
    """How much this process can map (a clause), and what to pass instead (an advice)."""
    limit = largest_mappable()
    # The largest shard whose grown map fits in 95% of that: the layout moves from run to
    # run (address space layout randomisation), and the build maps more meanwhile.
    most = (limit * 19 // 20 // MAP_GROWTH - MiB) * 4 // 5
    cap = resource.getrlimit(resource.RLIMIT_AS)[0]
    capped = cap != resource.RLIM_INFINITY
    where = "its largest free block of address space"
    if capped:
        where = f"`ulimit -v` lets it have {shown(cap)} in all"
    advice = f"a shard size of at most {shown(most)}" if most >= 1 else "no shard size fits"
    advice += ", or raise `ulimit -v`" if capped else ""
    return f"this process can map about {shown(limit)} at once ({where})", advice


def mappable(nbytes: int) -> bool:
    """Whether this process can map ``nbytes`` at once now: the address space is reserved
    (PROT_NONE) and let go at once. Nothing is committed, so overcommit settings do not
    count, as they do not for LMDB's read-only map of a file."""
    if not 0 < nbytes <= sys.maxsize:
        return False
    try:
        reserved = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE, prot=0)  # 0: PROT_NONE
    except (OSError, OverflowError, ValueError):
        return False
    reserved.close()
    return True


def largest_mappable() -> int:
    """The most bytes this process can map at once now, to 1 MiB (by bisection)."""
    lo, hi = 0, sys.maxsize + 1  # mappable (or none), not mappable
    while hi - lo > MiB:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if mappable(mid) else (lo, mid)
    return lo


def shown(nbytes: int) -> str:
    """``nbytes`` as a size ``--shard-size`` takes, rounded down to a tenth below 10 of its
    unit, to a whole one above: "1.4GiB", "34TiB", "640MiB"."""
    for name, unit in _UNITS:
        if nbytes >= unit:
            tenths = nbytes * 10 // unit
            return f"{tenths / 10:g}{name}" if tenths < 100 else f"{tenths // 10}{name}"
    return f"{nbytes}B"


@contextlib.contextmanager
def _mapping(shard: str, map_size: int):
    """Around LMDB's mapping of ``map_size`` bytes: a map this process cannot make is a
    ShardSizeError, not a disk's failure (LMDB says only "Cannot allocate memory")."""
    try:
        yield
    except lmdb.MemoryError as e:
        room, advice = _room()
        raise ShardSizeError(
            f"{shard}: its LMDB map of {shown(map_size)} could not be made ({e}), and {room}; "
            f"build with {advice} (or give build() a smaller map_size)"
        ) from e


def keep_heap() -> None:
    """Have glibc keep freed memory for reuse in this process, instead of handing it back to
    the kernel.

    LMDB copies a transaction's records into pages it mallocs, and frees them at commit;
    glibc then gives them back to the kernel (records over its adaptive mmap threshold are
    unmapped, the top of the heap is trimmed), and the next transaction faults them in
    again, page by page: about half of the CPU time of writing a record
    (docs/design/ingest.md). Costs the memory of one transaction's pages, kept for the
    next one.
    """
    if os.getpid() in _heap_kept:
        return
    _heap_kept.add(os.getpid())
    with contextlib.suppress(OSError, AttributeError):  # not glibc: its allocator as it is
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * MiB)  # glibc's maximum: LMDB pages from the heap
        libc.mallopt(_M_TRIM_THRESHOLD, 256 * MiB)


def _replace_dir(src: Path, dst: Path, attempts: int = 3) -> None:
    """Rename the directory ``src`` to ``dst``, replacing any ``dst``. Another process may
    seal the same shard meanwhile (a Ray task's attempt that its retry replaced): its
    shard is the same, so drop it and try again."""
    for attempt in range(attempts):
        if dst.exists():
            shutil.rmtree(dst, ignore_errors=True)
        try:
            os.replace(src, dst)
            return
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or attempt == attempts - 1:
                raise


def _quiet_fsync(path: Path) -> None:
    # A failure here (a full disk) shows again, and is reported, at the sync in seal();
    # raised in this thread it would only print a traceback.
    with contextlib.suppress(OSError):
        fsync_path(path, data_only=True)

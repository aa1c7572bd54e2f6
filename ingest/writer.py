"""One shard: an LMDB environment filled in key order, its map grown on demand, sealed once."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import shutil
import threading
from pathlib import Path

import lmdb

from ingest.format import BUILD_KEY, encode_key, fsync_path
from ingest.lmdbpages import open_lmdb

MiB = 1 << 20
TXN_BYTES = 16 * MiB  # commit this often: bounds the dirty pages LMDB keeps in memory
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
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
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
        if self.build:  # not a record: its key is not 8 bytes long (FORMAT.md)
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


def keep_heap() -> None:
    """Have glibc keep freed memory for reuse in this process, instead of handing it back to
    the kernel.

    LMDB copies a transaction's records into pages it mallocs, and frees them at commit;
    glibc then gives them back to the kernel (records over its adaptive mmap threshold are
    unmapped, the top of the heap is trimmed), and the next transaction faults them in
    again, page by page: that was about half of the CPU time of writing a record (106 KB
    JPEGs on a 2-core VM: 76 us a record, 36 us with this). Costs the memory of one
    transaction's pages, kept for the next one.
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

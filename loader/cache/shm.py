"""ShmCache: one RAM copy per node of a store's shards, shared by every process that reads it.

The first process that needs a shard copies it into the store's cache directory (layout in
``ingest.format.cachedir``) under the shard's flock, into a temporary directory named after
itself, and renames it into place when complete and checked; processes that need the
shard meanwhile wait on the lock, then open the same copy. Space is reserved (allocated
up front) under a budget lock before a copy starts, so the cache never takes more than
its budget and never fills /dev/shm: a shard that does not fit is read from the store.
Nothing here fails a run: when the cache cannot serve a shard, the original does.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing.util
import os
import weakref
from pathlib import Path

import lmdb

from ingest import format as fmt
from ingest.format import cachedir as cd
from ingest.format.pages import identity, pages_problem, trust_sound
from ingest.sizes import parse_size
from loader.cache.copy import copy_bytes, file_sha256, records_digest
from loader.cache.stats import Counters

log = logging.getLogger(__name__)

MiB = 1 << 20
DEFAULT_SHARE = 0.5  # of what the cache root has free (plus what this cache already holds)
RESERVE = 256 * MiB  # always left free under the cache root (at most a tenth of its size)
COPY_INFO, VERIFIED, WALKED, DATA = "copy.json", "verified", "walked", "data.mdb"
_SAID_BUDGET, _SAID_ERROR = 1, 2  # "said once" flags


def parse_cache(cache, cache_limit, cache_root) -> tuple[bool, bool, int | None, str]:
    """Check the loader's ``cache=``, ``cache_limit=``, ``cache_root=`` arguments.

    Returns:
        (enabled, keep, limit in bytes or None for the default, cache root).

    Raises:
        ValueError: an argument is invalid (the message says what to pass).
    """
    if cache not in (None, "shm", "shm:keep"):
        raise ValueError(
            f'cache={cache!r} is unknown; pass cache="shm" (a RAM copy of the shards shared '
            'by all processes on this node), "shm:keep" (kept for the next run) or None'
        )
    if cache is None and (cache_limit is not None or cache_root is not None):
        raise ValueError('cache_limit= and cache_root= apply only with cache="shm"')
    limit = cache_limit
    if isinstance(cache_limit, str):
        try:
            limit = parse_size(cache_limit)
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"cache_limit={cache_limit!r}: {e}") from None
    elif cache_limit is not None and (
        isinstance(cache_limit, bool) or not isinstance(cache_limit, int) or cache_limit < 0
    ):
        raise ValueError(f'cache_limit={cache_limit!r} is invalid: bytes >= 0 or a size, "4GiB"')
    root = cd.DEFAULT_ROOT if cache_root is None else os.fspath(cache_root)
    return cache is not None, cache == "shm:keep", limit, root


class ShmCache:
    """The node-wide RAM cache of one store's shards, as used by this process.

    Creating one registers this process as a user of the cache; the last user to go
    (garbage collection or exit) removes the cache, unless one asked to ``keep`` it.

    Args:
        store_root: the store (complete: its manifest is read).
        keep: leave the cache in place when the last user exits, for the next run.
        limit: the most bytes the cache of this store may hold; default half of what the
            cache root has free. Never more than the cache root can hold.
        cache_root: where the cache lives (a tmpfs): default /dev/shm.

    Raises:
        ingest.format.cachedir.CacheError: ``cache_root`` cannot be used.
    """

    def __init__(self, store_root, *, keep: bool = False, limit: int | None = None,
                 cache_root: str | os.PathLike = cd.DEFAULT_ROOT) -> None:  # fmt: skip
        self.store_root = Path(store_root)
        raw = (self.store_root / fmt.MANIFEST).read_bytes()
        self.shards: list[dict] = json.loads(raw)["shards"]
        self.dir = cd.base_path(cache_root) / cd.store_id(raw)
        self.keep = keep
        self._counters = Counters(self.dir / cd.LOCKS / "stats.lock")
        info = {"store": os.path.realpath(self.store_root), "shards": len(self.shards)}
        self._held = None
        try:  # a cache_root this user cannot write (read-only, no permission, full): no cache
            cd.base_dir(cache_root)  # (its CacheError, an argument to mend, is raised)
            self._held = _join(self.dir, info, keep)
            self.limit = self._budget(limit)
        except OSError as e:
            if self._held is not None:  # joined, then the budget failed: not a user of it
                _leave(str(self.dir), os.getpid())
            self._held, self.limit = None, 0
            log.warning(
                "shm cache: cache_root=%r cannot hold a cache for this user (uid %d): %s; the "
                "store is read without one (give the user write access to it, or pass another "
                "cache_root)", os.fspath(cache_root), os.geteuid(), _why(e),
            )  # fmt: skip
            return
        self._leave = weakref.finalize(self, _leave, str(self.dir), os.getpid())
        self._leave.atexit = False  # at exit _join's handler leaves, after the workers stop

    @property
    def session(self) -> str | None:
        """This run's token (see ``ingest.format.cachedir.join``), that of the cache as this process
        joined it last; None when the cache could not be made."""
        return None if self._held is None else self._held[1]

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_leave"}  # a child never leaves

    def stats(self) -> dict[str, int]:
        """Counts over this process and its workers: ``hits`` (shards opened from a copy
        already there), ``misses`` (shards this process tree copied), ``bytes_copied``,
        ``from_original`` (shards read from the store: over budget, or the cache failed),
        ``replaced`` (copies found damaged, changed since they were checked, and removed:
        copied again when next needed)."""
        return self._counters.as_dict()

    def release(self) -> None:
        """Stop using the cache now (as on exit); reading shards later still works."""
        leave = getattr(self, "_leave", None)  # absent in a process that unpickled it
        if leave is not None:
            leave()

    def shard_path(self, shard: int) -> str:
        """The directory to open shard number ``shard`` from: its RAM copy (made now if
        needed and it fits) or, failing that, its original location in the store."""
        entry = self.shards[shard]
        try:
            path = None if self._held is None else self._cached(entry)
        except (OSError, lmdb.Error) as e:
            if self._counters.first(_SAID_ERROR):
                why = "was removed while in use" if not self.dir.is_dir() else f"failed: {e}"
                log.warning("shm cache %s %s; reading the store instead (said once)", self.dir, why)
            path = None
        if path is None:
            self._counters.add("from_original")
            return str(self.store_root / entry["name"])
        return str(path)

    def discard(self, shard: int, problem: str) -> None:
        """Remove shard ``shard``'s copy, which a reader found damaged (``problem`` names the
        copy and what failed) where the store's shard reads fine: that reader reads the store
        from now on, later ones copy the shard again. A copy that hashes as it did when made
        (another process replaced the damaged one already) is kept."""
        entry = self.shards[shard]
        final = self.dir / entry["name"]
        self._counters.add("from_original")
        try:
            with cd.locked(self.dir / cd.LOCKS / f"{entry['name']}.lock"):
                if not final.is_dir() or self._intact(final):
                    return
                cd.remove(final)
        except OSError:  # the cache removed under us: nothing to remove
            return
        self._counters.add("replaced")
        log.warning(
            "shm cache: %s, where the store's shard reads fine: the copy was damaged since it "
            "was made; it is removed (copied again when next needed) and the shard read from "
            "the store", problem,
        )  # fmt: skip

    def _cached(self, entry: dict) -> Path | None:
        final = self.dir / entry["name"]
        if self._verified(final):
            self._counters.add("hits")
            return final
        with cd.locked(self.dir / cd.LOCKS / f"{entry['name']}.lock"):
            if final.is_dir():
                if self._verified(final) or self._check(final, entry):
                    self._counters.add("hits")
                    return final
                log.warning("shm cache: %s is damaged; copying the shard again", final)
                cd.remove(final)
                self._counters.add("replaced")
            for tmp in self.dir.glob(f"{cd.TMP_PREFIX}{entry['name']}.*"):
                cd.remove(tmp)  # we hold the shard's lock: its owner is dead
            return self._copy(entry, final)

    def _verified(self, final: Path) -> bool:
        """Whether the copy ``final`` was checked in this run and is still the bytes it was
        (a copy changed since, in place, is checked again); if so, its pages are taken as
        walked (``ingest.format.pages.trust_sound``)."""
        try:
            if (final / VERIFIED).read_text(encoding="utf-8") != self.session:
                return False
            walked = json.loads((final / WALKED).read_text(encoding="utf-8"))
            if not isinstance(walked, list) or tuple(walked) != identity(final / DATA):
                return False
        except (OSError, ValueError):
            return False
        trust_sound([walked])
        return True

    def _intact(self, final: Path) -> bool:
        """Whether the copy ``final`` holds the bytes it was made with (its SHA-256)."""
        try:
            made = json.loads((final / COPY_INFO).read_text(encoding="utf-8"))
            return made["sha256"] == file_sha256(final / DATA)
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def _check(self, final: Path, entry: dict) -> bool:
        """Verify a copy left by an earlier run before its first use in this one.

        The copy was checked against the manifest's content checksum of the shard when it
        was made (``_copy``), and the SHA-256 of its bytes recorded then; equal bytes now
        mean equal records now. Hashing the file (2 GB/s) avoids parsing a damaged LMDB
        file, which could crash the reader rather than raise.
        """
        try:
            made = json.loads((final / COPY_INFO).read_text(encoding="utf-8"))
            before = identity(final / DATA)
            ok = made["digest"] == entry["digest"] and self._intact(final)
            ok = ok and pages_problem(final / DATA) is None  # (copies made before the walk)
            ok = ok and identity(final / DATA) == before  # what was hashed and walked
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if ok:
            cd.write_atomic(final / WALKED, json.dumps(before))
            cd.write_atomic(final / VERIFIED, self.session)
        return ok

    def _copy(self, entry: dict, final: Path) -> Path | None:
        src = self.store_root / entry["name"] / DATA
        size = src.stat().st_size
        tmp = self.dir / f"{cd.TMP_PREFIX}{entry['name']}.{cd.me()}"
        try:
            fd = self._reserve(tmp, size, entry["name"])
            if fd is None:
                return None
            try:
                sha = copy_bytes(src, fd, size)
            finally:
                os.close(fd)
            # LMDB reads the copy only once its pages are found sound (it trusts them)
            problem = pages_problem(tmp / DATA)
            if problem is not None or records_digest(tmp, entry) != entry["digest"]:
                log.warning(
                    "shm cache: %s %s; it is read from the store, not cached; check the "
                    "store with `ingest verify %s`", src.parent,
                    f"has damaged LMDB pages ({problem})" if problem
                    else "differs from the checksum in its manifest", self.store_root,
                )  # fmt: skip
                return None
            made = {"sha256": sha, "bytes": size, "digest": entry["digest"]}
            (tmp / COPY_INFO).write_text(json.dumps(made), encoding="utf-8")
            walked = identity(tmp / DATA)
            (tmp / WALKED).write_text(json.dumps(walked), encoding="utf-8")
            (tmp / VERIFIED).write_text(self.session, encoding="utf-8")
            os.rename(tmp, final)  # complete and checked, or not there at all
            trust_sound([walked])  # (the rename moved the directory, not the file)
        finally:
            cd.remove(tmp)  # nothing left after a rename or a failure
        self._counters.add("misses")
        self._counters.add("bytes_copied", size)
        return final

    def _reserve(self, tmp: Path, size: int, name: str) -> int | None:
        """Allocate ``size`` bytes for a copy if the budget and the free space allow."""
        with cd.locked(self.dir / "budget.lock"):
            used, free, reserve = self._used(), *_free(self.dir)
            if used + size > self.limit or size > free - reserve:
                if self._counters.first(_SAID_BUDGET):
                    log.warning(
                        "shm cache: %s (%.1f MiB) and later shards that do not fit are read "
                        "from the store: the cache holds %.1f MiB of its %.1f MiB budget, "
                        "%.1f MiB free under %s (said once)",
                        name, size / MiB, used / MiB, self.limit / MiB, free / MiB,
                        self.dir.parent.parent,
                    )  # fmt: skip
                return None
            tmp.mkdir()
            fd = os.open(tmp / DATA, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)  # the pages exist now: no SIGBUS later
            except OSError:
                os.close(fd)
                raise
            return fd

    def _used(self) -> int:
        """Bytes held by this store's cache: complete copies and reserved copies."""
        return sum(
            cd.file_size(p)  # another worker's copy may be renamed or removed meanwhile
            for p in self.dir.glob("*shard-*/" + DATA)
            if p.parent.name.startswith(("shard-", cd.TMP_PREFIX))
        )

    def _budget(self, limit: int | None) -> int:
        free, reserve = _free(self.dir)
        cap = max(0, free - reserve) + self._used()
        return int(cap * DEFAULT_SHARE) if limit is None else min(limit, cap)


def _free(path: Path) -> tuple[int, int]:
    """(bytes free, bytes to leave free) on the file system of ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, min(RESERVE, st.f_blocks * st.f_frsize // 10)


# A process joins each cache directory once, however many ShmCache objects it makes.
_JOINED: dict[str, list] = {}  # cache dir -> [ShmCache objects, session token, pid]


def _join(cache: Path, info: dict, keep: bool) -> list:
    """Join ``cache`` (once per process); the process's entry of ``_JOINED``."""
    held = _JOINED.get(str(cache))
    if held is None or held[2] != os.getpid():
        held = [0, cd.join(cache, info, keep), os.getpid()]
        # A process started by multiprocessing (torch.multiprocessing.spawn'ed ranks) ends
        # in os._exit, which skips atexit and weakref finalizers, not these; a negative
        # priority runs it after multiprocessing stopped this process's daemon workers.
        multiprocessing.util.Finalize(
            None, _leave, (str(cache), os.getpid(), True), exitpriority=-10
        )
    elif not (cache / cd.USERS / cd.me()).exists():  # removed under us (cache clear --force)
        held[1] = cd.join(cache, info, keep)  # a new run: every ShmCache here uses its token
    elif keep:
        (cache / cd.KEEP).touch()
    held[0] += 1
    _JOINED[str(cache)] = held  # once joined: a failed join leaves nothing to leave
    return held


def _leave(cache: str, pid: int, exiting: bool = False) -> None:
    held = _JOINED.get(cache)
    if pid != os.getpid() or held is None or held[2] != pid:
        return  # a forked child: the parent is the user; or this process left already
    held[0] = 0 if exiting else held[0] - 1
    if held[0] == 0:
        del _JOINED[cache]
        try:
            cd.leave(Path(cache), cd.me())
        except OSError as e:
            log.warning("shm cache %s: could not unregister: %s", cache, e)


def _why(e: OSError) -> str:
    """What the system refused, and where, in words."""
    return f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e)

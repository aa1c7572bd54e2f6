"""Counters of the shard cache, shared by a process and its workers (fork or spawn)."""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
from collections.abc import Iterator

STATS = ("hits", "misses", "bytes_copied", "from_original", "replaced")
_SAID = len(STATS)  # the slot of the "said once" flags


class Counters:
    """Stats shared by a process and its workers (fork or spawn): a few int64 slots in
    shared memory, updated under an flock of ``lock_path`` (which the kernel releases when
    a holder is killed, and which needs no semaphore or resource-tracker process, as a
    multiprocessing lock would). Pickled outside a process start (where shared memory
    cannot travel), the receiver counts on its own."""

    def __init__(self, lock_path: str | os.PathLike) -> None:
        self.values = mp.RawArray("q", len(STATS) + 1)
        self.lock_path = os.fspath(lock_path)

    def __getstate__(self) -> dict:
        if mp.context.get_spawning_popen() is None:
            return {"lock_path": self.lock_path}
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        if "values" in state:
            self.__dict__.update(state)
        else:
            self.__init__(state["lock_path"])

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # the cache was removed under us: counts may race, nothing else
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def add(self, name: str, n: int = 1) -> None:
        with self._locked():
            self.values[STATS.index(name)] += n

    def first(self, flag: int) -> bool:
        """True the first time ``flag`` is asked in this process tree."""
        with self._locked():
            said = self.values[_SAID] & flag
            self.values[_SAID] |= flag
        return not said

    def as_dict(self) -> dict[str, int]:
        return {name: int(self.values[i]) for i, name in enumerate(STATS)}

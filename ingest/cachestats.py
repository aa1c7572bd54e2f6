"""Counters of the shard cache, shared by a process and its workers (fork or spawn)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
from collections.abc import Iterator

STATS = ("hits", "misses", "bytes_copied", "from_original", "replaced")
_SAID = len(STATS)  # the slot of the "said once" flags


class Counters:
    """Stats shared by a process and its workers (fork or spawn): a few int64 slots in
    shared memory. Pickled outside a process start (where shared memory cannot travel),
    the receiver counts on its own."""

    def __init__(self) -> None:
        self.values = mp.RawArray("q", len(STATS) + 1)
        self.lock = mp.get_context("spawn").Lock()  # one that fork and spawn children take

    def __getstate__(self) -> dict:
        if mp.context.get_spawning_popen() is None:
            return {}
        return self.__dict__

    def __setstate__(self, state: dict) -> None:
        if state:
            self.__dict__.update(state)
        else:
            self.__init__()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        # A worker killed while holding the lock must not stop the others: after a second
        # they go ahead (a count might then be off by one; nothing else depends on it).
        held = self.lock.acquire(timeout=1.0)
        try:
            yield
        finally:
            if held:
                self.lock.release()

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

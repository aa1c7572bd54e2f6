"""CPU time and memory of a process tree (this process and its descendants), from /proc.

A pipeline's cost is that of its whole tree: the main process, its threads (DALI) and its
worker processes (torch, ours). Linux only; elsewhere the figures are None.
"""

from __future__ import annotations

import os
import threading

MiB = 1 << 20
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def descendants(pid: int | None = None) -> list[int]:
    """Process ids of every live descendant of ``pid`` (default: this process)."""
    found, todo = [], [pid or os.getpid()]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(p) for p in f.read().split()]
            except OSError:
                continue
            found += kids
            todo += kids
    return sorted(set(found))


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of all threads of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def tree_cpu_seconds() -> float:
    """CPU seconds used so far by this process, its reaped children and its live descendants."""
    t = os.times()
    own = t.user + t.system + t.children_user + t.children_system
    return own + sum(_cpu_seconds(p) for p in descendants())


def _status(pid: int) -> dict[str, float]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssShmem"):
                    out[key] = int(value.split()[0]) / 1024
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Private_Dirty:"):
                    out["PrivateDirty"] = int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def tree_memory_mib() -> float:
    """Memory the pipeline owns, in MiB: this process's anonymous and shared memory (a batch
    ring once) plus each descendant's private dirty pages; libraries and page cache left out
    (summing each process's RSS would count shared pages once per worker)."""
    main = _status(os.getpid())
    total = main.get("RssAnon", 0.0) + main.get("RssShmem", 0.0)
    total += sum(_status(p).get("PrivateDirty", 0.0) for p in descendants())
    return round(total, 1)


class PeakMemory:
    """Samples ``tree_memory_mib`` in a thread every ``interval`` seconds; ``peak`` is the
    largest value seen between ``start()`` and ``stop()`` (the last sample included)."""

    def __init__(self, interval: float = 0.25) -> None:
        self.interval = interval
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, tree_memory_mib())

    def start(self) -> PeakMemory:
        self.peak = tree_memory_mib()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-memory", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> float:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        self.peak = max(self.peak, tree_memory_mib())
        return self.peak

"""How many cores this process may use."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a cgroup cpuset,
    ``torchrun --numa-binding``), which ``os.cpu_count()`` ignores: it counts the machine's."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def half_the_cores(at_most: int) -> int:
    """Threads for a pool beside the workers: half the usable cores, at most ``at_most``,
    at least one."""
    return max(1, min(at_most, usable_cores() // 2))

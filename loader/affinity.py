"""``pin_training_thread=True``: the thread that iterates the DataLoader runs alone on one
logical CPU (the first of the process's CPU set), and the workers and every other thread of
the process (the loader's GPU stage and decode threads, DALI's, autograd's) on the others,
while an iteration runs; when it ends, every thread goes back to the whole set. Why: the
loader's threads sharing the training loop's core slow its launches (docs/gpu.md).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

SWEEPS = 2  # batches of an iteration after which the threads are placed again (see take)
_TASKS = "/proc/self/task"
_split: frozenset[int] | None = None  # the CPU set a split in force came from


@dataclass(frozen=True)
class Cores:
    """The training thread's CPU and everyone else's."""

    own: int
    rest: frozenset[int]


def plan(pin: bool) -> Cores | None:
    """The split for ``pin_training_thread=pin``, from the process's CPU set.

    Raises:
        ValueError: fewer than two usable CPUs, or a system without per-thread affinity.
    """
    if not pin:
        return None
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir(_TASKS):
        raise ValueError("pin_training_thread=True needs Linux's CPU affinity; leave it False")
    cores = sorted(_split or os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(
            f"pin_training_thread=True needs at least 2 usable cores and this process has "
            f"{len(cores)}; leave it False"
        )
    return Cores(cores[0], frozenset(cores[1:]))


def take(cores: Cores | None) -> None:
    """In the iterating thread: it alone on ``own``, every other thread of the process on
    ``rest``. A thread inherits its creator's CPUs, and the loader's threads, DALI's and
    autograd's start with the first batches: an iteration calls this as it starts and after
    each of its first ``SWEEPS`` batches."""
    global _split
    if cores is None:
        return
    _split = cores.rest | {cores.own}
    me = threading.get_native_id()
    for tid in _threads():
        if tid != me:
            _place(tid, cores.rest)
    _place(0, {cores.own})


def release(cores: Cores | None) -> None:
    """Every thread of the process back on the whole CPU set (an iteration ended): what
    starts from the training thread afterwards (other loaders' workers, torch's threads,
    subprocesses) is not confined to its one CPU."""
    global _split
    if cores is None or _split is None:
        return
    for tid in _threads():
        _place(tid, _split)
    _split = None


def leave(cores: Cores | None, pid: int = 0) -> None:
    """A worker (``pid``, or the calling process) on the CPUs but the training thread's."""
    if cores is not None:
        _place(pid, cores.rest)


def _threads() -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(_TASKS)]
    except OSError:  # gone since the check: nothing placed, nothing raised in the loop
        return []


def _place(tid: int, cpus) -> None:
    with contextlib.suppress(OSError):  # a thread just ended, a CPU set changed since
        os.sched_setaffinity(tid, cpus)

"""``pin_training_thread=True``: the thread that iterates the DataLoader runs alone on one
core (the first of the process's CPU set); the workers and every other thread of the
process (the loader's GPU stage and decode threads, DALI's, torch's) run on the others.

Sharing a core with the loader's own threads slowed a training step's launches: ResNet-50
in timm's loop went from 84% to 92% of its synthetic speed with the threads kept apart by
hand (docs/design/augmentations.md, "Fused layers, and what limits now").
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

SWEEPS = 2  # batches of an iteration after which the threads are placed again (see take)


@dataclass(frozen=True)
class Cores:
    """The training thread's core and everyone else's."""

    own: int
    rest: frozenset[int]


def plan(pin: bool) -> Cores | None:
    """The split for ``pin_training_thread=pin``, taken from the process's CPU set now.

    Raises:
        ValueError: fewer than two usable cores, or a system without CPU affinity.
    """
    if not pin:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("pin_training_thread=True needs CPU affinity (Linux); leave it False here")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(
            f"pin_training_thread=True needs at least 2 usable cores and this process has "
            f"{len(cores)}; leave it False"
        )
    return Cores(cores[0], frozenset(cores[1:]))


def take(cores: Cores | None) -> None:
    """In the iterating thread: this thread alone on ``own``, every other thread of the
    process on ``rest``. A thread inherits its creator's cores, and the loader's threads,
    DALI's and autograd's start with the first batches, so an iteration calls this as it
    starts and after each of its first ``SWEEPS`` batches."""
    if cores is None:
        return
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != me:
            with contextlib.suppress(OSError):  # a thread that has just ended
                os.sched_setaffinity(int(tid), cores.rest)
    with contextlib.suppress(OSError):  # a CPU set changed since (a container's): as it was
        os.sched_setaffinity(0, {cores.own})


def leave(cores: Cores | None) -> None:
    """In a worker as it starts: the cores but the training thread's."""
    if cores is not None:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores.rest)

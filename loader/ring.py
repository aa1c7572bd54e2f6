"""Ring: the named batch buffers the workers fill, in shared memory, checked to fit.

A slot holds one batch; the workers (``loader.workers``) write it and the training process
reads it in place. A full /dev/shm would kill the process that touches a missing page
(SIGBUS) at any hour, so the ring's size is checked against the free space when it is made.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch


class Slot(dict):
    """One slot's tensors by name, made once with the ring, not per batch: making views
    costs the interpreter of the thread that reads the batch."""

    @functools.cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        """The tensors' numpy views (the same memory), made on first use."""
        return {name: t.numpy() for name, t in self.items()}


class Ring:
    """Named buffers of ``slots`` batch slots each, in shared memory when ``shared``.

    Args:
        layout: name -> (shape of one slot, numpy dtype name), from a producer's ``buffers()``.
        slots: number of slots (batches in flight).
        shared: allocate in shared memory, for worker processes.
    """

    def __init__(self, layout: dict[str, tuple[tuple[int, ...], str]], slots: int, shared: bool):
        self.slots = slots
        if shared:
            check_shared_memory(ring_bytes(layout, slots))
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, dtype) in layout.items():
            t = torch.empty((slots, *shape), dtype=getattr(torch, dtype))
            self.tensors[name] = t.share_memory_() if shared else t
        self._slots = [Slot((name, t[i]) for name, t in self.tensors.items()) for i in range(slots)]

    def slot(self, i: int) -> Slot:
        """Slot ``i``: the same object at each call (its entries are not to be changed);
        what it shows is the batch's until the slot is handed out again."""
        return self._slots[i]


def ring_bytes(layout: dict[str, tuple[tuple[int, ...], str]], slots: int) -> int:
    """Bytes of a ring of ``slots`` slots of ``layout``."""
    return slots * sum(
        int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in layout.values()
    )


SHM = "/dev/shm"


def shm_free() -> int | None:
    """Free bytes where shared memory lives (/dev/shm); None where there is no such place."""
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_shared_memory(need: int) -> None:
    """Raise unless ``need`` bytes of shared memory are free: a full /dev/shm would kill the
    process that touches the missing pages (SIGBUS), at any hour, not now. Free space counts
    only pages already written, so rings made at once by several processes (DDP ranks)
    are each checked alone."""
    free = shm_free()
    if free is not None and need > free:
        raise RuntimeError(
            f"the DataLoader's batch ring needs {need / 2**20:,.0f} MiB of shared memory and "
            f"{SHM} has {free / 2**20:,.0f} MiB free: give it more (in Docker, "
            "`--shm-size`), or lower batch_size, num_workers or prefetch_factor"
        )

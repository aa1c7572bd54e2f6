"""MappedRows: the ring's pixel rows read by a kernel where the workers wrote them.

The rows the workers decode on the CPU (the GPU path's CPU share, and the images the GPU
decoder rejects) lie in the ring's shared memory, one row per sample of the slot. Sending
them to the device through a pinned buffer takes a copy on the CPU first, row by row and
holding the GIL (``augment_gpu.gather``): 0.44 ms for 25 rows of 224x224x3 and 1.0 ms for
76 on the H200, while the training loop's thread waits for the GIL. Here the ring's pixel
buffer is registered with CUDA once (page-locked and mapped into the device's address
space: ``cudaHostRegister``), and one gather kernel reads a batch's rows straight from it:
0.03 ms of the thread's time for 25 or 76 rows, the rows on the device 0.11 and 0.26 ms
later (``benchmarks/pinned_slot_probe.py``, ``gpu-h200-s38-pinned-slot.log``).

The ring is shared memory (``MAP_SHARED``): workers forked after the registration write the
same pages, no copy-on-write between them and the device's view. A slot goes back to the
workers only once the batch's GPU work is done (``loader.prefetch``), the gather included.
Where the memory cannot be registered or read this way (no unified addressing, a driver
that refuses), ``rows`` returns None and the caller copies the rows as before.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np
import torch

_MAPPED_AND_PORTABLE = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _DeviceView:
    """A host address seen as a device array (``__cuda_array_interface__``): with unified
    addressing, registered host memory has the same address on the device."""

    def __init__(self, address: int, shape: tuple[int, ...]) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "|u1", "data": (address, False), "version": 3,
            "strides": None,
        }  # fmt: skip


def _unregister(address: int, device: torch.device, array: torch.Tensor) -> None:
    """Undo the registration of ``array`` (held until now so that its memory outlives it),
    once the device's work that may read it is done."""
    with contextlib.suppress(Exception):  # an interpreter shutting CUDA down: nothing to undo
        torch.cuda.synchronize(device)
        torch.cuda.cudart().cudaHostUnregister(address)
    del array


class MappedRows:
    """The rows of ``array`` (a contiguous uint8 CPU tensor of ``slots`` slots of rows, the
    ring's pixel buffer) gathered on ``device`` by a kernel reading the host memory.

    Registered at the first ``rows`` call (a loader whose workers decode nothing pins
    nothing), undone by ``release`` (the loader closed; a later call registers again) or
    when this object is let go of."""

    def __init__(self, array: torch.Tensor, device: torch.device) -> None:
        self.array, self.device = array, device
        self._view: torch.Tensor | None = None  # the device's view of ``array``
        self._failed = False
        self._finalizer: weakref.finalize | None = None
        self._lock = threading.Lock()  # decode threads of the GPU path call ``rows`` at once

    def rows(self, slot: np.ndarray, rows: torch.Tensor) -> torch.Tensor | None:
        """``slot[rows]`` on the device, on the current stream (``slot``: a numpy view of
        one slot of the array; ``rows``: row numbers, on the device); None where the array
        cannot be read this way (then it never is)."""
        offset = slot.__array_interface__["data"][0] - self.array.data_ptr()
        per_slot = self.array[0].nbytes
        if offset < 0 or offset % per_slot or offset // per_slot >= len(self.array):
            return None  # not one of its slots
        with self._lock:
            view = self._mapped(offset // per_slot)
        if view is None:
            return None
        return view[offset // per_slot].index_select(0, rows)

    def release(self) -> None:
        """Undo the registration (after the device's work that may read the array)."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = self._view = None

    def _mapped(self, held: int) -> torch.Tensor | None:
        """The device's view of the array, registered where it is not yet; checked on
        slot ``held``, which no worker writes meanwhile."""
        if self._view is not None or self._failed:
            return self._view
        address, shape = self.array.data_ptr(), tuple(self.array.shape)
        rt = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            if int(rt.cudaHostRegister(address, self.array.nbytes, _MAPPED_AND_PORTABLE)):
                self._failed = True
                # The refusal is also this thread's last CUDA error, which torch's check
                # after its next kernel launch would raise there: a launch checked here
                # takes it.
                with contextlib.suppress(RuntimeError):
                    torch.zeros(1, device=self.device)
                return None
        self._finalizer = weakref.finalize(self, _unregister, address, self.device, self.array)
        try:
            view = torch.as_tensor(_DeviceView(address, shape), device=self.device)
            probe = view[held].reshape(-1)[:4096].cpu()  # the device reads what the host holds
            same = torch.equal(probe, self.array[held].reshape(-1)[:4096])
        except RuntimeError:
            same = False
        if not same:
            self._release()
            self._failed = True
            return None
        self._view = view
        return view

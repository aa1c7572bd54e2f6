"""MappedRows: a ring buffer's rows read by the device where the workers wrote them.

The rows the workers decode on the CPU (the GPU path's CPU share, and the images the GPU
decoder rejects) lie in the ring's shared memory. Sending them through a pinned buffer
takes a copy on the CPU first, row by row and holding the GIL (``host_arrays.gather``), while
the training loop's thread waits for it. Here the ring's pixel buffer is registered with
CUDA once (``cudaHostRegister``: page-locked, mapped into the device's address space) and
one gather kernel reads a batch's rows straight from it; a pixel store's windows, in the
byte buffer, are copied by DMA from its registered pages (``span``). The ring is
``MAP_SHARED``, so workers forked after the registration write the same pages; a slot
goes back to them only once the batch's GPU work, the copies included, is done
(``loader.gpu.prefetch``). Where the memory cannot be registered or read so, ``rows`` and
``span`` return None and the caller copies.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import numpy as np
import torch

_MAPPED_AND_PORTABLE = 3  # cudaHostRegisterPortable | cudaHostRegisterMapped


class DeviceView:
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
    """The slots of ``array`` (a contiguous uint8 CPU tensor of ``slots`` slots: the ring's
    pixel rows, or its byte buffer) read on ``device`` where they lie: rows gathered by a
    kernel reading the host memory (``rows``), or a span copied by DMA (``span``).

    Registered at the first such call (a loader that sends nothing this way pins
    nothing), undone by ``release`` (the loader closed; a later call registers again) or
    when this object is let go of."""

    def __init__(self, array: torch.Tensor, device: torch.device) -> None:
        self.array, self.device = array, device
        self._address, self._per_slot = array.data_ptr(), array.nbytes // max(1, len(array))
        self._slots: list[torch.Tensor] | None = None  # the device's view of each slot
        self.failed = False  # the array cannot be read so (then it never is)
        self._finalizer: weakref.finalize | None = None
        # Decode threads of the GPU path call ``rows`` at once; ``release`` must not undo
        # the registration between a gather's view and its launch.
        self._lock = threading.Lock()

    def rows(self, slot: np.ndarray, rows: torch.Tensor) -> torch.Tensor | None:
        """``slot[rows]`` on the device, on the current stream (``slot``: a numpy view of
        one slot of the array; ``rows``: row numbers, on the device); None where ``slot``
        is not one of the array's, or the array cannot be read this way (``failed``)."""
        k = self._slot_of(slot)
        if k is None:
            return None
        with self._lock:
            slots = self._mapped(k)
            return None if slots is None else slots[k].index_select(0, rows)

    def span(self, slot: np.ndarray, nbytes: int) -> torch.Tensor | None:
        """The first ``nbytes`` of ``slot`` (a numpy view of one slot of a byte array) on
        the device, copied by DMA without blocking, on the current stream; None as for
        ``rows``."""
        k = self._slot_of(slot)
        if k is None:
            return None
        with self._lock:
            if self._mapped(k) is None:
                return None
            return self.array[k][:nbytes].to(self.device, non_blocking=True)

    def _slot_of(self, slot: np.ndarray) -> int | None:
        """Which of the array's slots ``slot`` is (None: not one of them)."""
        k, rest = divmod(slot.__array_interface__["data"][0] - self._address, self._per_slot)
        return None if k < 0 or rest or k >= len(self.array) else k

    def release(self) -> None:
        """Undo the registration (after the device's work that may read the array)."""
        with self._lock:
            self._release()

    def _release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = self._slots = None

    def _mapped(self, held: int) -> list[torch.Tensor] | None:
        """The device's views of the array's slots, registered where it is not yet;
        checked on slot ``held``, which no worker writes meanwhile: the view must be the
        host memory itself (not a copy torch made of it) and a kernel must read there
        what the host holds."""
        if self._slots is not None or self.failed:
            return self._slots
        address, shape = self._address, tuple(self.array.shape)
        rt = torch.cuda.cudart()
        with torch.cuda.device(self.device):
            if int(rt.cudaHostRegister(address, self.array.nbytes, _MAPPED_AND_PORTABLE)):
                self.failed = True
                # The refusal is also this thread's last CUDA error, which torch's check
                # after its next kernel launch would raise there: a launch checked here
                # takes it (``fill_``: a kernel, checked by ``C10_CUDA_KERNEL_LAUNCH_CHECK``).
                with contextlib.suppress(RuntimeError):
                    torch.zeros(1, device=self.device)
                return None
        self._finalizer = weakref.finalize(self, _unregister, address, self.device, self.array)
        try:
            view = torch.as_tensor(DeviceView(address, shape), device=self.device)
            first = torch.zeros(1, dtype=torch.int64, device=self.device)
            read = view[held].index_select(0, first).cpu()  # a kernel reads the host memory
            same = view.data_ptr() == address and torch.equal(read, self.array[held][:1])
        except RuntimeError:
            same = False
        if not same:
            self._release()
            self.failed = True
            return None
        self._slots = list(view.unbind(0))
        return self._slots

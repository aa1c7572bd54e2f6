"""HostMemory: CPU buffers for delivered batches, reused once nothing refers to them; and
``trim_heap``, which gives malloc's free memory back to the system.

A fresh batch's pages are faulted in and zeroed by the kernel when it is first written,
in the main process (docs/design/loader.md). So delivered batches live in anonymous
mappings (transparent huge pages where the kernel allows) wrapped by ``torch.frombuffer``,
which holds a reference to its mapping for as long as the storage lives: while any tensor,
view, numpy array or autograd graph still uses the batch. A mapping whose only reference is
ours is free, and the next batch of the same size is written into it.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import numpy as np
import torch

_MIN_BYTES = 1 << 22  # smaller batches are cheap to allocate: plain torch.empty


def _free_refcount() -> int | None:
    """What ``sys.getrefcount`` reads for a mapping held only by our list, or None when a
    tensor over it does not raise that count (another interpreter's rules): then no reuse."""
    held = [mmap.mmap(-1, mmap.PAGESIZE)]
    free = sys.getrefcount(held[0])
    view = torch.frombuffer(held[0], dtype=torch.uint8)
    used = sys.getrefcount(held[0])
    del view
    return free if used > free and sys.getrefcount(held[0]) == free else None


_FREE_REFS = _free_refcount()


class HostMemory:
    """Hands out CPU tensors, recycling the mappings of batches that are no longer used.

    Args:
        keep: mappings to remember; a user who holds on to more batches than this gets
            new memory, and the batches they hold are freed by Python as usual.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._maps: list[mmap.mmap] = []

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` and ``dtype``, not shared with any live one."""
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        if nbytes < _MIN_BYTES:
            return torch.empty(shape, dtype=dtype)
        for i in range(len(self._maps) if _FREE_REFS is not None else 0):
            # A live storage over the mapping holds a reference to it.
            if len(self._maps[i]) == nbytes and sys.getrefcount(self._maps[i]) == _FREE_REFS:
                return torch.frombuffer(self._maps[i], dtype=dtype).view(shape)
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            buf.madvise(mmap.MADV_HUGEPAGE)
        self._maps.append(buf)
        del self._maps[: -self.keep]  # forget the oldest: they are unmapped once unused
        return torch.frombuffer(buf, dtype=dtype).view(shape)


def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


_MALLOC_TRIM = _malloc_trim()


def trim_heap() -> bool:
    """Give the memory glibc's malloc holds free back to the system (``malloc_trim(0)``);
    True where it gave some. What a DALI pipeline's threads freed stays resident after
    the pipeline is gone, free in malloc's arenas (with torchvision's nvJPEG nothing
    grows). A no-op where malloc is not glibc's."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))

"""A slot's small host arrays onto the device from the stage's thread, keeping the GIL.

The stage's thread shares the interpreter with the training loop. Each torch call gives up
the GIL and may wait up to a switch interval (5 ms) to get it back from a busy loop, and
numpy and torch give it up around large copies: so the small arrays of a batch (tables,
labels, rows) cross in one pinned buffer and one copy (``upload``), copied into it by plain
memcpys that keep the GIL (``copy_holding_gil``, ``gather``), and a batch's JPEGs are cut
out of the slot in two torch calls (``cut``).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Rows(NamedTuple):
    """``array[rows]``, for ``upload`` to gather straight into its pinned buffer (one copy
    instead of two: no intermediate array)."""

    array: np.ndarray
    rows: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.array.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.array.itemsize


def upload(device: torch.device, *arrays: np.ndarray | Rows, stats=None) -> list[torch.Tensor]:
    """``arrays`` on ``device`` through one pinned buffer and one copy, without blocking;
    the bytes copied are counted in ``stats`` (a ``LoaderStats``) as ``h2d_bytes``.

    One copy instead of one per array: each torch call of the prefetch thread gives up the
    GIL and may wait a whole switch interval (5 ms) to get it back from a busy training
    loop, so small transfers are batched.
    """
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(_host(a))) for a in arrays]
    sizes = slot_sizes(arrays)
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True)
    flat, at = host.numpy(), 0
    for a, size in zip(arrays, sizes, strict=True):
        target = flat[at : at + a.nbytes].view(a.dtype).reshape(a.shape)
        if isinstance(a, Rows):
            gather(a, target)
        else:
            copy_holding_gil(target, a)
        at += size
    dev = host.to(device, non_blocking=True)
    if stats is not None:
        stats.add(h2d_bytes=host.nbytes)
    return unpack(dev, arrays, sizes)


def slot_sizes(arrays) -> list[int]:
    """Bytes of each array's slot in ``upload``'s buffer: its own, rounded up to 16, so that
    a kernel's pointer arguments keep one alignment from batch to batch (Triton compiles a
    kernel again for a pointer's alignment)."""
    return [-(-a.nbytes // 16) * 16 for a in arrays]


def unpack(flat: torch.Tensor, arrays, sizes: list[int]) -> list[torch.Tensor]:
    """Views of ``flat`` (uint8) laid out as ``arrays`` in slots of ``sizes`` bytes: their
    shapes and dtypes. Slicing keeps the GIL, a view call lets it go: only the views that
    change something are made."""
    out, at = [], 0
    for a, size in zip(arrays, sizes, strict=True):
        t = flat[at : at + a.nbytes]
        if a.dtype != np.uint8:
            t = t.view(_TORCH_DTYPES[a.dtype.type])
        out.append(t.view(a.shape) if len(a.shape) != 1 else t)
        at += size
    return out


def copy_holding_gil(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` (C-contiguous ``dst``, same bytes) as one memcpy that keeps the
    GIL. numpy and torch let the GIL go around a large copy, and a thread that lets it go
    waits for a busy one (the training loop) to drop it: up to a switch interval (5 ms)
    each time."""
    if dst.nbytes:  # (memoryview cannot cast an empty array)
        view = memoryview(dst).cast("B")
        view[:] = memoryview(np.ascontiguousarray(src)).cast("B")


def gather(rows: Rows, target: np.ndarray) -> None:
    """Write ``rows.array[rows.rows]`` into ``target`` (C-contiguous), row by row, keeping
    the GIL (see ``copy_holding_gil``; ``np.take`` and ``torch.index_select`` both let it
    go)."""
    src = rows.array
    if not target.nbytes:
        return
    if not src.flags.c_contiguous:
        np.take(src, rows.rows, axis=0, out=target)
        return
    size = src[0].nbytes if len(src) else 0
    into, source = memoryview(target).cast("B"), memoryview(src).cast("B")
    for k, j in enumerate(rows.rows.tolist()):
        into[k * size : (k + 1) * size] = source[j * size : (j + 1) * size]


def cut(data: torch.Tensor | np.ndarray, starts: list[int], lengths: list[int]) -> list:
    """``[data[s : s + m] for s, m in zip(starts, lengths)]``; for a tensor, in two torch
    calls where the spans come in order without overlap (as the workers pack a batch's
    JPEGs): each torch call lets the GIL go, which beside a busy Python thread makes a
    batch's 256 slices cost milliseconds. numpy slices keep it."""
    if not starts or not isinstance(data, torch.Tensor):
        return [data[s : s + m] for s, m in zip(starts, lengths, strict=True)]
    sizes, end = [], starts[0]
    for s, m in zip(starts, lengths, strict=True):
        if s < end or m < 0:  # out of order or overlapping: one slice each
            return [data[s : s + m] for s, m in zip(starts, lengths, strict=True)]
        sizes += (s - end, m)  # the gap before the span (maybe 0), then the span
        end = s + m
    return list(data[starts[0] : end].split(sizes)[1::2])


def _host(a: np.ndarray | Rows) -> np.ndarray:
    return a.array[a.rows] if isinstance(a, Rows) else a


_TORCH_DTYPES = {
    np.uint8: torch.uint8, np.int32: torch.int32, np.int64: torch.int64,
    np.float32: torch.float32, np.float64: torch.float64,
}  # fmt: skip

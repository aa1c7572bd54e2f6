"""A recipe's uint8 batch normalised, cast, erased and laid out in one launch.

``BatchSteps`` ends a batch with its normalisation, cast, RandomErasing and memory format:
as torch ops, 23 a batch with a constant fill and some 75 with noise, launched from the
stage's thread (each letting the GIL go and taking it back beside the training loop) and
most of them a pass over the batch. Here they are one Triton kernel (``erase_kernels``)
fed a small table of boxes and the 256 levels' normalised values (made once, by the torch
op used before): the same values as those ops (tests/loader/gpu/test_normalise.py), the
erasing noise the same pure function of its coordinates (``loader.ops.noise``).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from loader.ops import noise
from loader.ops.erasing import RandomErasing
from loader.ops.upload import on_device

_BLOCK = 1024  # pixels of one sample a program
_FILLS = {None: 0, "const": 1, "channel": 2, "pixel": 3}  # erase_kernels' NONE, CONST, ...


@functools.lru_cache(maxsize=16)
def _constant(value: tuple[float, ...], dtype: torch.dtype) -> list[float]:
    """The erasing constant as ``erasing.apply`` casts it (then exact in float32)."""
    return torch.tensor(value, dtype=dtype).float().tolist()


def affine(mean, std) -> tuple[list[float], list[float]]:
    """``ToTensor`` + ``Normalize(mean, std)`` on 0..255 levels as ``x * scale + bias``: the
    (scale, bias) of each channel, computed in float64."""
    std64 = np.asarray(std, dtype=np.float64)
    return (1.0 / (255.0 * std64)).tolist(), (-np.asarray(mean, dtype=np.float64) / std64).tolist()


def levels(scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each channel's 256 levels normalised (float32 [3, 256] on the tensors' device), by
    the op that normalises a batch: ``addcmul(bias, x, scale)`` ([1, 3, 1, 1] each)."""
    x = torch.arange(256, dtype=torch.float32, device=scale.device).view(1, 1, 1, 256)
    return torch.addcmul(bias, x, scale).view(3, 256).contiguous()


def erase_rows(boxes: np.ndarray | None, seed: int, n: int) -> np.ndarray:
    """The kernel's rows (int64 [n, 5]): each sample's box of ``boxes`` (``erasing.draw``'s;
    None: none) and the key of its noise for the batch's noise ``seed``."""
    rows = np.zeros((n, 5), dtype=np.int64)
    if boxes is not None:
        rows[:, :4] = boxes
        rows[:, 4] = noise.keys(seed, np.arange(n))
    return rows


def normalise_erase(
    x: torch.Tensor,
    table: torch.Tensor,
    dtype: torch.dtype,
    memory_format: torch.memory_format,
    erasing: RandomErasing | None = None,
    boxes: np.ndarray | None = None,
    seed: int = 0,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` (uint8 [N, 3, H, W], any strides) through ``table`` (``levels``: on ``x``'s
    device), cast to ``dtype``, in ``memory_format``; then each sample's box of ``boxes``
    (``erasing.draw``'s) filled as ``erasing.apply(..., seed=seed)`` fills it. ``rows``:
    ``erase_rows(boxes, seed, N)`` already on the device, where the caller has them."""
    from loader.gpu import erase_kernels

    n, c, h, w = x.shape
    if x.dtype != torch.uint8 or c != 3 or table.shape != (3, 256):
        raise ValueError(f"normalise_erase takes uint8 [N, 3, H, W] and a [3, 256] table, "
                         f"not {x.dtype} {tuple(x.shape)} and {tuple(table.shape)}")  # fmt: skip
    out = torch.empty((n, c, h, w), dtype=dtype, device=x.device, memory_format=memory_format)
    if n == 0:
        return out
    fill, values = None, (0.0, 0.0, 0.0)
    if erasing is not None and boxes is not None and boxes[:, 2].any():
        fill = erasing.fill
        values = _constant(tuple(erasing.value), dtype)
    if rows is None:
        rows = on_device(erase_rows(boxes if fill is not None else None, seed, n), x.device)
    erase_kernels.normalise_erase[(-(-h * w // _BLOCK), n)](
        x, out, table, rows, h, w, *x.stride(), *out.stride(), *values,
        FILL=_FILLS[fill], BLOCK=_BLOCK,
    )  # fmt: skip
    return out

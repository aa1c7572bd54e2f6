"""Normal noise as a pure function of (seed, sample, channel, row, column).

RandomErasing's noise must be the same whichever path fills the box: the GPU path fills a
whole batch at once, the CPU path box by box, and torch's generators give other values
on another device, shape or order. Here each value is a hash of its coordinates (a 32-bit
integer hash, in int64 arithmetic that never overflows, so the CPU and CUDA agree) made
into two uniforms and one normal (Box-Muller, float64, then float32).
"""

from __future__ import annotations

import numpy as np
import torch

_MASK = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x5BD1E995  # both below 2**31: a product of two stays below 2**63
_SECOND = 0x68E31DA4  # the second uniform's stream


def _hash32(x):
    """A 32-bit integer hash of ``x`` in 0..2**32 (int64 tensors, numpy ints or ints)."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def keys(seed: int, samples: np.ndarray) -> np.ndarray:
    """Each sample's key (int64, 32 bits) for the batch noise ``seed`` (any int)."""
    seed = int(seed) & (2**64 - 1)
    low, high = seed & _MASK, seed >> 32
    samples = np.asarray(samples, dtype=np.int64) & _MASK
    return _hash32(low ^ _hash32(high ^ _hash32(samples)))


def normal(key: torch.Tensor, channels: int, ys: torch.Tensor, xs: torch.Tensor, size):
    """Noise [n, channels, len(ys), len(xs)] float32 of the samples of ``key`` (int64 [n]) at
    rows ``ys`` and columns ``xs`` (int64) of images ``size`` (H, W): a pixel's value does
    not depend on which others are drawn with it."""
    h, w = size
    c = torch.arange(channels, dtype=torch.int64, device=key.device).view(1, -1, 1, 1)
    index = (c * h + ys.view(1, 1, -1, 1)) * w + xs.view(1, 1, 1, -1)
    first = _hash32(key.view(-1, 1, 1, 1) ^ _hash32(index & _MASK))
    second = _hash32(first ^ _SECOND)
    u1 = (first.double() + 0.5) * (1.0 / 2**32)
    u2 = (second.double() + 0.5) * (1.0 / 2**32)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * np.pi) * u2)).float()

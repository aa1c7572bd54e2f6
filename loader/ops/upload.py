"""Host values onto the ops' device without making the host wait for it.

A plain ``torch.from_numpy(a).to("cuda")`` copies from pageable memory and synchronises
the stream: the ops run on the GPU path's side stream, and a wait there for each of a
batch's dozens of small tables stalled the stage behind the training's own kernels. Here
the values go through pinned memory (torch's caching host allocator, which keeps a block
until its copy is done) and are copied asynchronously; on the CPU they are used as they are.
"""

from __future__ import annotations

import functools

import numpy as np
import torch


def on_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (an array or a list) as a tensor on ``device``, in ``dtype`` if given."""
    device = torch.device(device)
    t = torch.from_numpy(np.ascontiguousarray(values))
    if dtype is not None:
        t = t.to(dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=64)
def constant(values: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A small constant table on ``device``, made once (callers must not write to it)."""
    return torch.tensor(values, dtype=dtype).to(device)

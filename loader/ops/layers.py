"""Run the layers of an auto-augmentation policy over a batch, the samples grouped by op.

A policy's parameters hold, for each layer, the op each sample chose (-1: none) and that
op's own columns. ``apply_layers`` runs each layer op by op: the rows that chose op k go
through it together (``index_select``, the op, ``index_copy``), so a batch costs a few
kernels per op, and one image (a worker's call) costs no copies at all; or group by group,
where a policy runs several ops as one (every warp in one ``grid_sample``, every
pointwise tone op in one lookup).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from loader.ops.upload import on_device

Op = Callable[[torch.Tensor, np.ndarray], torch.Tensor]  # (samples, their columns) -> samples


def on_rows(x: torch.Tensor, rows: np.ndarray, fn: Callable[[torch.Tensor], torch.Tensor]):
    """``x`` with ``fn`` applied to its samples ``rows`` (the others as they are)."""
    if len(rows) == len(x):
        return fn(x)
    at = on_device(rows, x.device)
    return x.index_copy(0, at, fn(x.index_select(0, at)))


def apply_layers(
    x: torch.Tensor,
    params: np.ndarray,
    ops: Sequence[Op | None],
    layers: int,
    width: int,
    groups: Sequence[tuple[frozenset, Callable]] = (),
) -> torch.Tensor:
    """``x`` through the first ``layers`` groups of ``width`` columns of ``params``: a
    layer's first column is the op (an index of ``ops``; -1 or a None op: left as it is),
    the others its arguments. ``groups`` (op indices, ``fn(samples, their op codes, their
    columns)``) run the samples that chose any of those ops together, in one call: fewer,
    larger kernels than op by op. ``x`` itself is never written: the groups go into one
    copy."""
    source = x.untyped_storage().data_ptr()
    grouped = {int(k) for members, _ in groups for k in members}

    def through(x, rows, fn):
        if len(rows) == len(x):
            return fn(x, rows)
        if x.untyped_storage().data_ptr() == source:
            x = x.clone()
        at = on_device(rows, x.device)
        return x.index_copy_(0, at, fn(x.index_select(0, at), rows))

    for j in range(layers):
        layer = params[:, j * width : (j + 1) * width]
        code = layer[:, 0].astype(np.int64)
        for members, fn in groups:
            rows = np.flatnonzero(np.isin(code, list(members)))
            if len(rows):
                x = through(x, rows, lambda s, r, fn=fn, c=code, a=layer: fn(s, c[r], a[r, 1:]))
        for k in np.unique(code):
            if k < 0 or ops[k] is None or int(k) in grouped:
                continue
            rows = np.flatnonzero(code == k)
            x = through(x, rows, lambda s, r, k=k, a=layer: ops[k](s, a[r, 1:]))
    return x


def by_mode(x: torch.Tensor, modes: np.ndarray, names: Sequence[str], fn) -> torch.Tensor:
    """``x`` with ``fn(samples, rows, names[m])`` run on the samples of each mode code m
    (an interpolation chosen per sample)."""
    for m in np.unique(modes):
        rows = np.flatnonzero(modes == m)
        x = on_rows(x, rows, lambda s, rows=rows, m=m: fn(s, rows, names[int(m)]))
    return x

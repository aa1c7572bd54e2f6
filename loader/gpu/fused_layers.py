"""timm's RandAugment and AutoAugment on the GPU path: a layer of a batch in three launches.

The torch ops of ``loader.ops.timm_augment`` (the CPU path's, and the reference) cost a few
kernels per op per layer, and the Python that launches them ran on the stage's thread,
beside the training loop's, for every batch. Here a layer is one table of a row per sample
(its op's kind, factor, interpolation and matrix, made on the host from the same draws, by
a worker: ``loader.gpu.step_tables``), its LUTs, and three Triton kernels
(``layer_kernels``): the statistics the sample's op needs (histograms, extremes, luma),
the LUTs, then the layer itself, each sample's op from the table. The same pixels as the
torch ops but for the rounding of a fused multiply-add (tests/loader/gpu/test_fused_layers.py).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from loader.ops import tone
from loader.ops.geometry import MODES, from_pil, inverse_matrices, turns
from loader.ops.timm_augment import TimmAutoAugment, TimmRandAugment
from loader.ops.timm_ops import GEOMETRIC, POINTWISE, affine_data, base_name
from loader.ops.upload import on_device

_BLOCK = 1024  # pixels of one sample a program
_STATS = {"AutoContrast": 6, "Equalize": 7, "Contrast": 8}  # layer_kernels' kinds
_COPY, _LUT, _COLOR, _SHARP, _WARP, _TURN = range(6)
COLS = 12  # layer_kernels.COLS
_KNOWN = {"", *POINTWISE, *_STATS, "Color", "Sharpness", "Desaturate"}


def takes(x: torch.Tensor) -> bool:
    """Whether the layers take the batch ``x``: uint8 [N, 3, H, W]."""
    return x.dtype == torch.uint8 and x.dim() == 4 and x.shape[1] == 3


def fusable(step) -> bool:
    """Whether ``step`` is one of timm's policies, which run here on a uint8 RGB batch."""
    return isinstance(step, TimmRandAugment | TimmAutoAugment)


def layer_count(step) -> int:
    """The layers of a ``fusable`` step (each op a sample takes is one layer)."""
    return _lookup(step)[0]


def warp_fill(step) -> tuple[int, ...]:
    """The fill of a ``fusable`` step's warps, as ``run_layer`` takes it."""
    return _lookup(step)[4]


def layer_tables(step, params: np.ndarray, height: int, width: int) -> list[tuple]:
    """Each layer's (table, host LUTs) (``layer_table``) of a ``fusable`` step drawn
    ``params`` on a batch of ``height`` x ``width`` images."""
    layers, names, full, modes, _ = _lookup(step)
    tables = []
    for j in range(layers):
        cols = params[:, 3 * j : 3 * j + 3]
        code = cols[:, 0].astype(np.int64)
        tables.append(layer_table(
            names[code], full[code], cols[:, 1], modes[cols[:, 2].astype(np.int64)], height, width
        ))  # fmt: skip
    return tables


def apply(step, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
    """``step.apply(x, params)``, each layer in three launches (a new tensor)."""
    for table, host in layer_tables(step, params, *x.shape[-2:]):
        x = run_layer(x, table, host, warp_fill(step))
    return x


@functools.lru_cache(maxsize=16)
def _lookup(step) -> tuple:
    """What ``apply`` looks up by op index, made once a step: (layers, the ops' base and
    full names, "" at index -1 for none; the interpolations' codes; the fill, rounded and
    clamped as ``geometry._fill`` makes it)."""
    if isinstance(step, TimmRandAugment):
        ops, layers = step.ops, step.num_layers
    else:
        ops, layers = step.flat_ops, step.layers
    names = np.asarray([base_name(op.name) for op in ops] + [""])
    full = np.asarray([op.name for op in ops] + [""])
    modes = np.asarray([MODES.index(m) for m in step.interpolation])
    fill = tuple(int(v) for v in np.clip(np.round(step.fill), 0, 255))
    return layers, names, full, modes, fill


def layer_table(names, full, arg, mode, height: int, width: int):
    """The kernels' table (float32 [n, COLS]) and the pointwise ops' host LUTs (uint8 [n,
    256]) of a layer whose samples take the ops ``names`` (timm's base names, "" for none;
    ``full``: their full names) with their arguments and interpolation codes (of MODES)."""
    unknown = {str(v) for v in np.unique(names[~np.isin(full, GEOMETRIC)])} - _KNOWN
    if unknown:  # an op timm_ops gained and the kernels were not taught
        raise ValueError(f"the fused layers do not know the ops {sorted(unknown)}")
    n = len(names)
    table = np.zeros((n, COLS), np.float32)
    kind = np.full(n, _COPY)
    factor = np.zeros(n)
    kind[np.isin(names, POINTWISE)] = _LUT
    for name, k in _STATS.items():
        kind[names == name] = k
    factor[names == "Contrast"] = arg[names == "Contrast"]
    for name, k in (("Color", _COLOR), ("Sharpness", _SHARP), ("Desaturate", _COLOR)):
        at = names == name
        kind[at] = k
        factor[at] = np.clip(1.0 - arg[at], 0.0, 1.0) if name == "Desaturate" else arg[at]
    warped = np.isin(full, GEOMETRIC)
    if warped.any():
        matrices = np.zeros((n, 6))
        rotation = full == "Rotate"
        quarter = np.where(rotation, turns(np.where(rotation, arg, 1.0), height, width), -1)
        for name in np.unique(full[warped]):
            at = full == name
            if name == "Rotate":
                matrices[at] = inverse_matrices(angle=-np.mod(arg[at], 360.0))
            else:
                matrices[at] = from_pil(
                    affine_data(str(name), arg[at], height, width), height, width
                )
        scale = np.array([0.5 * width, 0.5 * height], dtype=np.float32)
        theta = matrices.astype(np.float32).reshape(-1, 2, 3).transpose(0, 2, 1) / scale
        table[:, 4:10] = theta.reshape(n, 6)
        kind[warped] = _WARP
        kind[quarter > 0] = _TURN
        kind[quarter == 0] = _COPY
        table[:, 3] = np.maximum(quarter, 0)
        table[:, 2] = mode
    table[:, 0] = kind
    table[:, 1] = factor.astype(np.float32)
    host = np.empty((n, 256), np.uint8)
    host[:] = np.arange(256, dtype=np.uint8)
    at = kind == _LUT
    host[at] = tone.host_luts(names[at], arg[at])
    return table, host


def run_layer(
    x: torch.Tensor,
    table: np.ndarray | torch.Tensor,
    host: np.ndarray | torch.Tensor,
    fill: tuple,
    kinds: np.ndarray | None = None,
) -> torch.Tensor:
    """One layer of the batch ``x`` (uint8 [N, 3, H, W], any strides) by ``table`` and the
    pointwise LUTs ``host`` (``layer_table``'s: numpy, or already on ``x``'s device, then
    with ``kinds``, the table's first column on the host); a new tensor."""
    from loader.gpu import layer_kernels as k

    n, _, h, w = x.shape
    if kinds is None:
        kinds, table, host = table[:, 0], on_device(table, x.device), on_device(host, x.device)
    out = torch.empty((n, 3, h, w), dtype=torch.uint8, device=x.device)
    options = {"enable_fp_fusion": False} if x.is_cuda else {}  # the blends: torch's roundings
    tiles = (triton_cdiv(h * w, _BLOCK), n)  # (CUDA's second grid axis stops at 65,535)
    luts = torch.empty(1, dtype=torch.uint8, device=x.device)  # where no sample takes a LUT
    if (kinds == _LUT).any() or (kinds >= _STATS["AutoContrast"]).any():
        # lows and highs each start 16-byte aligned whatever n is: Triton compiles a kernel
        # again for a pointer of another alignment (a batch of n % 4 != 0, mid-run).
        m = -(-n * 3 // 4) * 4
        stats = torch.zeros(n * 3 * 256 + 2 * m, dtype=torch.int32, device=x.device)
        hist = stats[: n * 3 * 256].view(n * 3, 256)
        lows, highs = stats[n * 3 * 256 :].view(2, m)[:, : n * 3].unbind()
        lows.fill_(255)
        gray = torch.zeros(n, dtype=torch.int64, device=x.device)
        if (kinds >= _STATS["AutoContrast"]).any():
            k.layer_stats[tiles](
                x, table, hist, lows, highs, gray, h, w, *x.stride(), BLOCK=_BLOCK, **options
            )
        luts = torch.empty((n * 3, 256), dtype=torch.uint8, device=x.device)
        k.layer_luts[(n * 3,)](table, host, hist, lows, highs, gray, luts, h * w, **options)
    k.layer_apply[tiles](
        x, out, table, luts, h, w, *x.stride(), *fill, GRID64=x.is_cuda, BLOCK=_BLOCK, **options
    )
    return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

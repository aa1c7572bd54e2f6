"""Batched affine warps of uint8 images [N, C, H, W]: one matrix a sample, one grid_sample.

The matrices are torchvision's (``_get_inverse_affine_matrix``: output pixel centres about
the image centre to input ones) and the grid is made with torchvision's float32 steps
(``_affine_grid``), so nearest-neighbour warps equal its tensor ``F.affine`` and
``F.rotate`` pixel for pixel, quarter turns taking the same exact fast path. Two edge rules:
``"tensor"`` is torchvision's tensor one (zeros outside, a fill blended in through a mask
channel, rounded); ``"pil"`` is PIL's ``Image.transform``, which timm's ops and
torchvision's PIL path run (taps clamped at the border, a pixel whose centre maps outside
takes the fill, the result truncated). Bicubic is torch's (a = -0.75; PIL's a = -1 differs
by a few levels on sharp edges) and always takes the "pil" rule: torchvision warps only PIL
images bicubically.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as nnf

from loader.ops.layers import on_rows
from loader.ops.upload import on_device

MODES = ("nearest", "bilinear", "bicubic")
EDGES = ("tensor", "pil")
_TRUNCATE = 1e-3  # PIL truncates exact sums; float32 ones may fall just short of an integer


def inverse_matrices(angle=0.0, translate=(0.0, 0.0), shear=(0.0, 0.0), center=(0.0, 0.0)):
    """torchvision's ``_get_inverse_affine_matrix`` (scale 1) for arrays of samples: [n, 6]
    float64. Degrees; ``center`` is relative to the image centre, as there."""
    angle, tx, ty, sx, sy = np.broadcast_arrays(
        *(np.asarray(v, dtype=np.float64) for v in (angle, *translate, *shear))
    )
    rot, sx, sy = np.radians(angle), np.radians(sx), np.radians(sy)
    cx, cy = center
    cos_sy, tan_sx = np.cos(sy), np.tan(sx)
    a = np.cos(rot - sy) / cos_sy
    b = -(a * tan_sx + np.sin(rot))
    c = np.sin(rot - sy) / cos_sy
    d = np.cos(rot) - c * tan_sx
    m0, m1, m3, m4 = d, -b, -c, a
    m2 = cx - m0 * (cx + tx) - m1 * (cy + ty)
    m5 = cy - m3 * (cx + tx) - m4 * (cy + ty)
    return np.stack(np.broadcast_arrays(m0, m1, m2, m3, m4, m5), 1).reshape(-1, 6)


def from_pil(data: np.ndarray, height: int, width: int) -> np.ndarray:
    """PIL's ``Image.transform(AFFINE)`` data [n, 6] (coordinates from the top-left corner)
    as the centred matrices of ``warp``."""
    a, b, c, d, e, f = np.asarray(data, dtype=np.float64).T
    cx, cy = width / 2, height / 2
    return np.stack([a, b, c + a * cx + b * cy - cx, d, e, f + d * cx + e * cy - cy], 1)


@functools.lru_cache(maxsize=16)
def _base_grid(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Output pixel centres about the image centre, and 1: [1, H * W, 3] (as torchvision's)."""
    grid = torch.empty(1, height, width, 3, device=device)
    grid[..., 0].copy_(torch.linspace((1.0 - width) * 0.5, (width - 1.0) * 0.5, width))
    grid[..., 1].copy_(torch.linspace((1.0 - height) * 0.5, (height - 1.0) * 0.5, height)[:, None])
    grid[..., 2].fill_(1)
    return grid.view(1, height * width, 3)


@functools.lru_cache(maxsize=16)
def _fill(fill: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    value = torch.tensor(fill, dtype=torch.float32)
    if dtype == torch.uint8:
        value = value.round().clamp(0, 255)
    return value.to(device=device, dtype=dtype).view(1, -1, 1, 1)


def _theta(matrices: np.ndarray, height: int, width: int) -> np.ndarray:
    """[n, 3, 2] float32: the matrices as the base grid's multiplier (torchvision's)."""
    scale = np.array([0.5 * width, 0.5 * height], dtype=np.float32)
    return matrices.astype(np.float32).reshape(-1, 2, 3).transpose(0, 2, 1) / scale


def nearest_pixels(matrix: np.ndarray, height: int, width: int) -> tuple[np.ndarray, ...]:
    """(x, y) float32 [H, W]: the input pixel (whole numbers, maybe outside) that each
    output pixel of a nearest ``warp`` by ``matrix`` [6] takes on the CPU: torch's own
    grid (``grid``: its CPU matmul, whose rounding depends on the CPU's kernels; an
    emulation in numpy matched AVX2's, not AVX-512's), then ``grid_sample``'s
    ``(g + 1) * size / 2 - 1 / 2``, half to even. Tested bit for bit against
    ``grid_sample``."""
    at = grid(np.asarray(matrix)[None], height, width, "cpu")[0]
    return tuple(
        at[..., k].add(1.0).mul_(0.5 * size).sub_(0.5).round_().numpy()
        for k, size in enumerate((width, height))
    )


def grid(matrices: np.ndarray, height: int, width: int, device) -> torch.Tensor:
    """The sampling grid [n, H, W, 2] of centred inverse ``matrices`` [n, 6]."""
    theta = _theta(matrices, height, width)
    device = torch.device(device)
    base = _base_grid(height, width, device)
    if device.type == "cuda":  # in float64: cuBLAS would round float32 to TF32 where the
        # user allows it (timm's train.py does), moving the samples by ~0.05 pixel
        out = torch.matmul(base.double(), on_device(theta, device, torch.float64)).float()
    else:
        out = torch.matmul(base, on_device(theta, device))
    return out.view(-1, height, width, 2)


def warp(
    x: torch.Tensor,
    matrices: np.ndarray,
    mode: str = "nearest",
    fill: tuple | None = None,
    edge: str = "tensor",
) -> torch.Tensor:
    """Each sample of ``x`` (uint8) warped by its centred inverse matrix (a row of
    ``matrices``); ``fill`` (per channel, or None: zeros) where it maps outside."""
    n, c, h, w = x.shape
    at = grid(matrices, h, w, x.device)
    img = x.float()
    if edge == "pil" or mode == "bicubic":
        return _pil_edge(img, at, mode, fill)
    if fill is None:
        out = nnf.grid_sample(img, at, mode=mode, padding_mode="zeros", align_corners=False)
        return out.round_().to(torch.uint8)
    ones = torch.ones((n, 1, h, w), dtype=img.dtype, device=img.device)
    both = torch.cat([img, ones], 1)
    both = nnf.grid_sample(both, at, mode=mode, padding_mode="zeros", align_corners=False)
    out, mask = both[:, :c], both[:, c:]
    value = _fill(tuple(fill), x.device, torch.float32)
    if mode == "nearest":  # where the mask < 0.5: the fill (as a blend: where is slower)
        keep = mask >= 0.5
        out = out.mul_(keep).add_(value * ~keep)
    else:  # as torchvision: (out - fill) * mask + fill
        out = out.sub_(value).mul_(mask).add_(value)
    return out.round_().to(torch.uint8)


def _pil_edge(img: torch.Tensor, at: torch.Tensor, mode: str, fill: tuple | None):
    out = nnf.grid_sample(img, at, mode=mode, padding_mode="border", align_corners=False)
    if mode != "nearest":
        out = out.clamp_(0, 255).add_(_TRUNCATE).floor_()
    inside = ((at >= -1) & (at < 1)).all(-1).unsqueeze(1)  # the pixel centre maps inside
    value = _fill(tuple(fill or (0,) * img.shape[1]), img.device, torch.uint8)
    return out.to(torch.uint8).mul_(inside).add_(value * ~inside)


def turns(angle: np.ndarray, height: int, width: int) -> np.ndarray:
    """Each ``angle``'s exact quarter turns (0..3; -1: warped), as torchvision and PIL take
    them: 0 and 180 degrees always, 90 and 270 on squares only."""
    angle = np.mod(np.asarray(angle, dtype=np.float64), 360.0)
    out = np.full(angle.shape, -1)
    for k, degrees in enumerate((0.0, 90.0, 180.0, 270.0)):
        if k % 2 == 0 or height == width:
            out[angle == degrees] = k
    return out


def rotate(
    x: torch.Tensor,
    angle: np.ndarray,
    mode: str = "nearest",
    fill: tuple | None = None,
    edge: str = "tensor",
) -> torch.Tensor:
    """Each sample of ``x`` turned by its ``angle`` (degrees, counter-clockwise) about the
    centre; exact turns of 0 and 180 degrees (and 90, 270 on squares) transposed, as
    torchvision and PIL do."""
    _, _, h, w = x.shape
    angle = np.mod(np.asarray(angle, dtype=np.float64), 360.0)
    quarter = turns(angle, h, w)
    for k in np.unique(quarter):
        rows = np.flatnonzero(quarter == k)
        if k < 0:
            matrices = inverse_matrices(angle=-angle[rows])
            x = on_rows(x, rows, lambda s, m=matrices: warp(s, m, mode, fill, edge))
        elif k > 0:
            x = on_rows(x, rows, lambda s, k=int(k): torch.rot90(s, k, (-2, -1)))
    return x

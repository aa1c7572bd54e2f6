"""Batched GPU augmentation: decoded images of any size -> the output batch, in two launches.

Each decoded image (uint8, [3, H, W], its own allocation) gets one row of crop parameters
(``loader.augment.CROP_COLUMNS``). Two Triton kernels read the ragged images through a
table of their addresses, so no image is padded, copied or converted to float first:

1. ``_resample_rows``: the crop window's rows, each resampled horizontally to the output
   columns it contributes to, into a float32 scratch of ``sum(window heights)`` rows;
2. ``_resample_cols``: each output row resampled vertically from that scratch, rounded to
   the uint8 grid (as a PIL image would be), mirrored, normalised, cast and written at its
   row of the output batch with the output's strides (contiguous or channels_last).

The filter is PIL's separable triangle filter (torchvision's ``antialias=True``): s source
pixels each side when shrinking by s, else bilinear; or, for the images whose crop row asks
for it (``Transform.interpolation``), PIL's cubic (a = -0.5), 2s pixels each side, each pass
clamped to 0..255 as PIL's is.
Windows and flips come from the sampler, as on the CPU path. Triton is imported lazily;
the kernels also run under its CPU interpreter (``TRITON_INTERPRET=1``), which the CPU
test suite uses.
"""

from __future__ import annotations

import numpy as np
import torch

from loader.gpu.host_arrays import upload
from loader.gpu.normalise import affine
from loader.gpu.ragged import Ragged

# Columns of the per-image parameter table handed to the kernels (int32).
_P_Y, _P_X, _P_H, _P_W, _P_RH, _P_RW, _P_OY, _P_OX, _P_FLIP = range(9)
_P_IMG_H, _P_IMG_W, _P_OUT_ROW, _P_ROW0 = range(9, 13)
_P_STRIDES = slice(13, 16)  # the image's element strides: channel, row, column
_P_CUBIC = 16  # 1: the cubic filter (the crop row's CUBIC)
_P_COLS = 17  # kernels.py reads rows of this many
_BLOCK_W = 256  # output columns per kernel tile (at most)
_ROWS = 4  # rows per kernel tile
# The filters' half-widths in source pixels (before widening by the shrink factor): PIL's
# triangle (bilinear) and cubic (bicubic).
_SUPPORT = {"bilinear": 1.0, "bicubic": 2.0}
CUBIC_A = -0.5  # PIL's (and torch's antialiased) bicubic
PLAIN_CUBIC_A = -0.75  # torch's bicubic without antialias (and OpenCV's INTER_CUBIC)


def _kernels():
    """The two Triton kernels (Triton is imported on first use)."""
    from loader.gpu import kernels as augment_kernels

    return augment_kernels.resample_rows, augment_kernels.resample_cols


def triton_pow2(n: int) -> int:
    """The smallest power of two >= n (Triton's block sizes are powers of two)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _max_taps(window: np.ndarray, resized: np.ndarray, antialias: bool, cubic: np.ndarray) -> int:
    """Most source pixels one output pixel reads along an axis, over the batch."""
    scale = window.astype(np.float64) / np.maximum(resized, 1)
    support = np.maximum(scale, 1.0) if antialias else np.ones_like(scale)
    support = support * np.where(cubic != 0, _SUPPORT["bicubic"], _SUPPORT["bilinear"])
    return int(np.ceil(2 * support.max())) + 2 if len(scale) else 1


def image_params(
    crops: np.ndarray, shapes: np.ndarray, strides: np.ndarray, out_rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The kernels' per-image parameter table and, per scratch row, its image.

    Args:
        crops: int rows of ``loader.augment.CROP_COLUMNS``, one per decoded image.
        shapes: (height, width) of each decoded image.
        strides: (channel, row, column) element strides of each decoded image (a decoder
            may return planar or interleaved pixels).
        out_rows: the row of the output batch each image goes to.

    Returns:
        (params int32 [G, _P_COLS], row_image int32 [sum of window heights]).
    """
    g = len(crops)
    params = np.empty((g, _P_COLS), dtype=np.int32)
    params[:, :9] = crops[:, :9]
    params[:, _P_CUBIC] = crops[:, 9]
    params[:, _P_IMG_H], params[:, _P_IMG_W] = shapes[:, 0], shapes[:, 1]
    params[:, _P_OUT_ROW] = out_rows
    params[:, _P_STRIDES] = strides
    heights = crops[:, _P_H].astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(heights)[:-1]]) if g else np.zeros(0, np.int64)
    params[:, _P_ROW0] = starts
    return params, np.repeat(np.arange(g, dtype=np.int32), heights)


def filter_matrix(
    out_size: int,
    offset: int,
    window: int,
    resized: int,
    antialias: bool,
    interpolation: str = "bilinear",
) -> np.ndarray:
    """Weights [out_size, window] of the kernels' filter along one axis: output pixel k is
    pixel ``offset + k`` of the window resized to ``resized`` pixels (PIL's coefficients)."""
    scale = window / resized
    fscale = max(scale, 1.0) if antialias else 1.0
    support = fscale * _SUPPORT[interpolation]
    centre = (np.arange(out_size) + offset + 0.5)[:, None] * scale
    lo = np.maximum(np.trunc(centre - support + 0.5), 0)
    hi = np.minimum(np.trunc(centre + support + 0.5), window)
    x = np.arange(window)[None, :]
    t = np.abs((x - centre + 0.5) / fscale)
    if interpolation == "bicubic":
        w = _cubic(t, CUBIC_A if antialias else PLAIN_CUBIC_A)
    else:
        w = np.clip(1.0 - t, 0.0, None)
    w = np.where((x >= lo) & (x < hi), w, 0.0)
    total = w.sum(axis=1, keepdims=True)
    return w / np.where(total > 0, total, 1.0)


def _cubic(t: np.ndarray, a: float) -> np.ndarray:
    """The cubic convolution kernel (Keys) of parameter ``a`` at distances ``t`` >= 0."""
    near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
    far = (((t - 5.0) * t + 8.0) * t - 4.0) * a
    return np.where(t < 1.0, near, np.where(t < 2.0, far, 0.0))


class GpuAugment:
    """Crops, resizes, flips, normalises and casts decoded images into an output batch.

    Args:
        size: output (height, width).
        mean, std: normalisation (RGB, 0..1); ignored for uint8 output.
        antialias: PIL's antialiased filter when shrinking, else plain bilinear (or plain
            bicubic: torch's, a = -0.75).
        backend: "triton" (the kernels; the default on CUDA) or "torch" (the same filter as
            two matrix products per image: the default on the CPU, where the CPU test
            suite runs the GPU path's pipeline).
        stats: a ``LoaderStats`` counting the bytes of the kernels' tables it copies.

    Each crop row's CUBIC column picks the filter of its image: the triangle or the cubic.
    """

    def __init__(
        self,
        size: tuple[int, int],
        mean,
        std,
        antialias: bool = True,
        backend: str = "auto",
        stats=None,
    ) -> None:
        self.size, self.antialias, self.backend = tuple(size), bool(antialias), backend
        self.stats = stats
        self._scale, self._bias = affine(mean, std)
        self._affine_on: tuple | None = None  # (device, (scale, bias))

    def __call__(
        self,
        images: Ragged | list[torch.Tensor],
        crops: np.ndarray,
        out_rows: np.ndarray,
        out: torch.Tensor,
    ) -> None:
        """Write image ``k`` (uint8 [3, H, W], on ``out``'s device; a ``Ragged`` or a list
        of tensors), cropped by ``crops[k]``, into ``out[out_rows[k]]`` ([N, 3, H, W], any
        strides); on the current stream."""
        if not isinstance(images, Ragged):
            images = Ragged.of(images)
        if not len(images):
            return
        use_triton = self.backend == "triton" or (self.backend == "auto" and out.is_cuda)
        if not use_triton:
            raw = out.dtype == torch.uint8
            for image, crop, row in zip(images.tensors(), crops, out_rows, strict=True):
                out[int(row)] = self._one(image, crop, raw).to(out.dtype)
            return
        params, row_image = image_params(crops, images.shapes, images.strides, out_rows)
        dev = out.device
        table, p, rows = upload(out.device, images.addresses, params, row_image, stats=self.stats)
        h_out, w_out = self.size
        scratch = torch.empty((len(row_image), 3, w_out), dtype=torch.float32, device=dev)
        cubic = crops[:, 9]
        taps_x = _max_taps(crops[:, _P_W], crops[:, _P_RW], self.antialias, cubic)
        taps_y = _max_taps(crops[:, _P_H], crops[:, _P_RH], self.antialias, cubic)
        cubic = bool(cubic.any())  # compiles the cubic filter in only where a batch needs it
        rows_kernel, cols_kernel = _kernels()
        block = min(_BLOCK_W, triton_pow2(w_out))
        cols = -(-w_out // block)
        rows_kernel[(-(-len(row_image) // _ROWS), cols)](
            table, p, rows, scratch, len(row_image), w_out, taps_x,
            ANTIALIAS=self.antialias, CUBIC=cubic, ROWS=_ROWS, BLOCK=block,
        )  # fmt: skip
        cols_kernel[(len(images), -(-h_out // _ROWS), cols)](
            scratch, p, out, h_out, w_out, taps_y, *out.stride(), *self._scale, *self._bias,
            ANTIALIAS=self.antialias, CUBIC=cubic, RAW=out.dtype == torch.uint8, ROWS=_ROWS,
            BLOCK=block,
        )  # fmt: skip

    def _one(self, image: torch.Tensor, crop: np.ndarray, raw: bool) -> torch.Tensor:
        """One image through the same filter as the kernels, as matrix products."""
        y, x, h, w, rh, rw, oy, ox, flip, cubic = (int(v) for v in crop[:10])
        h_out, w_out = self.size
        mode = "bicubic" if cubic else "bilinear"
        wy = torch.from_numpy(filter_matrix(h_out, oy, h, rh, self.antialias, mode))
        wx = torch.from_numpy(filter_matrix(w_out, ox, w, rw, self.antialias, mode))
        window = image[:, y : y + h, x : x + w].double().cpu()
        # Rows first, clamped between the passes, as the kernels (a no-op for the triangle).
        v = wy @ (window @ wx.T).clamp_(0, 255)
        v = torch.floor(v + 0.5).clamp_(0, 255).to(image.device)
        if flip:
            v = v.flip(-1)
        if raw:
            return v
        scale = torch.tensor(self._scale, dtype=torch.float64).view(3, 1, 1)
        bias = torch.tensor(self._bias, dtype=torch.float64).view(3, 1, 1)
        return v * scale + bias

    def _affine(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalisation as (scale, bias) tensors on ``device``, made once: building them
        from Python lists each batch would synchronise the stream."""
        if self._affine_on is None or self._affine_on[0] != device:
            scale = torch.tensor(self._scale, device=device).view(1, 3, 1, 1)
            bias = torch.tensor(self._bias, device=device).view(1, 3, 1, 1)
            self._affine_on = (device, (scale, bias))
        return self._affine_on[1]

    def pixels(self, pixels: torch.Tensor, out_rows: torch.Tensor, out: torch.Tensor) -> None:
        """Write ready-made uint8 pixels ([K, H, W, 3], decoded and cropped on the CPU) into
        ``out[out_rows]``, normalised and cast like the rest of the batch."""
        if not len(pixels):
            return
        x = pixels.permute(0, 3, 1, 2)
        if out.dtype != torch.uint8:
            scale, bias = self._affine(out.device)
            x = torch.addcmul(bias, x.float(), scale)
        out.index_copy_(0, out_rows, x.to(out.dtype))

"""The CPU decoder: OpenCV (libjpeg-turbo) decode, DCT-domain reduction, crop, resize, flip."""

from __future__ import annotations

import contextlib

import cv2
import numpy as np
import torch

from ingest.cstderr import captured
from ingest.images.normalize import Reject, check_jpeg
from ingest.images.probe import PngError, header_problem, plain_png
from loader.decode import DecodeError, in_worker_process

_BASE = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION  # stored images are upright
# IMREAD_REDUCED_GRAYSCALE_f is the bare "reduce by f" bit; with COLOR_RGB it gives RGB.
_FLAGS = {
    1: _BASE,
    2: _BASE | cv2.IMREAD_REDUCED_GRAYSCALE_2,
    4: _BASE | cv2.IMREAD_REDUCED_GRAYSCALE_4,
    8: _BASE | cv2.IMREAD_REDUCED_GRAYSCALE_8,
}


def reduction(kind: str, crop: np.ndarray) -> int:
    """The DCT scaling denominator (1, 2, 4 or 8) for a crop: the largest that still leaves
    at least as many pixels as the output needs in both directions (JPEG only)."""
    if kind != "jpeg":
        return 1
    h, w, rh, rw = int(crop[2]), int(crop[3]), int(crop[4]), int(crop[5])
    for f in (8, 4, 2):
        if h >= f * rh and w >= f * rw:
            return f
    return 1


def reductions(crops: np.ndarray) -> np.ndarray:
    """``reduction("jpeg", row)`` for every row of ``crops`` at once (batch planning)."""
    h, w, rh, rw = (crops[:, c].astype(np.int64) for c in (2, 3, 4, 5))
    f = np.ones(len(crops), dtype=np.int64)
    for g in (2, 4, 8):  # ascending: the largest factor that fits wins
        f[(h >= g * rh) & (w >= g * rw)] = g
    return f


class CpuDecoder:
    """Decodes in the calling process; one per worker (OpenCV kept to one thread there).

    Args:
        antialias: when shrinking, low-pass filter first, as torchvision's antialiased
            resize does; otherwise plain bilinear sampling (faster, aliases fine detail).
    """

    name = "cpu"
    in_workers = True
    devices = ("cpu", "cuda")  # decodes on the CPU, delivers anywhere

    def __init__(self, antialias: bool = True) -> None:
        if in_worker_process():
            # Workers are the parallelism; OpenCV's threads would oversubscribe the cores.
            # (In the training process the user's OpenCV setting is left alone.)
            cv2.setNumThreads(1)
        self.antialias = antialias

    def decode_into(
        self, data: bytes, kind: str, shape: tuple[int, int], crop: np.ndarray, out: np.ndarray
    ) -> None:
        """See ``loader.decode.Decoder.decode_into``."""
        if kind == "raw":  # pixels: nothing to decode
            problem = header_problem(data, kind, *shape)
            if problem:
                raise DecodeError(problem)
            img = np.frombuffer(data, np.uint8).reshape(shape[0], shape[1], -1)
            if img.shape[2] == 1:
                img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
            _crop_resize(img, crop, 1, out, self.antialias)
            return
        f = reduction(kind, crop)
        if kind == "png":  # what libpng reads without a word, or refused before it does
            try:
                data = plain_png(data)
            except PngError as e:
                raise DecodeError(f"the PNG is damaged: {e}") from None
        try:
            with _quietly(data, kind) as warnings:
                img = cv2.imdecode(np.frombuffer(data, np.uint8), _FLAGS[f])
        except cv2.error as e:  # some corrupt streams raise instead of returning None
            raise DecodeError(f"OpenCV could not decode the {kind}: {e}") from None
        if warnings:  # libjpeg filled what it could not decode with gray: not the image
            raise DecodeError(f"the {kind} decoder warns: {warnings[0]}")
        if img is None:
            raise DecodeError(f"OpenCV could not decode the {kind} ({len(data)} bytes)")
        expected = (-(-shape[0] // f), -(-shape[1] // f))  # libjpeg rounds scaled sizes up
        if img.shape[:2] != expected:
            raise DecodeError(
                f"decoded size {img.shape[1]}x{img.shape[0]} differs from the index's "
                f"{expected[1]}x{expected[0]}"
            )
        if img.ndim == 2:  # a decoder that ignored the colour flag
            img = cv2.cvtColor(img, cv2.COLOR_GRAY2RGB)
        _crop_resize(img, crop, f, out, self.antialias)


def _quietly(data: bytes, kind: str) -> contextlib.AbstractContextManager:
    """Keep libjpeg's warnings off the terminal and turn them into a DecodeError.

    In a worker process fd 2 is taken over around the decode (``captured``). The training
    process (``num_workers=0``, the GPU path's retries) may have other threads writing to
    stderr, so there a JPEG is first decoded in libjpeg-turbo's stop-on-warning mode at
    1/8 scale instead, and one that would warn is refused before OpenCV can print (a PNG
    is checked whole before it gets here: ``ingest.images.probe.plain_png``).
    """
    if in_worker_process():
        return captured()
    if kind == "jpeg":
        try:
            check_jpeg(data)
        except Reject as e:
            raise DecodeError(str(e)) from None
    return contextlib.nullcontext([])


def _window(crop: np.ndarray, f: int, shape: tuple[int, int]) -> tuple[int, int, int, int]:
    """The crop window in the coordinates of an image decoded at 1/f scale."""
    y, x, h, w = (int(v) for v in crop[:4])
    if f == 1:
        return y, x, h, w
    y0, x0 = round(y / f), round(x / f)
    y1, x1 = min(round((y + h) / f), shape[0]), min(round((x + w) / f), shape[1])
    return y0, x0, max(1, y1 - y0), max(1, x1 - x0)


def _crop_resize(img: np.ndarray, crop: np.ndarray, f: int, out: np.ndarray, aa: bool) -> None:
    y, x, h, w = _window(crop, f, img.shape[:2])
    rh, rw, oy, ox, flip, cubic = (int(v) for v in crop[4:10])
    window = img[y : y + h, x : x + w]
    whole = (rh, rw) == out.shape[:2] and oy == ox == 0
    resize = _bicubic if cubic else _bilinear
    resized = resize(window, (rh, rw), aa, out if whole else None)
    if not whole:
        out[...] = resized[oy : oy + out.shape[0], ox : ox + out.shape[1]]
    if flip:
        cv2.flip(out, 1, dst=out)


def _bilinear(window: np.ndarray, size: tuple[int, int], aa: bool, dst=None) -> np.ndarray:
    """``window`` resized to ``size`` (h, w) bilinearly, into ``dst`` where given; with
    ``aa``, low-passed first when shrinking (``_prefilter``)."""
    if aa:
        window = _prefilter(window, window.shape[0] / size[0], window.shape[1] / size[1])
    return cv2.resize(window, (size[1], size[0]), dst=dst, interpolation=cv2.INTER_LINEAR)


def _bicubic(window: np.ndarray, size: tuple[int, int], aa: bool, dst=None) -> np.ndarray:
    """``window`` resized to ``size`` (h, w) with PIL's antialiased bicubic filter, into
    ``dst`` where given; without ``aa``, OpenCV's plain INTER_CUBIC (a = -0.75, as torch's
    ``interpolate(mode="bicubic", antialias=False)``).

    torch's uint8 resize (``antialias=True``) is PIL's algorithm (its coefficients, its
    fixed-point rounding, a clamp after each pass): within 2 levels of PIL on every pixel,
    at about 1.5 times the cost of ``_bilinear``; no OpenCV filter comes close (a Gaussian
    or INTER_AREA before INTER_CUBIC: mean 0.4-0.6 levels, up to 20-55 off). Its cost
    grows with the window, not the factor (4 taps per source pixel and axis), so a large
    shrink needs no box averaging first.
    """
    if not aa:
        return cv2.resize(window, (size[1], size[0]), dst=dst, interpolation=cv2.INTER_CUBIC)
    if not window.flags.writeable:  # a pixel record's bytes: torch warns on read-only memory
        window = window.copy()
    image = torch.from_numpy(window).permute(2, 0, 1).unsqueeze(0)
    image = image.contiguous(memory_format=torch.channels_last)  # its fast uint8 layout
    resized = torch.nn.functional.interpolate(
        image, size, mode="bicubic", align_corners=False, antialias=True
    )
    pixels = resized[0].permute(1, 2, 0).numpy()
    if dst is None:
        return pixels
    dst[...] = pixels
    return dst


# Antialiasing: torchvision (PIL) shrinks by factor s with a triangle filter s pixels wide.
# A Gaussian blur of sigma K*sqrt(s^2 - 1) followed by bilinear sampling matches it about as
# closely as OpenCV's INTER_AREA does (mean abs difference 0.36 vs 0.35 on random resized
# crops of photographs, uint8 scale; worst crop 1.8 vs 2.2) at half INTER_AREA's cost, which
# is slow for the non-integer factors that remain after DCT-domain reduction.
_SIGMA_K = 0.5  # fitted on photographs: 0.41 and 0.6 both agree less with PIL
_MIN_SIGMA = 0.25  # below this the blur changes nothing measurable: skip it
_BOX_FROM = 8  # a shrink past this factor averages boxes first (_prefilter)


def _prefilter(window: np.ndarray, sy: float, sx: float) -> np.ndarray:
    """``window`` low-passed for shrinking by (sy, sx) (factors <= 1 are left alone); by
    more than ``_BOX_FROM``, first averaged over boxes (INTER_AREA) to a size the blur then
    shrinks by 2-3. The blur's kernel grows with the factor: an 8000-pixel PNG (which gets
    no DCT-domain reduction) shrunk to 32 took 501 taps a row and 26 s of CPU. Against PIL, on
    four photographs (mean abs difference, uint8 levels): shrunk by 9-25, 0.26-0.93 with
    boxes first against 0.26-1.54 without; by 37-50, 0.38-2.21 against 0.31-1.66; in a
    tenth of the time or less."""
    ky = int(sy // 2) if sy > _BOX_FROM else 1
    kx = int(sx // 2) if sx > _BOX_FROM else 1
    if ky > 1 or kx > 1:
        h, w = window.shape[:2]
        size = (max(1, round(w / kx)), max(1, round(h / ky)))
        window = cv2.resize(window, size, interpolation=cv2.INTER_AREA)
        sy, sx = sy * size[1] / h, sx * size[0] / w
    sigma_y = _SIGMA_K * np.sqrt(max(sy * sy - 1.0, 0.0))
    sigma_x = _SIGMA_K * np.sqrt(max(sx * sx - 1.0, 0.0))
    if max(sigma_x, sigma_y) < _MIN_SIGMA:
        return window
    # A zero sigma means "same as the other" to OpenCV: a tiny one gives a 1-tap kernel.
    # Three taps suffice up to sigma 1 (what remains after DCT reduction) and cost a third
    # less than OpenCV's default width, with the same agreement with PIL.
    size = (_taps(sigma_x), _taps(sigma_y))
    return cv2.GaussianBlur(window, size, sigmaX=max(sigma_x, 1e-3), sigmaY=max(sigma_y, 1e-3))


def _taps(sigma: float) -> int:
    return 3 if sigma <= 1.0 else 2 * int(np.ceil(2 * sigma)) + 1

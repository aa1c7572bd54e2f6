"""timm's auto-augmentation ops (``timm.data.auto_augment``, 1.0.31), batched: each op's
level function (a magnitude on timm's 0..10 scale to the op's argument, random signs
included) and the op on uint8 samples [N, 3, H, W] with one argument each.

The ops are PIL's, as timm calls them: shears and translations are ``Image.transform``
AFFINE data about the top-left corner, rotation ``Image.rotate`` about the centre, all with
PIL's edge rule (``loader.ops.geometry``) and timm's fill; the tone ops are
``loader.ops.tone``'s ``pil_`` ones and the exact LUT ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loader.ops import tone
from loader.ops.geometry import from_pil, inverse_matrices, rotate, turns, warp
from loader.ops.layers import by_mode, on_rows
from loader.ops.upload import on_device

_DENOM = 10.0  # timm's _LEVEL_DENOM: magnitude 10 is an op's full level


@dataclass(frozen=True)
class TimmOp:
    """One of timm's ``AugmentOp``: ``name`` taken with probability ``prob`` at level
    ``magnitude`` (drawn normal with ``magnitude_std``, uniform in 0..magnitude for inf,
    clipped to 0..``magnitude_max`` or 10); translations from timm's hparams."""

    name: str
    prob: float = 0.5
    magnitude: float = 10.0
    magnitude_std: float = 0.0
    magnitude_max: float | None = None
    translate_const: float = 250.0  # TranslateX/Y: pixels at level 10
    translate_pct: float = 0.45  # TranslateXRel/YRel: share of the size at level 10

    def __post_init__(self) -> None:
        if self.name not in LEVELS:
            raise ValueError(
                f"op {self.name!r} is not one the loader runs; known: {', '.join(LEVELS)}"
            )

    def arguments(self, level: np.ndarray, negate: np.ndarray) -> np.ndarray:
        """The op's argument at each ``level`` (float64), negated where ``negate`` for the
        ops timm signs at random (NaN for the ops without one)."""
        fn = LEVELS[self.name]
        return np.full(level.shape, np.nan) if fn is None else fn(level / _DENOM, negate, self)


def _signed(value: np.ndarray, negate: np.ndarray) -> np.ndarray:
    return np.where(negate, -value, value)


def _enhance(v, neg, op):  # range 0.1..1.9
    return v * 1.8 + 0.1


def _enhance_increasing(v, neg, op):  # 1 -/+ up to 0.9, kept >= 0.1
    return np.maximum(0.1, 1.0 + _signed(v * 0.9, neg))


LEVELS = {  # name -> (level / 10, negate, op) -> argument, as timm's LEVEL_TO_ARG
    "AutoContrast": None,
    "Equalize": None,
    "Invert": None,
    "Rotate": lambda v, neg, op: _signed(v * 30.0, neg),
    "Posterize": lambda v, neg, op: np.trunc(v * 4),
    "PosterizeIncreasing": lambda v, neg, op: 4 - np.trunc(v * 4),
    "PosterizeOriginal": lambda v, neg, op: np.trunc(v * 4) + 4,
    "Solarize": lambda v, neg, op: np.minimum(256, np.trunc(v * 256)),
    "SolarizeIncreasing": lambda v, neg, op: 256 - np.minimum(256, np.trunc(v * 256)),
    "SolarizeAdd": lambda v, neg, op: np.minimum(128, np.trunc(v * 110)),
    "Color": _enhance,
    "ColorIncreasing": _enhance_increasing,
    "Contrast": _enhance,
    "ContrastIncreasing": _enhance_increasing,
    "Brightness": _enhance,
    "BrightnessIncreasing": _enhance_increasing,
    "Sharpness": _enhance,
    "SharpnessIncreasing": _enhance_increasing,
    "ShearX": lambda v, neg, op: _signed(v * 0.3, neg),
    "ShearY": lambda v, neg, op: _signed(v * 0.3, neg),
    "TranslateX": lambda v, neg, op: _signed(v * float(op.translate_const), neg),
    "TranslateY": lambda v, neg, op: _signed(v * float(op.translate_const), neg),
    "TranslateXRel": lambda v, neg, op: _signed(v * op.translate_pct, neg),
    "TranslateYRel": lambda v, neg, op: _signed(v * op.translate_pct, neg),
    "Desaturate": lambda v, neg, op: np.clip(0.5 + 0.5 * v, 0.5, 1.0),
}
GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY")
GEOMETRIC += ("TranslateXRel", "TranslateYRel")


def affine_data(name: str, arg: np.ndarray, height: int, width: int) -> np.ndarray:
    """timm's ``Image.transform`` AFFINE data of ``name`` with ``arg`` per sample: [n, 6]."""
    one, zero = np.ones_like(arg), np.zeros_like(arg)
    if name == "ShearX":
        data = (one, arg, zero, zero, one, zero)
    elif name == "ShearY":
        data = (one, zero, zero, arg, one, zero)
    elif name.startswith("TranslateX"):
        shift = arg * width if name.endswith("Rel") else arg
        data = (one, zero, shift, zero, one, zero)
    else:
        shift = arg * height if name.endswith("Rel") else arg
        data = (one, zero, zero, zero, one, shift)
    return np.stack(data, 1)


def _geometric(x, name, arg, modes, names, fill) -> torch.Tensor:
    h, w = x.shape[-2:]

    def run(s, rows, mode):
        if name == "Rotate":
            return rotate(s, arg[rows], mode, fill, edge="pil")
        return warp(s, from_pil(affine_data(name, arg[rows], h, w), h, w), mode, fill, edge="pil")

    return by_mode(x, modes, names, run)


def _tensor(x: torch.Tensor, values: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    return on_device(np.asarray(values), x.device, dtype)


_TONE = {  # name -> (samples, arguments) -> samples
    "AutoContrast": lambda x, a: tone.autocontrast_pil(x),
    "Equalize": lambda x, a: tone.equalize(x),
    "Invert": lambda x, a: tone.invert(x),
    "Posterize": lambda x, a: tone.posterize(x, _tensor(x, a, torch.int64)),
    "Solarize": lambda x, a: tone.solarize(x, _tensor(x, a, torch.int16)),
    "SolarizeAdd": lambda x, a: tone.solarize_add(x, _tensor(x, a, torch.int16)),
    "Color": lambda x, a: tone.pil_color(x, _tensor(x, a)),
    "Contrast": lambda x, a: tone.pil_contrast(x, _tensor(x, a)),
    "Brightness": lambda x, a: tone.pil_brightness(x, _tensor(x, a)),
    "Sharpness": lambda x, a: tone.pil_sharpness(x, _tensor(x, a)),
}
_TONE["Desaturate"] = lambda x, a: tone.pil_color(x, _tensor(x, np.clip(1.0 - a, 0.0, 1.0)))


def run(x: torch.Tensor, name: str, arg: np.ndarray, modes: np.ndarray, names, fill):
    """The samples ``x`` through op ``name`` with their arguments ``arg`` and (warps) their
    interpolation codes ``modes``, indices of ``names``; ``fill``: the warps' fill."""
    if name in GEOMETRIC:
        return _geometric(x, name, arg, modes.astype(np.int64), names, fill)
    base = base_name(name)
    return _TONE[base](x, arg)


# -- several ops at once: what a batch's layer runs (``layers.apply_layers``' groups) ---------

POINTWISE = ("Invert", "Posterize", "Solarize", "SolarizeAdd", "Brightness")  # of the pixel only
LOOKUPS = (*POINTWISE, "AutoContrast", "Equalize", "Contrast")  # a LUT per sample and channel


def base_name(name: str) -> str:
    return name.removesuffix("Increasing").removesuffix("Original")


def is_lookup(name: str) -> bool:
    return base_name(name) in LOOKUPS


def warps(x: torch.Tensor, names: list, arg: np.ndarray, modes: np.ndarray, choices, fill):
    """Samples ``x`` through the geometric ops ``names`` (one a sample), each with its
    argument and interpolation: one warp per interpolation for them all (the same
    per-sample matrices and pixels as ``run``, op by op)."""
    h, w = x.shape[-2:]
    names, modes = np.asarray(names), modes.astype(np.int64)
    matrices = np.zeros((len(x), 6))
    exact = (names == "Rotate") & (turns(arg, h, w) >= 0)  # transposed, as ``rotate`` does
    for name in np.unique(names):
        at = np.flatnonzero(names == name)
        if name == "Rotate":
            matrices[at] = inverse_matrices(angle=-np.mod(arg[at], 360.0))
        else:
            matrices[at] = from_pil(affine_data(str(name), arg[at], h, w), h, w)
    general = np.flatnonzero(~exact)

    def run_warp(s, rows, mode):
        return warp(s, matrices[general[rows]], mode, fill, edge="pil")

    if len(general):
        x = on_rows(x, general, lambda s: by_mode(s, modes[general], choices, run_warp))
    rows = np.flatnonzero(exact)
    if len(rows):
        x = on_rows(x, rows, lambda s: rotate(s, arg[rows], "nearest", fill, edge="pil"))
    return x


def lookups(x: torch.Tensor, names: list, arg: np.ndarray) -> torch.Tensor:
    """Samples ``x`` through the tone ops ``names`` (one a sample) that map each pixel by a
    LUT of the sample and channel: the pointwise ops' LUTs made on the host and copied at
    once, AutoContrast's, Equalize's and Contrast's from their samples; then one lookup."""
    n, c = x.shape[:2]
    names = np.asarray([base_name(str(v)) for v in names])
    host = np.repeat(tone.host_luts(names, arg)[:, None, :], c, 1)
    luts = on_device(host, x.device)  # [n, c, 256]; the other ops' rows written below
    for name in ("AutoContrast", "Equalize", "Contrast"):
        rows = np.flatnonzero(names == name)
        if not len(rows):
            continue
        at = on_device(rows, x.device)
        own = x.index_select(0, at)
        if name == "Contrast":
            ramp = torch.arange(256, dtype=torch.uint8, device=x.device)
            ramp = ramp.view(1, 1, 1, 256).expand(len(rows), c, 1, 256)
            lut = tone.pil_contrast(ramp, _tensor(x, arg[rows]), mean=tone.pil_mean(own))
        else:
            lut = {"AutoContrast": tone.autocontrast_pil_lut, "Equalize": tone.equalize_lut}[name](
                own
            )
        luts.index_copy_(0, at, lut.reshape(len(rows), c, 256))
    return tone.lookup(x, luts.view(n * c, 256))

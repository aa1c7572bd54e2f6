"""torchvision's RandAugment, TrivialAugmentWide and AutoAugment on a uint8 batch
[N, 3, H, W], each sample drawing its own ops.

The op spaces, magnitude bins, sign draws and policies are torchvision 0.29's
(``transforms.v2._auto_augment``); the ops follow its tensor functions: the warps
(``loader.ops.geometry``) exactly with nearest, posterize, solarize, invert, equalize and
autocontrast exactly, the blends (``loader.ops.color``, sharpness) within a level. A
sample's parameters are, per layer, (op, magnitude bin, sign): the magnitude is looked up
when applied, from the image's size as torchvision does (translations are a share of it).
Where it differs: Solarize takes v2's thresholds (255 * linspace(1, 0)), which v1's
linspace(255, 0) misses by a float ulp at a few bins; bicubic (torchvision warps only PIL
images so) takes PIL's edge rule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from loader.ops import color, tone
from loader.ops.autoaugment_batch import LUTS, WARPS, lookups, warps
from loader.ops.geometry import MODES, inverse_matrices, rotate, warp
from loader.ops.layers import apply_layers
from loader.ops.policies import TORCHVISION
from loader.ops.upload import on_device

OPS = ("Identity", "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate", "Brightness")
OPS += ("Color", "Contrast", "Sharpness", "Posterize", "Solarize", "AutoContrast", "Equalize")
OPS += ("Invert",)  # AutoAugment's only; the others are RandAugment's space, in its order
_SIGNED = np.array([op in OPS[1:10] for op in OPS])
_PIL_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}  # PIL's constants, as v2 takes


@functools.lru_cache(maxsize=64)
def magnitudes(wide: bool, bins: int, height: int, width: int) -> np.ndarray:
    """[len(OPS), bins] float64: each op's magnitude by bin in torchvision's space (the
    TrivialAugmentWide one if ``wide``), NaN for the ops without one."""
    table = np.full((len(OPS), bins), np.nan)

    def ramp(end: float) -> np.ndarray:  # float32, as torchvision's
        return torch.linspace(0.0, end, bins).double().numpy()

    shear, enhance, turn = (0.99, 0.99, 135.0) if wide else (0.3, 0.9, 30.0)
    for name, values in {
        "ShearX": ramp(shear),
        "ShearY": ramp(shear),
        "TranslateX": ramp(32.0 if wide else 150.0 / 331.0 * width),
        "TranslateY": ramp(32.0 if wide else 150.0 / 331.0 * height),
        "Rotate": ramp(turn),
        "Posterize": (8 - torch.arange(bins) / ((bins - 1) / (6 if wide else 4))).round().numpy(),
        "Solarize": torch.linspace(1.0, 0.0, bins).double().numpy(),
    }.items():
        table[OPS.index(name)] = values
    for name in ("Brightness", "Color", "Contrast", "Sharpness"):
        table[OPS.index(name)] = ramp(enhance)
    return table


def _on(x: torch.Tensor, values: np.ndarray, dtype=torch.float32) -> torch.Tensor:
    return on_device(np.asarray(values), x.device, dtype)


def _shear(x, m, mode, fill, axis: int):
    h, w = x.shape[-2:]
    degrees = np.degrees(np.arctan(m))
    shear = (degrees, 0.0) if axis == 0 else (0.0, degrees)
    return warp(x, inverse_matrices(shear=shear, center=(-0.5 * w, -0.5 * h)), mode, fill)


def _translate(x, m, mode, fill, axis: int):
    t = np.trunc(m)  # torchvision's int(magnitude)
    return warp(x, inverse_matrices(translate=(t, 0.0) if axis == 0 else (0.0, t)), mode, fill)


_RUN = {  # name -> (samples, magnitudes, interpolation, fill) -> samples
    "ShearX": lambda x, m, mode, fill: _shear(x, m, mode, fill, 0),
    "ShearY": lambda x, m, mode, fill: _shear(x, m, mode, fill, 1),
    "TranslateX": lambda x, m, mode, fill: _translate(x, m, mode, fill, 0),
    "TranslateY": lambda x, m, mode, fill: _translate(x, m, mode, fill, 1),
    "Rotate": lambda x, m, mode, fill: rotate(x, m, mode, fill),
    "Brightness": lambda x, m, *_: color.brightness(x, _on(x, 1.0 + m)),
    "Color": lambda x, m, *_: color.saturation(x, _on(x, 1.0 + m)),
    "Contrast": lambda x, m, *_: color.contrast(x, _on(x, 1.0 + m)),
    "Sharpness": lambda x, m, *_: tone.sharpness(x, _on(x, 1.0 + m)),
    "Posterize": lambda x, m, *_: tone.posterize(x, _on(x, m, torch.int64)),
    "Solarize": lambda x, m, *_: tone.solarize(x, _on(x, 255.0 * m)),  # compared in float32
    "AutoContrast": lambda x, *_: tone.autocontrast(x),
    "Equalize": lambda x, *_: tone.equalize(x),
    "Invert": lambda x, *_: tone.invert(x),
}


def check_mode(mode) -> str:
    """An interpolation (a name, torchvision's enum or PIL's constant) as one of MODES."""
    mode = getattr(mode, "value", mode)
    mode = _PIL_MODES.get(mode, mode) if isinstance(mode, int) else mode
    if mode not in MODES:
        raise ValueError(f"interpolation={mode!r} is not one of {', '.join(MODES)}")
    return mode


def check_fill(fill) -> tuple[float, float, float] | None:
    """torchvision's ``fill`` (None, a number, or 1 or 3 numbers) as 3 floats or None."""
    if fill is None:
        return None
    if isinstance(fill, dict):
        raise ValueError("fill given per input type (a dict) is not supported; pass one fill")
    values = [float(fill)] if isinstance(fill, (int, float)) else [float(v) for v in fill]
    if len(values) not in (1, 3):
        raise ValueError(f"fill={fill!r} is not 1 or 3 numbers (R, G, B)")
    return tuple(values * 3 if len(values) == 1 else values)


@functools.lru_cache(maxsize=8)
def _policy_table(policy: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(op codes, probabilities, bins) of ``policy``'s sub-policies: [25, 2] each."""
    subs = TORCHVISION[policy]
    codes = np.array([[OPS.index(name) for name, _, _ in sub] for sub in subs])
    probs = np.array([[p for _, p, _ in sub] for sub in subs])
    bins = np.array([[m or 0 for _, _, m in sub] for sub in subs])
    return codes, probs, bins


class _Layers:
    """What the three share: (op, bin, sign) per layer, applied through ``apply_layers``."""

    def _setup(self, bins: int) -> None:
        if not isinstance(bins, int) or bins < 2:
            raise ValueError(f"num_magnitude_bins={bins!r} is not an int >= 2")
        object.__setattr__(self, "interpolation", check_mode(self.interpolation))
        object.__setattr__(self, "fill", check_fill(self.fill))

    def _signs(self, rng: np.random.Generator, ops: np.ndarray) -> np.ndarray:
        """-1 with probability 1/2 (v2's ``rand() <= 0.5``) for the signed ops, else 1."""
        negative = (rng.random(ops.shape) <= 0.5) & _SIGNED[np.maximum(ops, 0)]
        return np.where(negative, -1.0, 1.0)

    def _ops(self) -> list:
        """The ops of ``OPS`` as ``apply_layers`` calls them (None: Identity)."""
        mode, fill = self.interpolation, self.fill

        def bind(run):
            return lambda s, cols: run(s, cols[:, 0], mode, fill)

        return [bind(_RUN[name]) if name in _RUN else None for name in OPS]

    def values(self, params: np.ndarray, height: int, width: int) -> np.ndarray:
        """[n, 2 * layers] float64: per layer the op (an index of ``OPS``, -1: none) and
        its signed magnitude, for images of ``height`` x ``width``."""
        layers, wide, bins = self._space()
        n = len(params)
        cells = params[:, : 3 * layers].reshape(n, layers, 3)
        ops, at = cells[..., 0].astype(np.int64), cells[..., 1].astype(np.int64)
        table = magnitudes(wide, bins, height, width)
        values = table[np.maximum(ops, 0), at] * cells[..., 2]
        return np.stack([ops, values], -1).reshape(n, -1)

    def apply(self, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
        """``x`` (uint8 [N, 3, H, W]) through each sample's ops, drawn in ``params``."""
        layers = self._space()[0]
        cols = self.values(params, *x.shape[-2:])
        groups = ()
        if len(x) > 1:  # a batch: its warps together, its LUT ops together (the same pixels)
            mode, fill = self.interpolation, self.fill
            names = np.asarray(OPS)
            groups = tuple(
                (frozenset(OPS.index(k) for k in kinds),
                 lambda s, codes, c, fn=fn: fn(s, names[codes], c[:, 0]))
                for kinds, fn in (
                    (WARPS, lambda s, k, m: warps(s, k, m, mode, fill)), (LUTS, lookups)
                )
            )  # fmt: skip
        return apply_layers(x, cols, self._ops(), layers, 2, groups)


@dataclass(frozen=True)
class RandAugment(_Layers):
    """torchvision's ``RandAugment``: ``num_ops`` ops a sample, each uniform over its 14,
    at bin ``magnitude`` of ``num_magnitude_bins``, signed at random."""

    num_ops: int = 2
    magnitude: int = 9
    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        self._setup(self.num_magnitude_bins)
        if not isinstance(self.num_ops, int) or self.num_ops < 0:
            raise ValueError(f"num_ops={self.num_ops!r} is not an int >= 0")
        if not 0 <= self.magnitude < self.num_magnitude_bins:
            raise ValueError(
                f"magnitude={self.magnitude!r} is not a bin of num_magnitude_bins="
                f"{self.num_magnitude_bins} (0..{self.num_magnitude_bins - 1})"
            )

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, 3 * num_ops] float64: per layer the op (an index of ``OPS``), the bin, the
        sign."""
        ops = rng.integers(0, 14, size=(n, self.num_ops))
        bins = np.full(ops.shape, self.magnitude)
        return np.stack([ops, bins, self._signs(rng, ops)], -1).reshape(n, -1).astype(np.float64)

    def _space(self) -> tuple[int, bool, int]:  # layers, the wide space, magnitude bins
        return self.num_ops, False, self.num_magnitude_bins


@dataclass(frozen=True)
class TrivialAugmentWide(_Layers):
    """torchvision's ``TrivialAugmentWide``: one op a sample, uniform over its 14, at a
    uniform bin of its wide space, signed at random."""

    num_magnitude_bins: int = 31
    interpolation: str = "nearest"
    fill: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        self._setup(self.num_magnitude_bins)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, 3] float64: the op (an index of ``OPS``), the bin, the sign."""
        ops = rng.integers(0, 14, size=(n, 1))
        bins = rng.integers(0, self.num_magnitude_bins, size=(n, 1))
        return np.stack([ops, bins, self._signs(rng, ops)], -1).reshape(n, 3).astype(np.float64)

    def _space(self) -> tuple[int, bool, int]:
        return 1, True, self.num_magnitude_bins


@dataclass(frozen=True)
class AutoAugment(_Layers):
    """torchvision's ``AutoAugment``: a sub-policy of ``policy`` ("imagenet", "cifar10",
    "svhn") a sample, each of its two ops taken with its probability, signed at random."""

    policy: str = "imagenet"
    interpolation: str = "nearest"
    fill: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        self._setup(10)
        policy = getattr(self.policy, "value", self.policy)
        if policy not in TORCHVISION:
            raise ValueError(f"policy={policy!r} is not one of {', '.join(TORCHVISION)}")
        object.__setattr__(self, "policy", policy)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, 7] float64: per op slot the op (an index of ``OPS``, -1 where its
        probability fails), the bin, the sign; then the sub-policy."""
        codes, probs, bins = _policy_table(self.policy)
        sub = rng.integers(0, len(codes), size=n)
        ops = np.where(rng.random((n, 2)) <= probs[sub], codes[sub], -1)
        cells = np.stack([ops, bins[sub], self._signs(rng, ops)], -1).reshape(n, 6)
        return np.concatenate([cells, sub[:, None]], 1).astype(np.float64)

    def _space(self) -> tuple[int, bool, int]:
        return 2, False, 10

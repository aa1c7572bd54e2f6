"""timm's RandAugment and AutoAugment (1.0.31) on a uint8 batch [N, 3, H, W], each sample
drawing its own ops.

``rand_augment("rand-m9-mstd0.5-inc1", hparams)`` and ``auto_augment("v0", hparams)`` build
them as timm's ``rand_augment_transform`` and ``auto_augment_transform`` do; ``from_timm``
reads one timm built. The draws are timm's: RandAugment's ops uniform with replacement
(weighted without, for "tweights"), AutoAugment's sub-policy uniform, each op taken with
its probability, its magnitude normal about ``magnitude`` (uniform in 0..magnitude for an
infinite std) clipped to 0..magnitude_max (10), timm's level functions and signs, and the
interpolation uniform over timm's choices (bilinear, bicubic) per application. The ops are
PIL's as timm runs them (``loader.ops.timm_ops``), the tone ops exactly. Where they differ
from PIL: bicubic is torch's (a = -0.75, PIL's a = -1: up to ~20 levels on sharp edges);
bilinear's float32 grid puts a few pixels a level off PIL's float64; nearest rotation
picks another pixel now and then (PIL's 16.16 fixed point); Posterize to 0 bits gives
black (Pillow 13 refuses it). Not supported (ValueError): AugMix, GaussianBlur ("3a").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import torch

from loader.ops import policies
from loader.ops.layers import apply_layers
from loader.ops.timm_ops import GEOMETRIC, TimmOp, is_lookup, lookups, run, warps

FILL = (128, 128, 128)  # timm's default img_mean
RANDOM = ("bilinear", "bicubic")  # timm's per-application random choice
_PIL_MODES = {0: "nearest", 2: "bilinear", 3: "bicubic"}


def _draw_ops(rng, ops: tuple[TimmOp, ...], chosen: np.ndarray, modes: int) -> np.ndarray:
    """[n, 3 * L] float64 of the ``chosen`` op indices [n, L] (-1: none): per layer the op
    (-1 where its probability fails), its argument, the interpolation (an index)."""
    shape = chosen.shape
    take, normal, uniform = rng.random(shape), rng.standard_normal(shape), rng.random(shape)
    negate, mode = rng.random(shape) > 0.5, rng.integers(0, modes, size=shape)
    code, arg = np.full(shape, -1), np.zeros(shape)
    for k in np.unique(chosen[chosen >= 0]):
        at, op = chosen == k, ops[k]
        level = np.full(int(at.sum()), float(op.magnitude))
        if op.magnitude_std == float("inf"):
            level = uniform[at] * op.magnitude
        elif op.magnitude_std > 0:
            level = level + op.magnitude_std * normal[at]
        level = np.clip(level, 0.0, op.magnitude_max or 10.0)
        arg[at] = op.arguments(level, negate[at])
        code[at] = np.where((op.prob < 1.0) & (take[at] > op.prob), -1, k)
    return np.stack([code, arg, mode], -1).reshape(len(chosen), -1).astype(np.float64)


def _apply(step, x: torch.Tensor, params: np.ndarray, ops, layers: int) -> torch.Tensor:
    names, fill = step.interpolation, step.fill

    def bind(name):
        return lambda s, cols: run(s, name, cols[:, 0], cols[:, 1], names, fill)

    groups = ()
    if len(x) > 1:  # a batch: every warp together, every LUT op together (the same pixels)
        geometric = frozenset(k for k, op in enumerate(ops) if op.name in GEOMETRIC)
        lookup = frozenset(k for k, op in enumerate(ops) if is_lookup(op.name))
        groups = (
            (geometric, lambda s, codes, cols: warps(
                s, [ops[k].name for k in codes], cols[:, 0], cols[:, 1], names, fill)),
            (lookup, lambda s, codes, cols: lookups(s, [ops[k].name for k in codes], cols[:, 0])),
        )  # fmt: skip
    return apply_layers(x, params, [bind(op.name) for op in ops], layers, 3, groups)


def _check(step) -> None:
    fill = tuple(int(v) for v in step.fill)
    if len(fill) != 3:
        raise ValueError(f"fill={step.fill!r} is not 3 numbers (R, G, B)")
    modes = tuple(step.interpolation)
    if not modes or any(m not in _PIL_MODES.values() for m in modes):
        raise ValueError(f"interpolation={modes!r} is not among {', '.join(_PIL_MODES.values())}")
    object.__setattr__(step, "fill", fill)
    object.__setattr__(step, "interpolation", modes)


@dataclass(frozen=True)
class TimmRandAugment:
    """timm's ``RandAugment``: ``num_layers`` of ``ops`` a sample (``weights``: chosen
    without replacement, as timm does), warps filled with ``fill``, interpolated with one of
    ``interpolation`` at random."""

    ops: tuple[TimmOp, ...]
    num_layers: int = 2
    weights: tuple[float, ...] | None = None
    fill: tuple[int, int, int] = FILL
    interpolation: tuple[str, ...] = RANDOM

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "ops", tuple(self.ops))
        if not self.ops:
            raise ValueError("ops is empty: give at least one op")
        if not isinstance(self.num_layers, int) or self.num_layers < 0:
            raise ValueError(f"num_layers={self.num_layers!r} is not an int >= 0")
        if self.weights is not None:
            weights = np.asarray(self.weights, dtype=np.float64)
            if len(weights) != len(self.ops) or (weights < 0).any() or weights.sum() <= 0:
                raise ValueError(f"weights={self.weights!r} are not one weight >= 0 an op")
            if self.num_layers > np.count_nonzero(weights):
                raise ValueError(
                    f"num_layers={self.num_layers} is more than the ops with a weight: "
                    "weighted choices are without replacement"
                )
            object.__setattr__(self, "weights", tuple(weights.tolist()))

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, 3 * num_layers] float64: per layer the op (an index of ``ops``, -1 where its
        probability fails), its argument (signed), the interpolation (an index)."""
        shape = (n, self.num_layers)
        if self.weights is None:
            chosen = rng.integers(0, len(self.ops), size=shape)
        else:  # Gumbel top-k: timm's (numpy's) successive draws without replacement
            with np.errstate(divide="ignore"):
                keys = np.log(self.weights) + rng.gumbel(size=(n, len(self.ops)))
            chosen = np.argsort(-keys, axis=1, kind="stable")[:, : self.num_layers]
        return _draw_ops(rng, self.ops, chosen, len(self.interpolation))

    def apply(self, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
        return _apply(self, x, params, self.ops, self.num_layers)

    def __repr__(self) -> str:  # the ops' fields would fill a screen (verbose=True prints it)
        op = self.ops[0]
        return (
            f"TimmRandAugment({len(self.ops)} ops, num_layers={self.num_layers}, "
            f"magnitude={op.magnitude:g}, magnitude_std={op.magnitude_std:g}, "
            f"weighted={self.weights is not None})"
        )


@dataclass(frozen=True)
class TimmAutoAugment:
    """timm's ``AutoAugment``: one sub-policy of ``policy`` (tuples of ``TimmOp``) a
    sample, its ops in order, each with its own probability."""

    policy: tuple[tuple[TimmOp, ...], ...]
    fill: tuple[int, int, int] = FILL
    interpolation: tuple[str, ...] = RANDOM

    def __post_init__(self) -> None:
        _check(self)
        object.__setattr__(self, "policy", tuple(tuple(sub) for sub in self.policy))
        if not self.policy or not all(self.policy):
            raise ValueError("policy has no sub-policies, or an empty one")

    @property
    def layers(self) -> int:
        return max(len(sub) for sub in self.policy)

    def _ops(self) -> tuple[tuple[TimmOp, ...], np.ndarray]:
        """(every op of the policy, flat; [sub-policies, layers] indices of them, -1 pads)."""
        flat = tuple(op for sub in self.policy for op in sub)
        index = np.full((len(self.policy), self.layers), -1)
        start = 0
        for k, sub in enumerate(self.policy):
            index[k, : len(sub)] = np.arange(start, start + len(sub))
            start += len(sub)
        return flat, index

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n, 3 * layers + 1] float64: per op slot the op (an index of the flat policy,
        -1 where its probability fails), its argument, the interpolation; then the
        sub-policy."""
        flat, index = self._ops()
        sub = rng.integers(0, len(self.policy), size=n)
        cells = _draw_ops(rng, flat, index[sub], len(self.interpolation))
        return np.concatenate([cells, sub[:, None].astype(np.float64)], 1)

    @property
    def flat_ops(self) -> tuple[TimmOp, ...]:
        """Every op of the policy in order: what a layer's op index refers to."""
        return self._ops()[0]

    def apply(self, x: torch.Tensor, params: np.ndarray) -> torch.Tensor:
        return _apply(self, x, params, self.flat_ops, self.layers)

    def __repr__(self) -> str:
        return f"TimmAutoAugment({len(self.policy)} sub-policies of up to {self.layers} ops)"


def _op(name: str, prob: float, magnitude: float, hparams: dict) -> TimmOp:
    return TimmOp(
        name,
        float(prob),
        float(magnitude),
        float(hparams.get("magnitude_std", 0.0)),
        hparams.get("magnitude_max"),
        float(hparams.get("translate_const", 250)),
        float(hparams.get("translate_pct", 0.45)),
    )


def _style(hparams: dict) -> dict:
    """The fill and interpolation of timm's hparams, as the steps take them."""
    mode = hparams.get("interpolation", RANDOM)
    return {"fill": hparams.get("img_mean", FILL), "interpolation": _modes(mode)}


def _modes(resample) -> tuple[str, ...]:
    choices = resample if isinstance(resample, (tuple, list)) else (resample,)
    try:
        return tuple(m if isinstance(m, str) else _PIL_MODES[int(m)] for m in choices)
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"interpolation {resample!r} is not nearest, bilinear or bicubic"
        ) from None


def _sections(config: list[str]):
    """(key, value) of timm's numeric config sections ("m9" -> ("m", "9")), as it splits them."""
    for section in config:
        parts = re.split(r"(\d.*)", section)
        if len(parts) >= 2:
            yield parts[0], parts[1]


def rand_augment(config_str: str, hparams: dict | None = None) -> TimmRandAugment:
    """timm's ``rand_augment_transform(config_str, hparams)`` (e.g. "rand-m9-mstd0.5-inc1")."""
    hparams = dict(hparams or {"translate_const": 250, "img_mean": FILL})
    kind, *config = config_str.split("-")
    if kind != "rand":
        raise ValueError(f"{config_str!r} does not start with 'rand'")
    choice = next((c[1:] for c in config if c.startswith("t")), None)
    args = {"m": 10, "n": 2, "inc": 0, "p": 0.5}
    for key, value in _sections([c for c in config if not c.startswith("t")]):
        if key == "mstd":
            std = float(value)
            hparams.setdefault("magnitude_std", float("inf") if std > 100 else std)
        elif key == "mmax":
            hparams.setdefault("magnitude_max", int(value))
        elif key in args:
            args[key] = float(value) if key == "p" else int(value)
        else:
            raise ValueError(f"{config_str!r}: unknown section {key + value!r}")
    if choice in ("3a", "3aw"):
        raise ValueError(f"transforms {choice!r} use GaussianBlur, which the loader lacks")
    names = policies.TIMM_RAND_INCREASING if args["inc"] else policies.TIMM_RAND
    weights = None
    if choice == "weights":
        names, weights = zip(*policies.TIMM_RAND_WEIGHTS.items(), strict=True)
        weights = tuple((np.array(weights) / np.sum(weights)).tolist())  # as timm normalises
    ops = tuple(_op(name, args["p"], args["m"], hparams) for name in names)
    return TimmRandAugment(ops, args["n"], weights, **_style(hparams))


def auto_augment(config_str: str, hparams: dict | None = None) -> TimmAutoAugment:
    """timm's ``auto_augment_transform(config_str, hparams)`` (e.g. "original-mstd0.5")."""
    hparams = dict(hparams or {"translate_const": 250, "img_mean": FILL})
    name, *config = config_str.split("-")
    if name not in policies.TIMM:
        raise ValueError(f"policy {name!r} is not one of {', '.join(policies.TIMM)}")
    for key, value in _sections(config):
        if key != "mstd":
            raise ValueError(f"{config_str!r}: unknown section {key!r}")
        hparams.setdefault("magnitude_std", float(value))
    subs = policies.TIMM[name]
    policy = tuple(tuple(_op(n, p, m, hparams) for n, p, m in sub) for sub in subs)
    return TimmAutoAugment(policy, **_style(hparams))


def _read_op(op) -> tuple[TimmOp, tuple, tuple]:
    """(our op, its fill, its interpolations) of a timm ``AugmentOp``, by attribute."""
    hparams = getattr(op, "hparams", {}) or {}
    noise = {"magnitude_std": op.magnitude_std, "magnitude_max": op.magnitude_max}
    ours = _op(op.name, op.prob, op.magnitude, {**hparams, **noise})
    fill = op.kwargs.get("fillcolor", FILL)
    fill = tuple(fill) if isinstance(fill, (tuple, list)) else fill
    if not isinstance(fill, tuple) or len(fill) != 3:
        raise ValueError(f"op {op.name}: fill {fill!r} is not 3 numbers (R, G, B)")
    return ours, fill, _modes(op.kwargs.get("resample", RANDOM))


def from_timm(obj) -> TimmRandAugment | TimmAutoAugment:
    """Our step for timm's ``RandAugment`` or ``AutoAugment`` object ``obj``, read by
    attribute (timm is not imported).

    Raises:
        ValueError: what it cannot express (AugMix, an op it lacks, ops of several fills
            or interpolations); the message says which.
    """
    kind = type(obj).__name__
    if kind == "RandAugment":
        subs = [list(obj.ops)]
    elif kind == "AutoAugment":
        subs = [list(sub) for sub in obj.policy]
    elif kind == "AugMixAugment":
        raise ValueError("AugMix blends several chains of ops an image; the loader lacks it")
    else:
        raise ValueError(f"{kind} is not timm's RandAugment or AutoAugment")
    read = [[_read_op(op) for op in sub] for sub in subs]
    styles = {(fill, modes) for sub in read for _, fill, modes in sub}
    if len(styles) > 1:
        raise ValueError(f"its ops differ in fill or interpolation: {sorted(styles)}")
    style = dict(zip(("fill", "interpolation"), styles.pop(), strict=True)) if styles else {}
    ops = [[ours for ours, _, _ in sub] for sub in read]
    if kind == "AutoAugment":
        return TimmAutoAugment(tuple(map(tuple, ops)), **style)
    weights = getattr(obj, "choice_weights", None)
    weights = None if weights is None else tuple(float(w) for w in weights)
    return TimmRandAugment(tuple(ops[0]), int(obj.num_layers), weights, **style)

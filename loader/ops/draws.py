"""The random parameters of a recipe's steps for one batch, drawn from the batch's seed.

Every path draws them here, in the same order (each step's per-sample parameters, then
RandomErasing's boxes and its noise seed), from a stream of the batch seed's own: the GPU
path applies them to the whole batch on the device, the CPU path to each image in the
workers (and erases the delivered batch), and a resumed epoch draws them again alike.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

STREAM = 44  # the steps' stream of the batch seed (crops and replacements use others)


@dataclass
class Draws:
    """One batch's draws: ``params[k]`` is step k's [n, columns] float64 array; ``boxes``
    the erasing boxes (int64 [n, 4]) and ``noise`` its noise seed, None without erasing."""

    params: list[np.ndarray]
    boxes: np.ndarray | None = None
    noise: int = 0


def draw(spec, seed: int, n: int) -> Draws:
    """The draws of ``spec`` (a ``Transform``) for a batch of ``n`` samples of ``seed``."""
    rng = np.random.default_rng([int(seed) & (2**63 - 1), STREAM])
    params = [step.draw(rng, n) for step in spec.steps]
    if spec.erasing is None:
        return Draws(params)
    boxes = spec.erasing.draw(rng, n, tuple(spec.size))
    return Draws(params, boxes, int(rng.integers(2**62)))


def widths(spec) -> list[int]:
    """Each step's parameter columns (``Draws.params[k].shape[1]``), from a draw of one."""
    return [p.shape[1] for p in draw(spec, 0, 1).params]


def split(flat: np.ndarray, widths: list[int]) -> list[np.ndarray]:
    """Each step's parameter rows of ``flat``, where they lie side by side (``widths``)."""
    bounds = np.cumsum([0, *widths])
    return [flat[:, a:b] for a, b in itertools.pairwise(bounds)]


def apply_steps(steps, x, params: list[np.ndarray]):
    """``x`` (uint8 [N, 3, H, W]) through ``steps`` with their ``params`` rows."""
    for step, p in zip(steps, params, strict=True):
        x = step.apply(x, p)
    return x

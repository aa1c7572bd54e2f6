"""WorkerSteps: a recipe's steps beyond the crop, on the CPU path, image by image in the workers.

The main process draws a batch's parameters (``loader.ops.draws``, as the GPU path does)
when it plans the batch, and they travel beside each sample's crop row, so a batch split
over any number of workers gets the same pixels. Each worker runs the steps on one image
at a time (its decoded HWC pixels, still in its cache; the workers are the parallelism):
OpenCV's ops where a step has them, else the batched torch steps on a [1, 3, H, W] view
(``image_steps``). RandomErasing acts on normalised pixels, so it stays with the delivered
batch (``erase``).
"""

from __future__ import annotations

import numpy as np
import torch

from loader.cpu import image_steps
from loader.ops.draws import draw, split, widths


class WorkerSteps:
    """The steps of ``spec`` (a ``Transform``) for crop rows of ``columns`` int32 columns."""

    def __init__(self, spec, columns: int) -> None:
        self.spec, self.columns = spec, columns
        self.widths = widths(spec)  # each step's parameter columns

    @property
    def active(self) -> bool:
        return bool(self.spec.steps)

    def plan(self, crops: np.ndarray, seed: int) -> np.ndarray:
        """``crops`` (int32 rows) with each sample's step parameters after them (their
        float64 bits, as int32 pairs)."""
        params = draw(self.spec, seed, len(crops)).params
        bits = np.ascontiguousarray(np.concatenate(params, 1), np.float64).view(np.int32)
        return np.concatenate([crops.astype(np.int32), bits], 1)

    def split(self, rows: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """(crop rows, each step's parameter rows) of planned ``rows``."""
        crops = rows[:, : self.columns]
        flat = np.ascontiguousarray(rows[:, self.columns :]).view(np.float64)
        return crops, split(flat, self.widths)

    def apply(self, image: np.ndarray, params: list[np.ndarray], k: int) -> None:
        """Run the steps on ``image`` (uint8 HWC, in place) with row ``k`` of ``params``."""
        image_steps.apply(self.spec.steps, image, [p[k] for p in params])


def erase(spec, images: torch.Tensor, seed: int) -> torch.Tensor:
    """The delivered batch ``images`` (normalised) with the recipe's RandomErasing, drawn
    from the batch ``seed`` as on the GPU path."""
    draws = draw(spec, seed, len(images))
    return spec.erasing.apply(images, draws.boxes, seed=draws.noise)

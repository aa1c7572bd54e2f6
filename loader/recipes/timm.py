"""The recipe reader's timm steps: what ``timm.data.create_transform`` makes, read as the
torchvision steps it stands for (its RandomResizedCropAndInterpolation, MaybeToTensor,
RandAugment / AutoAugment and RandomErasing)."""

from __future__ import annotations

import math

from loader.ops.erasing import RandomErasing
from loader.ops.timm_augment import from_timm
from loader.recipes.names import NotARecipe


class TimmSteps:
    """The ``Reader``'s handlers of timm's classes (a mixin: they use its state)."""

    def _timm_RandomResizedCropAndInterpolation(self, step) -> None:
        self._geometry(step, "train")
        self.args |= {"size": tuple(step.size), "scale": step.scale, "ratio": step.ratio}

    def _timm_MaybeToTensor(self, step) -> None:
        self._to_float(step, None)  # a PIL image to float in 0..1, as ToTensor

    def _timm_MaybePILToTensor(self, step) -> None:
        self._to_float(step, None)
        self.tensor = "uint8"

    def _timm_augment(self, step) -> None:
        self._pixels(step)
        try:
            self.steps.append(from_timm(step))
        except ValueError as e:
            raise NotARecipe(f"timm's {type(step).__name__}: {e}") from None

    _timm_RandAugment = _timm_augment
    _timm_AutoAugment = _timm_augment

    def _timm_RandomErasing(self, step) -> None:
        if self.tensor != "float":
            raise NotARecipe("timm's RandomErasing comes before the conversion to float")
        if (step.min_count, step.max_count) != (1, 1) or step.num_splits > 1:
            raise NotARecipe("timm's RandomErasing erases more than one box an image")
        fill = {"const": "const", "": "const", "rand": "channel", "pixel": "pixel"}[step.mode]
        ratio = tuple(math.exp(v) for v in step.log_aspect_ratio)
        self.erasing = RandomErasing(
            float(step.probability), (float(step.min_area), float(step.max_area)), ratio, fill
        )

"""What a recipe's step is: a torchvision (v1, v2) or timm transform class, by module and name.

Only the classes themselves count, never a subclass or a look-alike: a user's own class may
do anything, so it keeps torch's DataLoader (``NotARecipe`` says which step).
"""

from __future__ import annotations

_TORCHVISION = (
    "torchvision.transforms.transforms",
    "torchvision.transforms.autoaugment",
    "torchvision.transforms.v2._",
)
_TIMM = ("timm.data.transforms", "timm.data.auto_augment", "timm.data.random_erasing")


class NotARecipe(Exception):
    """The transform is not a recognised recipe; the message says which step and why."""


def name(step) -> str:
    """torchvision's class name of ``step`` ("RandAugment"), timm's with a prefix
    ("timm.RandAugment"), or "" for anything else."""
    module = type(step).__module__
    if module.startswith(_TORCHVISION):
        return type(step).__name__
    return f"timm.{type(step).__name__}" if module in _TIMM else ""


def flatten(transform) -> list:
    """The steps of a (possibly nested) ``Compose``, or ``[transform]``."""
    if name(transform) == "Compose":
        return [s for t in transform.transforms for s in flatten(t)]
    return [transform]


def interpolation(step) -> str:
    """``step``'s interpolation as "bilinear", "bicubic" or "random" (timm's choice of
    either per image: a tuple of the two).

    Raises:
        NotARecipe: another one, or a random choice among others.
    """
    mode = step.interpolation
    if isinstance(mode, (tuple, list)):
        modes = sorted(getattr(m, "value", m) for m in mode)
        if modes != ["bicubic", "bilinear"]:
            raise NotARecipe(
                f"{name(step)} picks its interpolation at random among {modes}; the loader "
                "draws between bilinear and bicubic only"
            )
        return "random"
    mode = getattr(mode, "value", mode)
    if mode not in ("bilinear", "bicubic"):
        raise NotARecipe(f"{name(step)} interpolates with {mode!r}, not bilinear or bicubic")
    return mode

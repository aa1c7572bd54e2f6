"""Recognise the standard training recipes as a built-in ``loader.Transform``.

``LMDBDataset(root, transform=T)`` given to ``loader.DataLoader`` takes the fast path when
``T`` is a recipe the loader runs itself, written with torchvision's v1 or v2 classes or
made by timm's ``create_transform``: a random resized crop (optional flip) or a resize and
centre crop, bilinear or bicubic; then, on the crop's pixels, any of ColorJitter,
RandomGrayscale, RandAugment, TrivialAugmentWide, AutoAugment (timm's auto-augment
strings too); the conversion to float, Normalize, and RandomErasing last. docs/loader.md
has the table. Anything else keeps torch's DataLoader, and the reason names the step.
"""

from __future__ import annotations

from collections.abc import Callable

from loader.augment import Transform
from loader.recipes.names import NotARecipe, flatten
from loader.recipes.reader import Reader

__all__ = ["NotARecipe", "recognise"]


def recognise(transform: Callable) -> Transform:
    """The built-in ``Transform`` that does what the recipe ``transform`` does.

    Raises:
        NotARecipe: ``transform`` is not a recipe the loader runs (see the module
            docstring); the message names the step that is not.
    """
    reader = Reader()
    for step in flatten(transform):
        reader.read(step)
    return reader.transform()

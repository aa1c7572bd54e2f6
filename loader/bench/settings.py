"""One benchmark run's settings and the recipe's constants (size, mean, std), apart from the
pipelines so that each pipeline's module (``dali``, ``train``, ``peers``) imports them, not
the registry."""

from __future__ import annotations

from dataclasses import dataclass

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
SIZE = 224
RECIPES = ("standard", "randaugment")  # train: crop + flip (+ RandAugment(num_ops=2, magnitude=9))


@dataclass(frozen=True)
class Settings:
    """One run's settings, the same for every pipeline (sent to each pipeline's process)."""

    folder: str | None
    store: str | None
    batch_size: int
    workers: int
    dtype: str
    channels_last: bool
    eval: bool
    device: str
    train_steps: int = 0
    train_warmup: int = 0
    min_pass_seconds: float = 0.0  # a pass reads whole epochs until this long has passed
    jpeg_store: str | None = None  # with --encoding: the JPEG store, which ``@jpeg`` read
    recipe: str = "standard"  # train: "randaugment" adds RandAugment(2, 9) after the flip
    workdir: str | None = None  # where the peers' conversions of the folder are kept

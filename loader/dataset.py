"""LMDBDataset: a map-style Dataset over a store that behaves like torchvision's ImageFolder."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from loader.store import Store


class LMDBDataset(Dataset):
    """``ds[i]`` is ``(PIL RGB image, label)``, as ``torchvision.datasets.ImageFolder`` gives.

    Args:
        root: a store directory made by ``ingest build``.
        transform: applied to the PIL image (e.g. torchvision transforms).
        target_transform: applied to the label.

    Attributes:
        classes, class_to_idx, targets, samples: as on ImageFolder; ``samples`` holds
        the source paths relative to the converted folder.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
    ) -> None:
        self.store = Store(root)
        self.root = str(root)
        self.transform = transform
        self.target_transform = target_transform
        self.classes = self.store.classes
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.store)

    @property
    def targets(self) -> list[int]:
        return self.store.labels.tolist()

    @property
    def samples(self) -> list[tuple[str, int]]:
        return list(zip(self.store.paths, self.targets, strict=True))

    @property
    def imgs(self) -> list[tuple[str, int]]:
        return self.samples

    def __getitem__(self, i: int) -> tuple[Any, Any]:
        data, _ = self.store.image(i)
        with Image.open(io.BytesIO(data)) as img:
            image = img.convert("RGB")
        target = int(self.store.index["label"][i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target

"""LMDBDataset: a map-style Dataset over a store that behaves like torchvision's ImageFolder."""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import Dataset

from ingest.format import read_manifest
from ingest.images.probe import png_critical
from loader.cache.shm import ShmCache, parse_cache
from loader.store import Store


class LMDBDataset(Dataset):
    """``ds[i]`` is ``(PIL RGB image, label)``, as ``torchvision.datasets.ImageFolder`` gives.

    Args:
        root: a store directory made by ``ingest build``.
        transform: applied to the PIL image (e.g. torchvision transforms).
        target_transform: applied to the label.
        cache: "shm" to read the shards from one RAM copy per node under /dev/shm, made by
            the first process that needs each one and shared by all (removed when the last
            process using it exits); "shm:keep" to keep it for the next run; None to read
            the store directly.
        cache_limit: the most bytes the cache may hold, int or a size ("8GiB"); default
            half of what ``cache_root`` has free. Shards beyond it are read from the store.
        cache_root: where the cache lives (default /dev/shm).
        max_pixels: the most pixels decoded for one image (default 178,956,970, the
            build's default ``--max-pixels``): a store that holds a larger one is refused at
            open, so that a store from elsewhere cannot make one sample cost minutes; give
            a store built with a higher ``--max-pixels`` the same value here.

    Attributes:
        classes, class_to_idx, targets, samples: as on ImageFolder; ``samples`` holds
        the source paths relative to the converted folder.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        transform: Callable | None = None,
        target_transform: Callable | None = None,
        *,
        cache: str | None = None,
        cache_limit: int | str | None = None,
        cache_root: str | os.PathLike | None = None,
        max_pixels: int | None = None,
    ) -> None:
        enabled, keep, limit, where = parse_cache(cache, cache_limit, cache_root)
        if enabled:
            read_manifest(root)  # a clear error for a path that is not a store, first
        shm = ShmCache(root, keep=keep, limit=limit, cache_root=where) if enabled else None
        self.store = Store(root, cache=shm, max_pixels=max_pixels)
        self.root = str(root)
        self.transform = transform
        self.target_transform = target_transform
        self.classes = self.store.classes
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __len__(self) -> int:
        return len(self.store)

    def cache_stats(self) -> dict[str, int] | None:
        """The shard cache's counts (``loader.cache.shm.ShmCache.stats``); None without one."""
        return None if self.store.cache is None else self.store.cache.stats()

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
        data, kind = self.store.image(i)
        row = self.store.index[i]
        image = _rgb(data, kind, int(row["height"]), int(row["width"]))
        target = int(self.store.index["label"][i])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


def _rgb(data: bytes, kind: str, height: int, width: int) -> Image.Image:
    """A stored image as a PIL RGB image (pixels' length was checked as they were read)."""
    if kind == "raw":
        pixels = np.frombuffer(data, np.uint8).reshape(height, width, -1)
        return Image.fromarray(pixels[..., 0] if pixels.shape[2] == 1 else pixels).convert("RGB")
    if kind == "png":  # a store of an older converter kept the ancillary chunks,
        data = png_critical(data)  # some of which PIL refuses (a text chunk too large)
    with warnings.catch_warnings():  # PIL's about EXIF data it cannot parse, which the
        warnings.filterwarnings("ignore", category=UserWarning, module=r"PIL\.TiffImage")
        with Image.open(io.BytesIO(data)) as img:  # build kept (the pixels are whole)
            return img.convert("RGB")

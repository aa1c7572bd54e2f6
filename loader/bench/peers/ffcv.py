"""FFCV (optional): a ``.beton`` written by its ``DatasetWriter``, read by its ``Loader``.

As FFCV's ImageNet example: an ``RGBImageField`` and an ``IntField``, the decoder that crops
(``RandomResizedCropRGBImageDecoder``; ``CenterCropRGBImageDecoder`` with --eval), flip,
normalise, random order with the OS cache. Variants: "jpg" (JPEG fields, which FFCV
re-encodes at its default quality 90) and "raw" (raw pixel fields, beside our pixel
stores). No ``max_resolution``: every pipeline reads the same images (``--max-size`` caps
them for all). On the CPU the normalisation runs in FFCV's compiled stage, before the
tensors; on a GPU after ``ToDevice``, as the example does.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from loader.bench.augment import deliver
from loader.bench.peers import conversion
from loader.bench.settings import MEAN, SIZE, STD, Settings

JPEG_QUALITY = 90  # RGBImageField's default, and the example's


def _recipe(variant: str) -> dict:
    return {"writer": "ffcv.DatasetWriter", "write_mode": variant, "jpeg_quality": JPEG_QUALITY}


def convert(s: Settings, variant: str = "jpg") -> dict:
    """The folder as ``data.beton`` (made once); its stamp."""
    from ingest.cores import usable_cores

    def write(found: list[tuple[str, int]], out) -> int:
        from ffcv.fields import IntField, RGBImageField
        from ffcv.reader import Reader
        from ffcv.writer import DatasetWriter

        image = RGBImageField(write_mode=variant, jpeg_quality=JPEG_QUALITY)
        writer = DatasetWriter(
            str(out / "data.beton"), {"image": image, "label": IntField()},
            num_workers=usable_cores(),
        )  # fmt: skip
        writer.from_indexed_dataset(_Images(found), chunksize=100)
        return Reader(str(out / "data.beton")).num_samples

    return conversion.convert(s, f"ffcv-{variant}", _recipe(variant), write)


class _Images:
    """``(RGB image, label)`` by index, as ``DatasetWriter.from_indexed_dataset`` reads."""

    def __init__(self, found: list[tuple[str, int]]) -> None:
        self.found = found

    def __len__(self) -> int:
        return len(self.found)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.found[i]
        with Image.open(path) as im:
            return im.convert("RGB"), label


def _pipelines(s: Settings) -> dict:
    """FFCV's operations for the image and the label, to the run's device and dtype."""
    import torch
    from ffcv.fields.decoders import (
        CenterCropRGBImageDecoder,
        IntDecoder,
        RandomResizedCropRGBImageDecoder,
    )
    from ffcv.transforms import (
        NormalizeImage,
        RandomHorizontalFlip,
        Squeeze,
        ToDevice,
        ToTensor,
        ToTorchImage,
    )

    if s.eval:
        image = [CenterCropRGBImageDecoder((SIZE, SIZE), ratio=0.875)]
    else:
        image = [RandomResizedCropRGBImageDecoder((SIZE, SIZE)), RandomHorizontalFlip()]
    # float16 normalises to float16; bfloat16 (which NumPy lacks) to float32, then converted
    normalise = [] if s.dtype == "uint8" else [
        NormalizeImage(np.array(MEAN) * 255, np.array(STD) * 255,
                       np.float16 if s.dtype == "float16" else np.float32)
    ]  # fmt: skip
    to_torch = ToTorchImage(channels_last=s.channels_last)
    if s.device == "cpu":
        image += [*normalise, ToTensor(), to_torch]
        label = [IntDecoder(), ToTensor(), Squeeze()]
    else:
        device = torch.device(s.device)
        image += [ToTensor(), ToDevice(device, non_blocking=True), to_torch, *normalise]
        label = [IntDecoder(), ToTensor(), Squeeze(), ToDevice(device, non_blocking=True)]
    return {"image": image, "label": label}


class FfcvPipeline:
    """FFCV's ``Loader`` on the ``.beton`` of ``variant`` behind ``epoch()`` / ``close()``."""

    def __init__(self, s: Settings, variant: str = "jpg") -> None:
        from ffcv.loader import Loader, OrderOption

        self.s = s
        stamp = convert(s, variant)
        what = "raw pixel fields" if variant == "raw" else f"JPEG fields (q{JPEG_QUALITY})"
        self.made = conversion.summary(stamp, f".beton, {what}")
        self.loader = Loader(
            str(conversion.place(s, f"ffcv-{variant}") / "data.beton"),
            batch_size=s.batch_size,
            num_workers=max(1, s.workers),  # FFCV's workers are threads; at least one
            order=OrderOption.RANDOM,
            os_cache=True,  # the dataset fits in memory, as the example's choice for it
            drop_last=True,  # as every pipeline: one batch shape
            pipelines=_pipelines(s),
            seed=0,
        )

    def epoch(self) -> Iterator:
        for images, labels in self.loader:
            yield deliver(images, labels.view(-1), self.s)

    def close(self) -> None:
        self.loader = None

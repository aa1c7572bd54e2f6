"""LitData (optional): chunks written by its ``optimize``, read by its ``StreamingDataset``
and ``StreamingDataLoader``.

As LitData's ImageNet benchmark: ``optimize`` over ``(path, label)`` inputs, each sample an
opened JPEG (stored as the file's own bytes) and its label, 64 MB chunks, one worker per
core; read from the local directory, shuffled, each JPEG decoded by LitData to a uint8
tensor and augmented (the dataset's ``transform``) by torchvision's v2 transforms on
tensors: the same crop, flip and normalisation as the baseline's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Iterator

from loader.bench.augment import deliver, loader_options, tensor_transform
from loader.bench.peers import conversion
from loader.bench.settings import Settings

CHUNK_BYTES = "64MB"  # LitData's ImageNet benchmark


def _sample(item: tuple[str, int]):
    """One input of ``optimize``: the opened JPEG and its label."""
    from PIL import Image

    path, label = item
    return Image.open(path), label


def convert(s: Settings) -> dict:
    """The folder as LitData chunks (made once); its stamp."""
    from ingest.cores import usable_cores

    def write(found: list[tuple[str, int]], out) -> int:
        from litdata import optimize

        before = mp.get_start_method(allow_none=True)
        try:
            optimize(
                fn=_sample, inputs=found, output_dir=str(out), chunk_bytes=CHUNK_BYTES,
                num_workers=usable_cores(),
            )  # fmt: skip
        finally:  # optimize sets it for the whole process (to spawn, its default)
            mp.set_start_method(before, force=True)
        chunks = json.loads((out / "index.json").read_text())["chunks"]
        return sum(c["chunk_size"] for c in chunks)

    recipe = {"writer": "litdata.optimize", "chunk_bytes": CHUNK_BYTES}
    return conversion.convert(s, "litdata", recipe, write)


class _Augment:
    """The transform LitData's ``StreamingDataset`` applies to each ``(image, label)``."""

    def __init__(self, s: Settings) -> None:
        self.transform = tensor_transform(s)

    def __call__(self, item):
        image, label = item
        if image.shape[0] == 1:  # a grey JPEG: three channels, as PIL's convert("RGB")
            image = image.expand(3, -1, -1)
        return self.transform(image[:3]), int(label)


class LitdataPipeline:
    """LitData's ``StreamingDataLoader`` on the chunks behind ``epoch()`` / ``close()``."""

    def __init__(self, s: Settings) -> None:
        from litdata import StreamingDataLoader, StreamingDataset

        self.s = s
        self.made = conversion.summary(convert(s), "LitData chunks, JPEG bytes")
        dataset = StreamingDataset(
            str(conversion.place(s, "litdata")), shuffle=True, transform=_Augment(s)
        )
        self.dl = StreamingDataLoader(dataset, **loader_options(s))

    def epoch(self) -> Iterator:
        for images, labels in self.dl:
            yield deliver(images, labels, self.s)

    def close(self) -> None:
        self.dl = None

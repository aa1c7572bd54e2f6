"""MosaicML Streaming (optional): MDS shards written by its ``MDSWriter``, read by its
``StreamingImageNet`` through torch's DataLoader.

As Streaming's ImageNet converter: a ``jpeg`` column (the files' own bytes: an opened
JPEG is stored as it is) and an ``int`` label, the samples shuffled, no compression,
the writer's default shard size. Read from the local directory (no remote), shuffled,
the dataset told the batch size so that it hands each worker whole batches; decoded to
PIL and augmented by the same torchvision transforms as the baseline.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

from loader.bench.augment import deliver, loader_options, torch_transform
from loader.bench.peers import conversion
from loader.bench.settings import Settings

COLUMNS = {"x": "jpeg", "y": "int"}


def convert(s: Settings) -> dict:
    """The folder as MDS shards (made once); its stamp."""

    def write(found: list[tuple[str, int]], out) -> int:
        from PIL import Image
        from streaming import MDSWriter

        with MDSWriter(out=str(out), columns=COLUMNS, compression=None) as writer:
            for path, label in found:
                with Image.open(path) as image:
                    writer.write({"x": image, "y": label})
        return sum(
            shard["samples"] for shard in json.loads((out / "index.json").read_text())["shards"]
        )

    return conversion.convert(s, "mds", {"writer": "streaming.MDSWriter", **COLUMNS}, write)


class _RGB:
    """The recipe on an RGB image: Streaming's jpeg column gives the image as stored (grey
    or CMYK too), where ImageFolder converts to RGB."""

    def __init__(self, transform) -> None:
        self.transform = transform

    def __call__(self, image):
        return self.transform(image.convert("RGB"))


class MdsPipeline:
    """``StreamingImageNet`` on the shards, in torch's DataLoader, behind ``epoch()``."""

    def __init__(self, s: Settings) -> None:
        import torch.utils.data
        from streaming.vision import StreamingImageNet

        self.s = s
        self.made = conversion.summary(convert(s), "MDS shards, jpeg column")
        self.dataset = StreamingImageNet(
            local=str(conversion.place(s, "mds")),
            batch_size=s.batch_size,
            shuffle=True,
            # one machine: one canonical node, so that an epoch is every sample once (the
            # default, 64, repeats samples where they do not divide evenly among 64)
            num_canonical_nodes=1,
            transform=_RGB(torch_transform(s)),
        )
        self.dl = torch.utils.data.DataLoader(self.dataset, **loader_options(s))

    def epoch(self) -> Iterator:
        for images, labels in self.dl:
            yield deliver(images, labels, self.s)

    def close(self) -> None:
        self.dl = self.dataset = None

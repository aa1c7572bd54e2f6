"""WebDataset (optional): tar shards written by its ``ShardWriter``, read by ``WebDataset``
and ``WebLoader``.

As WebDataset's ImageNet example: each sample the JPEG file's bytes (``.jpg``) and its
class (``.cls``) under a numbered key, the samples shuffled, shards of at most 1000; here
at least four shards per worker, since each worker reads whole shards (fewer would leave
workers idle). Read as its docs recommend for training: shards shuffled and split over
the workers, samples shuffled in a buffer, decoded to PIL, augmented and batched in the
workers, then unbatched, shuffled across workers and batched again in the loader.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from pathlib import Path

from loader.bench.augment import deliver, torch_transform
from loader.bench.peers import conversion
from loader.bench.settings import Settings

MAX_PER_SHARD = 1000  # the ImageNet example's shards
SHUFFLE = 1000  # samples in each shuffle buffer


def _per_shard(samples: int, workers: int) -> int:
    """Samples per shard: at most ``MAX_PER_SHARD``, at least 4 shards per worker."""
    return max(1, min(MAX_PER_SHARD, -(-samples // (4 * max(1, workers)))))


def convert(s: Settings) -> dict:
    """The folder as tar shards (made once); its stamp."""
    workers = max(1, s.workers)

    def write(found: list[tuple[str, int]], out) -> int:
        import webdataset as wds

        pattern = str(out / "shard-%06d.tar")
        maxcount = _per_shard(len(found), workers)
        with wds.ShardWriter(pattern, maxcount=maxcount, verbose=0) as sink:
            for i, (path, label) in enumerate(found):
                with open(path, "rb") as f:
                    sink.write({"__key__": f"{i:08d}", "jpg": f.read(), "cls": label})
        return _count(out)

    # the shard size follows from the images (the stamp's signature) and the workers
    recipe = {"writer": "webdataset.ShardWriter", "max_per_shard": MAX_PER_SHARD,
              "workers": workers}  # fmt: skip
    return conversion.convert(s, "wds", recipe, write)


def _count(out: Path) -> int:
    """Samples in the shards under ``out``, from their tar headers (two files each)."""
    members = 0
    for shard in out.glob("shard-*.tar"):
        with tarfile.open(shard) as tar:
            members += len(tar.getmembers())
    return members // 2


class WdsPipeline:
    """``WebLoader`` over the shards behind ``epoch()`` / ``close()``."""

    def __init__(self, s: Settings) -> None:
        import webdataset as wds

        self.s = s
        self.made = conversion.summary(convert(s), "tar shards (.jpg, .cls)")
        urls = sorted(str(p) for p in conversion.place(s, "wds").glob("shard-*.tar"))
        dataset = (
            wds.WebDataset(urls, shardshuffle=len(urls))
            .shuffle(SHUFFLE)
            .decode("pil")
            .to_tuple("jpg", "cls")
            .map_tuple(torch_transform(s), int)
            .batched(s.batch_size, partial=True)  # a worker's last batch goes to the rebatch
        )
        self.dl = (
            wds.WebLoader(
                dataset,
                batch_size=None,
                num_workers=s.workers,
                persistent_workers=s.workers > 0,
                # not pinned: the batches are made again in this process (a pinned one
                # would be copied out of the pinned memory at once)
            )
            .unbatched()
            .shuffle(SHUFFLE)
            .batched(s.batch_size, partial=False)  # as every pipeline: one batch shape
        )

    def epoch(self) -> Iterator:
        import torch

        for images, labels in self.dl:
            yield deliver(images, torch.as_tensor(labels), self.s)

    def close(self) -> None:
        self.dl = None

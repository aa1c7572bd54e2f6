"""NVIDIA DALI peers (optional): its file reader, or JPEG bytes held in RAM fed through
``external_source``; decode on the GPU ("mixed") when there is one, else on the CPU.

Variants: "file" (decoders.image + random_resized_crop), "crop" (decoders.image_random_crop,
which decodes only the crop window, + resize) and "ram" (as "crop", fed from RAM); each ends
in crop_mirror_normalize, as torchvision's flip + normalise. With --eval all decode the
whole image, resize the short side and crop the centre.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from loader.bench.settings import MEAN, SIZE, STD, Settings

_EXTENSIONS = {".jpg", ".jpeg", ".png"}


class RamSource:
    """Every image of an ImageFolder tree as bytes in RAM, served as shuffled epochs of
    ``(jpegs, labels)`` batches (full ones: the rest of an epoch is dropped, as every
    pipeline of the benchmark drops it). DALI calls ``next`` for each batch;
    at the end of an epoch it gets StopIteration once, and the next call starts a new epoch
    in a new order."""

    def __init__(self, folder: str, batch_size: int, seed: int = 0) -> None:
        classes = sorted(d for d in Path(folder).iterdir() if d.is_dir() and d.name[0] != ".")
        self.data, self.labels = [], []
        for label, d in enumerate(classes):
            for p in sorted(d.rglob("*")):
                if p.suffix.lower() in _EXTENSIONS and p.name[0] != ".":
                    self.data.append(np.frombuffer(p.read_bytes(), np.uint8))
                    self.labels.append(np.array([label], np.int32))
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)
        self._order, self._pos = self.rng.permutation(len(self.data)), 0

    def __iter__(self) -> RamSource:
        return self

    def __next__(self) -> tuple[list, list]:
        if self._pos + self.batch_size > len(self._order):
            self._order, self._pos = self.rng.permutation(len(self.data)), 0
            raise StopIteration
        chunk = self._order[self._pos : self._pos + self.batch_size]
        self._pos += len(chunk)
        return [self.data[j] for j in chunk], [self.labels[j] for j in chunk]


def _graph(variant: str, s: Settings, source: RamSource | None):
    """The DALI pipeline definition of ``variant`` (lazily imported DALI)."""
    from nvidia.dali import fn, pipeline_def, types

    decode_on = "cpu" if s.device == "cpu" else "mixed"
    dtype = {"float16": types.FLOAT16, "uint8": types.UINT8}.get(s.dtype, types.FLOAT)
    raw = s.dtype == "uint8"

    @pipeline_def(enable_conditionals=s.recipe != "standard")
    def graph():
        if source is None:
            jpegs, labels = fn.readers.file(file_root=s.folder, random_shuffle=True, name="Reader")
        else:
            jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True)
        if s.eval:
            images = fn.decoders.image(jpegs, device=decode_on, output_type=types.RGB)
            images = fn.resize(images, resize_shorter=int(SIZE / 0.875))
        elif variant == "file":
            images = fn.decoders.image(jpegs, device=decode_on, output_type=types.RGB)
            images = fn.random_resized_crop(images, size=[SIZE, SIZE])
        else:
            images = fn.decoders.image_random_crop(jpegs, device=decode_on, output_type=types.RGB)
            images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
        if s.recipe == "randaugment" and not s.eval:  # as torchvision's RandAugment(2, 9)
            from nvidia.dali.auto_aug import rand_augment

            images = rand_augment.rand_augment(images, n=2, m=9, shape=(SIZE, SIZE))
        images = fn.crop_mirror_normalize(
            images,
            dtype=dtype,
            output_layout="HWC" if s.channels_last else "CHW",
            crop=(SIZE, SIZE),
            mean=[0.0] * 3 if raw else [m * 255 for m in MEAN],
            std=[1.0] * 3 if raw else [d * 255 for d in STD],
            mirror=0 if s.eval else fn.random.coin_flip(),
        )
        return images, labels

    return graph


class DaliPipeline:
    """A DALI variant behind the benchmark's ``epoch()`` / ``close()`` interface."""

    def __init__(self, variant: str, s: Settings) -> None:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.s = s
        source = RamSource(s.folder, s.batch_size) if variant == "ram" else None
        pipe = _graph(variant, s, source)(
            batch_size=s.batch_size,
            num_threads=max(1, s.workers),
            device_id=None if s.device == "cpu" else 0,
            seed=0,
        )
        pipe.build()
        self.it = DALIGenericIterator(
            pipe,
            ["images", "labels"],
            reader_name=None if source is not None else "Reader",
            last_batch_policy=LastBatchPolicy.DROP,  # as the others: one batch shape
            auto_reset=False,
        )
        self._fresh = True

    def epoch(self) -> Iterator:
        import torch

        if not self._fresh:
            self.it.reset()  # here, not at the end of the last epoch: its cost is timed
        self._fresh = False
        for out in self.it:
            images, labels = out[0]["images"], out[0]["labels"]
            if self.s.channels_last:  # NHWC from DALI: the same memory, seen as NCHW
                images = images.permute(0, 3, 1, 2)
            if self.s.dtype == "bfloat16":
                images = images.to(torch.bfloat16)
            images = images.to(self.s.device, non_blocking=True)
            yield images, labels.view(-1).long().to(self.s.device, non_blocking=True)

    def close(self) -> None:
        self.it = None

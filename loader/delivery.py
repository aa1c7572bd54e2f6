"""Delivery: a filled ring slot made into the batch the training loop receives.

It also keeps the record of the samples that failed to decode (each replaced by another
sample in the workers), logged once each, so that a user learns which file to look at.
"""

from __future__ import annotations

import logging

import torch

from ingest import format as fmt
from loader.cpu.steps import erase
from loader.records import verify_advice

log = logging.getLogger("loader.dataloader")  # the DataLoader's log, where users look


class Delivery:
    """Batches out of ring slots, on the loader's device, with the bad samples noted."""

    def __init__(self, store, output, stats, settings, spec=None) -> None:
        self.store, self.output, self.stats, self.settings = store, output, stats, settings
        self.spec = spec  # the CPU path's transform, whose RandomErasing acts here
        self.erasing = None if spec is None else spec.erasing
        self._labels = store.labels
        self.bad_samples: dict[int, str] = {}
        self.num_replaced = 0

    def batch(self, slot: dict[str, torch.Tensor], report) -> tuple:
        """The batch of a filled ring slot, as the loop receives it."""
        self.note_bad(report.bad)
        self.stats.add(
            batches=1, samples=report.n, cpu_decoded=report.cpu_decoded,
            cpu_decode_s=report.decode_s,
        )  # fmt: skip
        indices = slot["indices"][: report.n].numpy().copy()
        images = self.output.images(slot["images"][: report.n])
        if self.erasing is not None:  # the CPU path's: on the normalised batch
            images = erase(self.spec, images, report.seed)
        labels = self.output.labels(self._labels[indices])
        if self.settings.with_indices:
            return images, labels, torch.from_numpy(indices)
        return images, labels

    def note_bad(self, bad: list[tuple[int, str]]) -> None:
        """Record and log (once each) the samples that failed to decode."""
        for index, reason in bad:
            self.num_replaced += 1
            if index not in self.bad_samples:
                path = self._path_of(index)
                self.bad_samples[index] = f"{path}: {reason}"
                log.warning(
                    "DataLoader: sample %d (%s) could not be decoded (%s); it is replaced "
                    "by another sample, now and in later epochs (logged once)%s",
                    index,
                    path,
                    reason,
                    verify_advice(reason, self.store.root),
                )

    def _path_of(self, index: int) -> str:
        """Sample ``index``'s source path for a message (never an error: it is metadata)."""
        try:
            return fmt.shown(self.store.paths[index])
        except fmt.StoreError as e:
            return f"its path unknown: {e}"

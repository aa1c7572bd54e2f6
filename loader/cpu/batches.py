"""PixelBatches: batch tasks (indices, seed) -> decoded, augmented pixels in a buffer slot.

Workers (or the main process, with ``num_workers=0``) ``fill`` rows of a slot: each plans
the whole batch (``plan``: crop parameters for all its samples, drawn from the batch's seed
and the index before anything is decoded), reads its rows' records straight from the
store's shards, decodes each image into its row, and replaces a record that fails to
decode by another sample, reporting it. A batch producer declares its buffers by
name, shape and dtype, so a producer that gathers encoded bytes for a GPU decoder (one
contiguous byte buffer plus offsets) plugs into the same workers and ring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import cv2
import lmdb
import numpy as np

from ingest.format import RecordError
from loader.augment import CROP_COLUMNS, Transform, plan_crops
from loader.cpu.steps import WorkerSteps
from loader.decode import DecodeError, get_decoder
from loader.store import Store

MAX_REPLACEMENTS = 16  # bad records in a row before the store is declared damaged


@dataclass
class BatchReport:
    """What a producer tells the main process about one batch it wrote.

    Attributes:
        n: samples written (the last batch of an epoch may be short).
        bad: (sample index, reason) for each record that failed and was replaced.
    """

    n: int
    bad: list[tuple[int, str]] = field(default_factory=list)
    seed: int = 0  # the batch's (its steps' draws come from it)
    cpu_decoded: int = 0  # samples decoded on the CPU by the workers
    decode_s: float = 0.0  # worker seconds spent decoding them
    worker_s: float = 0.0  # worker seconds spent on the batch in all

    def merge(self, part: BatchReport) -> None:
        """Add the report of one chunk of the batch."""
        self.bad += part.bad
        self.cpu_decoded += part.cpu_decoded
        self.decode_s += part.decode_s
        self.worker_s += part.worker_s


class PixelBatches:
    """Decodes, crops and resizes batches of a store into uint8 RGB slots.

    Args:
        store: the store to read.
        spec: the built-in transform to apply.
        batch_size: the most samples a slot holds.
        decoder: registry name of a decoder that runs in workers (``loader.decode``).
        planar: slots hold [N, 3, H, W] (what NCHW outputs want) instead of [N, H, W, 3].
            The worker splits the channels while the pixels are still in its cache, which
            costs a quarter of what it costs the main process later.
    """

    def __init__(
        self,
        store: Store,
        spec: Transform,
        batch_size: int,
        decoder: str = "cpu",
        planar: bool = False,
    ) -> None:
        self.store, self.spec, self.batch_size = store, spec, batch_size
        self.decoder_name, self.planar = decoder, planar
        self._decoder = None
        self._scratch: np.ndarray | None = None  # HWC pixels before the channel split
        self.steps = WorkerSteps(spec, len(CROP_COLUMNS))  # a recipe's, after the crop

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_decoder": None, "_scratch": None}  # per process

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, numpy dtype) of one slot's buffers."""
        h, w = self.spec.size
        shape = (self.batch_size, 3, h, w) if self.planar else (self.batch_size, h, w, 3)
        return {"images": (shape, "uint8"), "indices": ((self.batch_size,), "int64")}

    def decide(self, seed: int) -> tuple:
        """What the main process decides for the batch of ``seed`` and its workers cannot
        (nothing here; the GPU path: its share routed to the CPU), for ``plan``."""
        return ()

    def plan(self, indices: np.ndarray, seed: int) -> np.ndarray:
        """Crop parameters of a batch, drawn from ``seed`` and the index's image sizes,
        each row followed by the sample's step parameters where the recipe has steps.

        A function of the batch (and what ``decide`` gave), not of the rows a worker
        fills: each worker plans the whole batch and fills its share of it (``fill``), so
        that a batch comes out the same whatever the number of workers, and the planning
        takes none of the training process's interpreter.
        """
        crops = self.crops(indices, seed)
        return self.steps.plan(crops, seed) if self.steps.active else crops

    def crops(self, indices: np.ndarray, seed: int) -> np.ndarray:
        """Crop parameters of a batch (int32 rows of ``CROP_COLUMNS``)."""
        rng = np.random.default_rng(seed)
        index = self.store.index
        return plan_crops(self.spec, index["height"][indices], index["width"][indices], rng)

    def fill(
        self,
        slot: dict[str, np.ndarray],
        lo: int,
        hi: int,
        indices: np.ndarray,
        seed: int,
        *decided,
    ) -> BatchReport:
        """Plan the batch ``indices`` (``decided``: what ``decide`` gave for it) and fill
        its rows ``lo:hi`` into ``slot``: a worker's task."""
        rows = self.plan(indices, seed, *decided)
        return self.fill_rows(slot, lo, indices[lo:hi], rows[lo:hi], seed)

    def fill_rows(
        self,
        slot: dict[str, np.ndarray],
        lo: int,
        indices: np.ndarray,
        crops: np.ndarray,
        seed: int,
    ) -> BatchReport:
        """Write samples ``indices`` with ``crops`` into rows ``lo:`` of ``slot``.

        ``seed`` (the batch's) seeds the choice of replacements for records that fail.
        """
        started = time.perf_counter()
        self._ensure_decoder()
        report = BatchReport(len(indices), seed=seed)
        images = slot["images"]
        steps = self.steps.active
        if steps:
            crops, params = self.steps.split(crops)
        for k, (i, crop) in enumerate(zip(indices.tolist(), crops, strict=True)):
            row = lo + k
            out = self._scratch if self.planar else images[row]
            slot["indices"][row] = self.decode_sample(i, crop, out, (seed, row), report)
            if steps:
                self.steps.apply(out, params, k)
            if self.planar:
                cv2.split(out, list(images[row]))  # straight into the slot's three planes
        report.cpu_decoded = len(indices)
        report.decode_s = report.worker_s = time.perf_counter() - started  # reads included
        return report

    def _ensure_decoder(self) -> None:
        """Create this process's decoder (and scratch) on first use."""
        if self._decoder is None:
            self._decoder = get_decoder(self.decoder_name, antialias=self.spec.antialias)
            self._scratch = np.empty((*self.spec.size, 3), np.uint8) if self.planar else None

    def decode_sample(self, i: int, crop, out: np.ndarray, key: tuple, report: BatchReport) -> int:
        """Decode sample ``i`` into ``out`` (uint8 HWC of the output size), or a replacement
        drawn from ``key`` (the batch seed and row) when its record fails; report the
        failures; return the index written."""
        self._ensure_decoder()
        rng = None
        for _ in range(MAX_REPLACEMENTS):
            try:
                data, kind = self.read(i)
                shape = (int(self.store.index["height"][i]), int(self.store.index["width"][i]))
                self._decoder.decode_into(data, kind, shape, crop, out)
                return i
            except DecodeError as e:
                report.bad.append((i, str(e)))
            # Replacements drawn from (batch seed, row) keep the batch reproducible whatever
            # the split of the batch over workers.
            rng = rng or np.random.default_rng(key)
            i = int(rng.integers(len(self.store)))
            row = self.store.index[i : i + 1]
            crop = plan_crops(self.spec, row["height"], row["width"], rng)[0]
        failed, last = report.bad[-1]  # not ``i``: the replacement drawn after it
        todo = [f"check it with `ingest verify {self.store.root}`"] * ("`ingest verify" not in last)
        todo += ["rebuild it"] * ("rebuild" not in last)  # what ``last`` does not say already
        raise RuntimeError(
            f"{self.store.root}: {MAX_REPLACEMENTS} records in a row failed to decode (last: "
            f"sample {failed}, {last}); the store looks damaged"
            + (f": {' and '.join(todo)}" if todo else "")
        )

    def read(self, i: int) -> tuple[bytes, str]:
        """The encoded image of sample ``i`` and its format, checked (``Store.record``:
        CRC-32, fields, pixel limit) before anything decodes it.

        Raises:
            DecodeError: the record is missing, damaged or too large (names the shard and
                key): a bad sample, replaced and counted.
            ingest.format.StoreError: the store itself is unusable (a shard truncated, or
                written by another build): no replacement can help.
        """
        try:
            return self.store.image(i)
        except (RecordError, KeyError, lmdb.Error) as e:  # KeyError: a missing record
            raise DecodeError(f"damaged record: {e}") from None

"""PixelBatches: one batch task (indices, seed) -> decoded pixels written into a buffer slot.

The unit of work a worker process runs (or the main process, with ``num_workers=0``). It
reads records straight from the store's shards, draws crop parameters for the whole batch
from the index, decodes each image into its row of the slot, and replaces a record that
fails to decode by another sample, reporting it. A batch producer declares its buffers by
name, shape and dtype, so a producer that gathers encoded bytes for a GPU decoder (one
contiguous byte buffer plus offsets) plugs into the same workers and ring.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack
import numpy as np
import zstandard

from ingest.codec import image_bytes, unpack_record
from loader.augment import Transform, plan_crops
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


class PixelBatches:
    """Decodes, crops and resizes batches of a store into uint8 NHWC RGB slots.

    Args:
        store: the store to read.
        spec: the built-in transform to apply.
        batch_size: the most samples a slot holds.
        decoder: registry name of a decoder that runs in workers (``loader.decode``).
    """

    def __init__(self, store: Store, spec: Transform, batch_size: int, decoder: str = "cpu"):
        self.store, self.spec, self.batch_size = store, spec, batch_size
        self.decoder_name = decoder
        self._decoder = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_decoder": None}  # decoders are per process

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, numpy dtype) of one slot's buffers."""
        h, w = self.spec.size
        return {
            "images": ((self.batch_size, h, w, 3), "uint8"),
            "indices": ((self.batch_size,), "int64"),
        }

    def fill(self, slot: dict[str, np.ndarray], indices: np.ndarray, seed: int) -> BatchReport:
        """Write the batch of ``indices`` into ``slot``; augmentation drawn from ``seed``."""
        if self._decoder is None:
            self._decoder = get_decoder(self.decoder_name, antialias=self.spec.antialias)
        rng = np.random.default_rng(seed)
        index = self.store.index
        crops = plan_crops(self.spec, index["height"][indices], index["width"][indices], rng)
        report = BatchReport(len(indices))
        for pos, i in enumerate(indices):
            slot["indices"][pos] = self._one(int(i), crops[pos], slot["images"][pos], rng, report)
        return report

    def _one(self, i: int, crop, out: np.ndarray, rng, report: BatchReport) -> int:
        """Decode sample ``i`` into ``out``, or a replacement; return the index written."""
        for _ in range(MAX_REPLACEMENTS):
            try:
                data, kind = self.read(i)
                shape = (int(self.store.index["height"][i]), int(self.store.index["width"][i]))
                self._decoder.decode_into(data, kind, shape, crop, out)
                return i
            except DecodeError as e:
                report.bad.append((i, str(e)))
            # A replacement drawn from the batch's own stream keeps the batch reproducible.
            i = int(rng.integers(len(self.store)))
            row = self.store.index[i : i + 1]
            crop = plan_crops(self.spec, row["height"], row["width"], rng)[0]
        raise RuntimeError(
            f"{self.store.root}: {MAX_REPLACEMENTS} records in a row failed to decode (last: "
            f"sample {i}, {report.bad[-1][1]}); the store looks damaged: check it with "
            f"`ingest verify {self.store.root}` and rebuild it"
        )

    def read(self, i: int) -> tuple[bytes, str]:
        """The encoded image of sample ``i`` and its format.

        Raises:
            DecodeError: the record is missing or damaged (names the shard and key).
        """
        try:
            record = unpack_record(self.store.raw(i))
            return image_bytes(record), record["format"]
        except KeyError as e:  # a missing record, or a record without a field
            raise DecodeError(f"damaged record: {e}") from None
        except (msgpack.UnpackException, ValueError, TypeError, zstandard.ZstdError) as e:
            raise DecodeError(f"damaged record: {type(e).__name__}: {e}") from None

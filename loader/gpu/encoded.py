"""EncodedBatches: batch tasks -> encoded JPEG bytes for a GPU decoder, plus a CPU share.

The GPU path's producer. Each batch is planned (crop windows, as on the CPU path) and
every sample routed, given the share the main process decided for the CPU: to the GPU
decoder (baseline JPEGs, whose bytes the workers copy into one contiguous byte buffer of
the slot, each at an offset planned from the index), to the GPU's kernels alone (a pixel
record: the workers copy its crop window's pixels into the same buffer, before the
JPEGs, so that one copy takes the batch's windows to the device) or to the CPU (PNGs,
progressive JPEGs, which the hardware JPEG engines do not take, what would overflow the
slot, and a share of the JPEGs chosen to keep both sides busy), which the workers
decode, crop and resize into the slot's pixel rows exactly as the CPU path does. A batch
therefore crosses processes as one buffer, never as a tensor per sample.
"""

from __future__ import annotations

import time

import numpy as np
import simplejpeg

from ingest import format as fmt
from ingest.images.probe import without_icc
from loader.augment import CROP_COLUMNS, Transform
from loader.cpu.batches import BatchReport, PixelBatches
from loader.cpu.decode import reductions
from loader.decode import DecodeError
from loader.gpu.step_tables import StepTables
from loader.gpu.tuning.routing import Routing
from loader.store import Store

# Extra columns of a planned row, after CROP_COLUMNS: where the worker puts the sample's
# bytes in the slot's byte buffer, and how many bytes it may take there (0: decode on the
# CPU instead).
START, ROOM = len(CROP_COLUMNS), len(CROP_COLUMNS) + 1
_SLACK = 1.5  # byte buffer per slot: batch_size records of this many times the mean size
# A pixel record's crop window counted as this share of its pixels when sizing the buffer:
# RandomResizedCrop's windows average about half the image; eval resizes the whole image.
_WINDOW_SHARE = {"train": 0.6, "eval": 1.0}
# The most bytes of a slot's buffer kept for pixel windows (a raw store of camera-sized
# images would otherwise take gigabytes of shared, page-locked memory a slot); what does
# not fit is cropped by the workers.
_MAX_WINDOW_ROOM = 256 << 20


class EncodedBatches(PixelBatches):
    """Gathers encoded bytes for a GPU decoder and decodes the CPU share in the workers.

    Args:
        store: the store to read.
        spec: the built-in transform (its crop windows are planned here).
        batch_size: the most samples a slot holds.
        cpu_share: fraction of the GPU-decodable samples of each batch decoded on the CPU
            instead (the start of ``routing``, which the GPU stage's tuning replaces).
    """

    def __init__(
        self, store: Store, spec: Transform, batch_size: int, cpu_share: float = 0.0
    ) -> None:
        super().__init__(store, spec, batch_size, decoder="cpu", planar=False)
        index = store.index
        self._gpu_ok = (index["format"] == fmt.FORMAT_CODES["jpeg"]) & (
            (index["flags"] & fmt.FLAG_PROGRESSIVE) == 0
        )
        self._pixels = index["format"] == fmt.FORMAT_CODES["raw"]
        self._channels = np.asarray(index["channels"], dtype=np.int64)
        # Sized for what may go to the GPU: JPEG bytes, and pixel windows up to a cap (a
        # window that does not fit is cropped by the workers instead).
        jpegs = np.asarray(index["nbytes"], dtype=np.int64)[self._gpu_ok]
        pixels = index["height"].astype(np.float64) * index["width"] * self._channels
        sizes = np.concatenate([jpegs, pixels[self._pixels] * _WINDOW_SHARE[spec.kind]])
        jpeg_room = float(jpegs.sum()) / max(1, len(sizes)) * batch_size * _SLACK
        room = float(sizes.sum()) / max(1, len(sizes)) * batch_size * _SLACK
        room = min(room, jpeg_room + _MAX_WINDOW_ROOM)
        self.capacity = int(room) + (int(jpegs.max()) if len(jpegs) else 8)
        self.routing = Routing(share=float(cpu_share))  # each batch's way and share
        self.tables = StepTables(spec)

    def __getstate__(self) -> dict:
        # Each batch's share is decided in the training process: a worker needs no routing
        # (nor could a spawned one be sent its lock).
        return {**super().__getstate__(), "routing": None}

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        h, w = self.spec.size
        b = self.batch_size
        return {
            "data": ((self.capacity,), "uint8"),
            "lengths": ((b,), "int64"),  # bytes at the planned start; -1: a `pixels` row
            "starts": ((b,), "int64"),
            "channels": ((b,), "int64"),  # of the bytes' pixel window; 0: JPEG bytes
            "crops": ((b, len(CROP_COLUMNS)), "int32"),
            "pixels": ((b, h, w, 3), "uint8"),
            "indices": ((b,), "int64"),
            "seed": ((1,), "int64"),  # the batch's: a retry on the GPU side replaces alike
            **(self.tables.buffers(b) if self.tables.active else {}),
        }

    def decide(self, seed: int) -> tuple[float]:
        """The share of the batch of ``seed`` routed to the CPU (its way remembered by
        ``routing``: decided once, in the main process)."""
        return (self.routing.plan(seed),)

    def plan(self, indices: np.ndarray, seed: int, share: float = 0.0) -> np.ndarray:
        """Crop rows of a batch, each followed by its byte offset and room (0: CPU; the
        pixel windows first, then the JPEGs); ``share``: of the GPU-decodable samples,
        decoded on the CPU instead."""
        crops = self.crops(indices, seed)  # the GPU stage runs the recipe's steps
        rows = np.zeros((len(indices), ROOM + 1), dtype=np.int64)
        rows[:, : len(CROP_COLUMNS)] = crops
        gpu = self._gpu_ok[indices].copy()
        gpu[self._cpu_share(crops, gpu, share)] = False
        jpegs = np.where(gpu, self.store.index["nbytes"][indices], 0).astype(np.int64)
        jpegs[np.cumsum(jpegs) > self.capacity] = 0  # the rest of a heavy batch: on the CPU
        pixels = self._pixels[indices]
        windows = np.where(pixels, crops[:, 2].astype(np.int64) * crops[:, 3], 0)
        windows *= self._channels[indices]
        # Windows take the room the JPEGs leave: cropping one costs the workers far less
        # than decoding a JPEG.
        windows[np.cumsum(windows) > self.capacity - int(jpegs.sum())] = 0
        room = jpegs + windows
        order = np.argsort(~pixels, kind="stable")  # the windows, then the JPEGs
        rows[order, START] = np.cumsum(room[order]) - room[order]
        rows[:, ROOM] = room
        return rows

    @staticmethod
    def _cpu_share(crops: np.ndarray, gpu: np.ndarray, share: float) -> np.ndarray:
        """Positions of the ``share`` of the GPU-decodable samples sent to the CPU instead:
        those whose DCT-domain reduction saves the CPU the most (small windows of large
        images)."""
        k = round(share * int(gpu.sum()))
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        candidates = np.flatnonzero(gpu)
        gain = reductions(crops[candidates])
        return candidates[np.argsort(-gain, kind="stable")[:k]]

    def fill(
        self,
        slot: dict[str, np.ndarray],
        lo: int,
        hi: int,
        indices: np.ndarray,
        seed: int,
        *decided,
    ) -> BatchReport:
        """``PixelBatches.fill``; the worker filling a batch's first rows also makes its
        recipe's draws and kernel tables into the slot (``loader.gpu.step_tables``)."""
        if lo == 0 and self.tables.active and len(indices):
            self.tables.fill(slot, seed, len(indices))
        return super().fill(slot, lo, hi, indices, seed, *decided)

    def fill_rows(
        self,
        slot: dict[str, np.ndarray],
        lo: int,
        indices: np.ndarray,
        rows: np.ndarray,
        seed: int,
    ) -> BatchReport:
        """Copy the bytes of GPU-routed samples into the slot; decode the others into
        their pixel rows (a record that cannot be read is replaced, as on the CPU path)."""
        report = BatchReport(len(indices))
        started = time.perf_counter()
        slot["seed"][0] = seed
        pixels = self._pixels[indices].tolist()
        for k, (i, row) in enumerate(zip(indices.tolist(), rows, strict=True)):
            at = lo + k
            slot["crops"][at] = row[: len(CROP_COLUMNS)]
            slot["channels"][at] = 0
            put = self._window if pixels[k] else self._gather
            if row[ROOM] and put(slot, at, i, int(row[START]), int(row[ROOM])):
                continue
            t0 = time.perf_counter()
            key = (seed, at)
            slot["indices"][at] = self.decode_sample(i, row, slot["pixels"][at], key, report)
            slot["lengths"][at] = -1
            report.cpu_decoded += 1
            report.decode_s += time.perf_counter() - t0
        report.worker_s += time.perf_counter() - started
        return report

    def _gather(self, slot: dict, at: int, i: int, start: int, room: int) -> bool:
        """Put sample ``i``'s JPEG bytes at ``start``; False when it must go to the CPU
        (unreadable, or larger than planned: the CPU path then replaces or decodes it)."""
        try:
            data, kind = self.read(i)
        except DecodeError:  # the CPU path reports it with its reason
            return False
        if kind != "jpeg" or len(data) > room:
            return False
        try:  # the header, not only the index, must have the size: the GPU allocates by it
            h, w = _header_size(data)
        except ValueError:
            return False
        if (h, w) != (int(self.store.index["height"][i]), int(self.store.index["width"][i])):
            return False
        slot["data"][start : start + len(data)] = np.frombuffer(data, np.uint8)
        slot["starts"][at], slot["lengths"][at], slot["indices"][at] = start, len(data), i
        return True

    def _window(self, slot: dict, at: int, i: int, start: int, room: int) -> bool:
        """Put the pixels of sample ``i``'s crop window at ``start`` (HWC, its channels);
        False when it must go to the CPU (unreadable: the CPU path then replaces it)."""
        try:
            data, kind = self.read(i)  # its length checked against the index's shape
        except DecodeError:
            return False
        h, w, c = (int(self.store.index[k][i]) for k in ("height", "width", "channels"))
        y, x, wh, ww = (int(v) for v in slot["crops"][at][:4])
        if kind != "raw" or wh * ww * c > room or y + wh > h or x + ww > w:
            return False
        image = np.frombuffer(data, np.uint8).reshape(h, w, c)
        slot["data"][start : start + wh * ww * c].reshape(wh, ww, c)[...] = (
            image[y : y + wh, x : x + ww])  # fmt: skip
        slot["starts"][at], slot["lengths"][at], slot["indices"][at] = start, wh * ww * c, i
        slot["channels"][at] = c
        return True


def _header_size(data: bytes) -> tuple[int, int]:
    """(height, width) from a JPEG's header; past a malformed ICC profile segment, which
    libjpeg-turbo's header read refuses ("bad ICC marker") and OpenCV's decode never reads
    (looked for only then: this runs for every sample the GPU decodes)."""
    try:
        return simplejpeg.decode_jpeg_header(data)[:2]
    except ValueError:
        return simplejpeg.decode_jpeg_header(without_icc(data))[:2]

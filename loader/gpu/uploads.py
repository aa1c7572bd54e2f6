"""SlotUploads: what a gathered slot sends to the device besides the JPEGs the GPU decoder
takes: the rows the workers decoded, and the pixel windows of a pixel store's records.

Both are read from the ring's shared memory where it is registered with CUDA
(``loader.gpu.mapped``): the rows by a gather kernel, the windows, which lie side by
side at the start of the slot's byte buffer, by one DMA copy of that span. Where the
memory cannot be registered, both go through a pinned buffer (``upload``), a copy on the
CPU first.
"""

from __future__ import annotations

import numpy as np
import torch

from loader.gpu.host_arrays import Rows, upload
from loader.gpu.mapped import MappedRows
from loader.gpu.ragged import Ragged


class SlotUploads:
    """The workers' rows and the pixel windows of the slots of one ring, on ``device``;
    the bytes copied counted in ``stats`` (``h2d_bytes``)."""

    def __init__(self, device: torch.device, stats) -> None:
        self.device, self.stats = device, stats
        self.rows_mapped: MappedRows | None = None  # the ring's pixel rows
        self.data_mapped: MappedRows | None = None  # the ring's byte buffer

    def map_ring(self, tensors: dict[str, torch.Tensor]) -> None:
        """Read from the ring's buffers (``tensors``: name -> every slot's) where they lie,
        on a CUDA device; each is registered when first read."""
        if self.device.type == "cuda":
            self.rows_mapped = MappedRows(tensors["pixels"], self.device)
            self.data_mapped = MappedRows(tensors["data"], self.device)

    def rows(self, views: dict, cpu_rows: np.ndarray, *arrays: np.ndarray) -> tuple:
        """([the slot's pixel rows ``cpu_rows``, ``cpu_rows``, *``arrays``] on the device,
        on the current stream; whether the rows were gathered by a kernel from the ring's
        registered memory rather than copied through a pinned buffer)."""
        mapped = self.rows_mapped  # (decode threads call this too)
        if mapped is not None:
            rows, *rest = upload(self.device, cpu_rows, *arrays, stats=self.stats)
            pixels = mapped.rows(views["pixels"], rows)
            if pixels is not None:
                self.stats.add(h2d_bytes=pixels.nbytes)
                return [pixels, rows, *rest], True
            if mapped.failed:  # it cannot be read so: as before, from now on
                self.rows_mapped = None
        pixels = Rows(views["pixels"], cpu_rows)
        return upload(self.device, pixels, cpu_rows, *arrays, stats=self.stats), False

    def windows(self, views: dict, n: int) -> tuple[Ragged, np.ndarray, np.ndarray]:
        """The pixel windows of the slot's ``n`` samples on the device (current stream), as
        (the images, their crop rows, now at the window's origin, and their rows)."""
        rows = np.flatnonzero(views["channels"][:n] > 0)
        crops = views["crops"][rows]
        if not len(rows):
            return Ragged.empty(), crops, rows
        starts = views["starts"][rows]
        span = self._span(views["data"], int((starts + views["lengths"][rows]).max()))
        images = Ragged.windows(span, starts, crops[:, 2], crops[:, 3], views["channels"][rows])
        crops[:, 0:2] = 0  # each image is its window (``crops``: a copy, fancy-indexed)
        return images, crops, rows

    def _span(self, data: np.ndarray, nbytes: int) -> torch.Tensor:
        """``data[:nbytes]`` (a slot's byte buffer) on the device."""
        mapped = self.data_mapped
        if mapped is not None:
            span = mapped.span(data, nbytes)
            if span is not None:
                self.stats.add(h2d_bytes=nbytes)
                return span
            if mapped.failed:
                self.data_mapped = None
        (span,) = upload(self.device, data[:nbytes], stats=self.stats)
        return span

    def release(self) -> None:
        """Undo the registrations (after the device's work that may read the ring)."""
        for mapped in (self.rows_mapped, self.data_mapped):
            if mapped is not None:  # what it pins, until a later iteration reads there
                mapped.release()

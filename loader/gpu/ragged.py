"""Ragged: uint8 images of different sizes on the device, as the augmentation kernels take
them (an address, a size and element strides each), whatever made them.

Decoded JPEGs are tensors of their own (``Ragged.of``); the pixel windows of a pixel
store lie side by side in one copied span of the slot's byte buffer, each height x width
x channels (``Ragged.windows``), where making 256 tensor views a batch would cost 256
torch calls, each letting the GIL go. Both kinds of one batch join into one launch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Ragged(NamedTuple):
    """``len(addresses)`` uint8 images [3, H, W] as (address, (H, W), (channel, row,
    column) element strides), and the tensors holding them (kept alive with them)."""

    addresses: np.ndarray  # int64 [G]
    shapes: np.ndarray  # int64 [G, 2]
    strides: np.ndarray  # int64 [G, 3]
    holders: tuple  # tensors the images lie in

    @classmethod
    def of(cls, images: list[torch.Tensor]) -> Ragged:
        """Tensors [3, H, W] of any strides."""
        if not images:
            return cls.empty()
        return cls(
            np.array([im.data_ptr() for im in images], dtype=np.int64),
            np.array([im.shape[1:] for im in images], dtype=np.int64),
            np.array([im.stride() for im in images], dtype=np.int64),
            tuple(images),
        )

    @classmethod
    def windows(cls, span: torch.Tensor, starts, heights, widths, channels) -> Ragged:
        """Images of HWC pixels at byte offsets ``starts`` of ``span`` (uint8, contiguous),
        of ``channels`` 3 (RGB) or 1 (gray: read three times, by a channel stride of 0)."""
        starts, channels = np.asarray(starts, np.int64), np.asarray(channels, np.int64)
        widths = np.asarray(widths, np.int64)
        strides = np.stack([np.where(channels == 1, 0, 1), widths * channels, channels], 1)
        shapes = np.stack([np.asarray(heights, np.int64), widths], 1)
        return cls(span.data_ptr() + starts, shapes, strides, (span,))

    @classmethod
    def empty(cls) -> Ragged:
        none = np.zeros((0, 2), np.int64)
        return cls(np.zeros(0, np.int64), none, np.zeros((0, 3), np.int64), ())

    def __len__(self) -> int:
        return len(self.addresses)

    def join(self, other: Ragged) -> Ragged:
        """These images, then ``other``'s."""
        if not len(other):
            return self
        if not len(self):
            return other
        return Ragged(
            np.concatenate([self.addresses, other.addresses]),
            np.concatenate([self.shapes, other.shapes]),
            np.concatenate([self.strides, other.strides]),
            self.holders + other.holders,
        )

    def tensors(self) -> list[torch.Tensor]:
        """Each image as a tensor view (for the CPU stand-in of the kernels: one torch call
        per image)."""
        out, spans = [], {h.data_ptr(): h for h in self.holders}
        bases = sorted(spans)
        for address, shape, stride in zip(self.addresses, self.shapes, self.strides, strict=True):
            base = bases[np.searchsorted(bases, address, side="right") - 1]
            holder = spans[base]
            offset = (int(address) - base) // holder.element_size() + holder.storage_offset()
            out.append(holder.as_strided((3, *shape.tolist()), stride.tolist(), offset))
        return out

"""Decoder backends behind one small interface and a registry: ``get_decoder("cpu")``.

A CPU decoder turns one stored image (JPEG, PNG or pixel bytes) into the output pixels of one
sample: it decodes, applies a row of crop parameters (``loader.augment.CROP_COLUMNS``) and
writes uint8 RGB into a slot the caller owns (``decode_into``). A GPU decoder decodes a
whole batch of JPEGs at once into device tensors (``decode_batch``); cropping then happens
on the GPU (``loader.gpu.augment``). Backends are imported lazily, so that the loader works
without the optional GPU libraries.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import numpy as np

# name -> "module:Class", imported on first use.
_BACKENDS = {
    "cpu": "loader.cpu.decode:CpuDecoder",
    "nvjpeg": "loader.gpu.nvjpeg:NvjpegDecoder",
    "dali": "loader.gpu.dali_decode:DaliDecoder",
}


class DecodeError(ValueError):
    """The bytes of one record could not be decoded into the expected image."""


_IN_WORKER = False  # set in the loader's worker processes (``loader.workers``)


def mark_worker_process() -> None:
    """Called first in each worker process: decoders may then take over the process's
    stderr around a decode (nothing else of the process writes there)."""
    global _IN_WORKER
    _IN_WORKER = True


def in_worker_process() -> bool:
    """True in a loader worker process; False in the training process."""
    return _IN_WORKER


class Decoder(Protocol):
    """What a decoder backend provides.

    Attributes:
        name: the registry name.
        in_workers: True when it runs in the worker processes (the CPU decoder); a GPU
            decoder runs in the main process and lets the workers gather encoded bytes.
        devices: the device types (``torch.device.type``) it can deliver to.
        concurrent_calls: (batched GPU decoders, optional, default 1) how many threads may
            call ``decode_batch`` at once. A second call waiting inside the library (GIL
            released) starts the moment the first ends, instead of waiting for the GIL.
    """

    name: str
    in_workers: bool
    devices: tuple[str, ...]

    def decode_into(
        self, data: bytes, kind: str, shape: tuple[int, int], crop: np.ndarray, out: np.ndarray
    ) -> None:
        """Decode ``data`` and write the cropped, resized, flipped RGB pixels into ``out``.

        Args:
            data: the encoded image.
            kind: its format, "jpeg", "png" or "raw" (pixels, HxWx1 or HxWx3).
            shape: (height, width) the store's index records for it.
            crop: one int row of ``loader.augment.CROP_COLUMNS``.
            out: uint8 array (height, width, 3) of the output size, written in place.

        Raises:
            DecodeError: the bytes are not a decodable image of ``shape``.
        """


def decoders() -> list[str]:
    """Names of the known decoder backends."""
    return sorted(_BACKENDS)


def _backend(name: str) -> type:
    target = _BACKENDS.get(name)
    if target is None:
        raise ValueError(f"decoder={name!r} is unknown; known decoders: {', '.join(decoders())}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def delivers_to(name: str) -> tuple[str, ...]:
    """Device types a backend's output can be produced for ("cuda" for a GPU decoder)."""
    return tuple(_backend(name).devices)


def runs_in_workers(name: str) -> bool:
    """True for a backend that decodes in the worker processes (the CPU decoder); a GPU
    backend decodes in the main process, from bytes the workers gather."""
    return bool(_backend(name).in_workers)


def runs_whole_stage(name: str) -> bool:
    """True for a backend that runs the whole GPU stage (decode, crop, resize, flip,
    normalise) in a pipeline of its own (DALI: ``loader.gpu.dali_stage``)."""
    return bool(getattr(_backend(name), "whole_stage", False))


def get_decoder(name: str, **options) -> Decoder:
    """A new decoder of backend ``name``, constructed with ``options`` (e.g. ``antialias``).

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    return _backend(name)(**options)

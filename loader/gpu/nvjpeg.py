"""The nvjpeg decoder: batched JPEG decode on a CUDA device through torchvision.

``torchvision.io.decode_jpeg(list, device="cuda")`` sends the baseline JPEGs of a batch to
the GPU's hardware JPEG engines in one call (nvjpeg's batched hardware backend, on A100,
H100, H200...) and needs nothing beyond torch and torchvision, so it is the GPU backend
every CUDA machine has. The call blocks its thread until the batch is decoded (it
synchronises its own stream), which is why the loader calls it from threads of its own;
it releases the GIL meanwhile.
"""

from __future__ import annotations

import gc
import sys

import torch

from loader.decode import DecodeError


def import_torchvision_io():
    """``torchvision.io``, imported without keeping alive the frames that import it.

    torchvision's first import leaves a frame that refers to itself (``torch.fx.wrap``
    keeps ``inspect.currentframe()`` in a local, run by ``torchvision.ops`` at import), and
    with it every frame up the stack until the cyclic collector runs: a loader built by
    the call that first imported torchvision, its stage and its iterators were not freed
    when let go of, and its prefetch thread, gone on into the next epoch, ran on (tested:
    ``tests/test_gpu_path.py``). A collection right after that first import frees the
    frame. Raises ImportError where torchvision is not installed.
    """
    first = "torchvision" not in sys.modules
    import torchvision.io

    if first:
        gc.collect()
    return torchvision.io


class NvjpegDecoder:
    """Decodes lists of JPEG byte tensors into uint8 [3, H, W] tensors on ``device``.

    Args:
        device: the CUDA device to decode on.
        antialias, batch_size: accepted for the registry's common signature.

    Raises:
        ValueError: no CUDA device, or a torchvision without nvjpeg support.
    """

    name = "nvjpeg"
    in_workers = False
    devices = ("cuda",)
    # torchvision serialises its decode calls with a mutex of its own: a second caller
    # waits there with the GIL released, so batches decode back to back.
    concurrent_calls = 2

    def __init__(
        self, device: torch.device | str | None = None, antialias: bool = True, batch_size=None
    ) -> None:
        del antialias, batch_size
        device = torch.device(device if device is not None else "cuda")
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError(
                f"decoder='nvjpeg' decodes on a CUDA device, and device={str(device)!r} is "
                "not one (or CUDA is unavailable here); use decoder='cpu'"
            )
        try:
            io = import_torchvision_io()
        except ImportError as e:
            raise ValueError(
                f"decoder='nvjpeg' needs torchvision ({e}); pip install torchvision"
            ) from None
        self.device, self._decode, self._mode = device, io.decode_jpeg, io.ImageReadMode.RGB

    def decode_batch(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """Decode every JPEG of ``encoded`` (1-D uint8 CPU tensors) on the device.

        Returns:
            One RGB tensor [3, H, W] per input, or None where that input could not be
            decoded (the caller retries those on the CPU).
        """
        if not encoded:
            return []
        try:
            return list(self._decode(encoded, mode=self._mode, device=self.device))
        except RuntimeError as e:
            raise_if_not_the_data(e)
            # One bad stream fails the whole batched call: find it by decoding one by one.
            return [self._one(data) for data in encoded]

    def _one(self, data: torch.Tensor) -> torch.Tensor | None:
        try:
            return self._decode(data, mode=self._mode, device=self.device)
        except RuntimeError as e:
            raise_if_not_the_data(e)
            return None


# torchvision reports every failure as a RuntimeError; these words mean the device, not
# the image, failed: raising beats decoding everything slowly on the CPU from then on.
_DEVICE_TROUBLE = ("out of memory", "CUDA error", "cudaError", "ALLOCATOR", "allocat")


def raise_if_not_the_data(e: RuntimeError) -> None:
    if any(word in str(e) for word in _DEVICE_TROUBLE):
        try:
            raise e
        finally:  # its traceback holds this frame: not the frame the error (a cycle)
            del e


def check_decoded(image: torch.Tensor, shape: tuple[int, int]) -> None:
    """Raise DecodeError unless ``image`` ([3, H, W]) has the index's (height, width)."""
    if tuple(image.shape[1:]) != tuple(shape) or image.shape[0] != 3:
        raise DecodeError(
            f"decoded size {tuple(image.shape)} differs from the index's {tuple(shape)}"
        )

"""BatchOutput: a uint8 NHWC ring slot -> the delivered images tensor (dtype, layout, device).

The slot is copied out before it is handed back to the workers, so a delivered batch never
aliases shared memory. On a CUDA device the uint8 pixels cross the bus (4x fewer bytes than
float32) from a pinned copy and are converted there. On the CPU, conversion and
normalisation are one table look-up per byte (``cv2.LUT``: 256 entries per channel), which
is several times faster than torch's elementwise ops on uint8 input.
"""

from __future__ import annotations

import mmap

import cv2
import numpy as np
import torch

from loader.augment import Transform

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "uint8": torch.uint8,
}
# numpy type with the bytes of each torch dtype (numpy has no bfloat16: its bits as int16).
_BITS = {
    torch.float32: np.float32,
    torch.float16: np.int16,
    torch.bfloat16: np.int16,
    torch.uint8: np.uint8,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """The images dtype asked for by ``dtype=`` (default float32).

    Raises:
        ValueError: a dtype other than float32, float16, bfloat16 or uint8.
    """
    if dtype is None:
        return torch.float32
    for name, known in DTYPES.items():
        if dtype is known or dtype == name:
            return known
    raise ValueError(
        f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)} "
        "(uint8 delivers raw pixels, without normalisation)"
    )


def resolve_device(device: torch.device | str | int | None) -> torch.device:
    """Where batches go: ``device=``, default "cuda" when available, else "cpu".

    Raises:
        ValueError: an unknown device, or a CUDA device on a machine without one.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device: {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={device!r} asks for CUDA, but torch.cuda.is_available() is False on "
                "this machine (no GPU, or a CPU-only torch build); pass device='cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or a CUDA device")
    return dev


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor backed by transparent huge pages where the kernel allows.

    A fresh 150 MB batch otherwise costs ~40k page faults when first written: as much time
    as converting it. The memory is unmapped when the tensor is freed.
    """
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    if nbytes < 1 << 22 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=dtype).view(shape)


class BatchOutput:
    """Turns ring slots into delivered tensors.

    Args:
        spec: the transform (output size, mean, std).
        dtype: images dtype; float dtypes are normalised, uint8 is left raw.
        channels_last: deliver images in ``torch.channels_last`` memory format.
        device: where to deliver.
        pin_memory: pin host memory (only when CUDA is available; a no-op otherwise).
    """

    def __init__(
        self,
        spec: Transform,
        dtype: torch.dtype,
        channels_last: bool,
        device: torch.device,
        pin_memory: bool,
    ) -> None:
        self.dtype, self.device, self.channels_last = dtype, device, channels_last
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        mean = torch.tensor(spec.mean, dtype=torch.float64)
        std = torch.tensor(spec.std, dtype=torch.float64)
        # table[v, c] = (v / 255 - mean[c]) / std[c], rounded once to the output dtype
        table = (torch.arange(256, dtype=torch.float64)[:, None] / 255.0 - mean) / std
        self.table = table.to(dtype if dtype != torch.uint8 else torch.float32)
        self.scale = (1.0 / (255.0 * std)).float().view(1, 3, 1, 1).to(device)
        self.bias = (-mean / std).float().view(1, 3, 1, 1).to(device)

    def images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: uint8 [N, H, W, 3] (a ring slot); returns a new [N, 3, H, W] tensor."""
        if self.device.type == "cpu":
            return self._on_cpu(pixels)
        host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=self.pin)
        host.copy_(pixels)
        x = host.to(self.device, non_blocking=self.pin).permute(0, 3, 1, 2)
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.dtype == torch.uint8:
            return x.contiguous(memory_format=fmt)
        out = torch.empty(x.shape, dtype=self.dtype, device=self.device, memory_format=fmt)
        return torch.addcmul(self.bias, x, self.scale, out=out)

    def _on_cpu(self, pixels: torch.Tensor) -> torch.Tensor:
        n, h, w, _ = pixels.shape
        nhwc = (n, h, w, 3) if self.channels_last else (n, 3, h, w)
        if self.pin:
            out = torch.empty(nhwc, dtype=self.dtype, pin_memory=True)
        else:
            out = host_empty(nhwc, self.dtype)
        src = pixels.numpy()
        dst = out.view(torch.int16).numpy() if _BITS[self.dtype] is np.int16 else out.numpy()
        if self.dtype == torch.uint8:
            dst[...] = src if self.channels_last else src.transpose(0, 3, 1, 2)
        elif self.channels_last:
            lut = self._lut().reshape(256, 1, 3)
            for i in range(n):
                cv2.LUT(src[i], lut, dst=dst[i])
        else:
            luts = [np.ascontiguousarray(self._lut()[:, c]) for c in range(3)]
            for i in range(n):
                for c, plane in enumerate(cv2.split(src[i])):
                    cv2.LUT(plane, luts[c], dst=dst[i, c])
        return out.permute(0, 3, 1, 2) if self.channels_last else out

    def _lut(self) -> np.ndarray:
        """The table as numpy values with the output dtype's bits, shape [256, 3]."""
        t = self.table
        return (t.view(torch.int16) if _BITS[self.dtype] is np.int16 else t).numpy()

    def labels(self, values: np.ndarray) -> torch.Tensor:
        """Labels (int64) on the delivery device."""
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device)

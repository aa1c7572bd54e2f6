"""BatchOutput: a uint8 ring slot -> the delivered images tensor (dtype, layout, device).

The slot is copied out before it is handed back to the workers, so a delivered batch never
aliases shared memory. On a CUDA device the uint8 pixels cross the bus (4x fewer bytes than
float32) from a pinned copy and are converted there. On the CPU, conversion and
normalisation are one table look-up per byte (``cv2.LUT``: 256 entries per channel), which
is several times faster than torch's elementwise ops on uint8 input.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import torch

from ingest.cores import half_the_cores
from loader.augment import Transform
from loader.hostmem import HostMemory

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
        device = "cuda" if torch.cuda.is_available() else "cpu"
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
        if dev.index is None:  # "cuda" is the current device now (torch.cuda.set_device)
            dev = torch.device("cuda", torch.cuda.current_device())
    elif dev.type != "cpu":
        raise ValueError(f"device={device!r} is not supported; use 'cpu' or a CUDA device")
    return dev


def conversion_threads() -> int:
    """Threads for the CPU conversion: half the cores, at most 8, so that the main process
    keeps up with many workers (``cv2.LUT`` releases the GIL); one on small machines, where
    the workers already fill the cores and a thread pool would only add overhead."""
    return half_the_cores(8)


class BatchOutput:
    """Turns ring slots into delivered tensors.

    Args:
        spec: the transform (output size, mean, std).
        dtype: images dtype; float dtypes are normalised, uint8 is left raw.
        channels_last: deliver images in ``torch.channels_last`` memory format.
        device: where to deliver.
        pin_memory: pin host memory (only when CUDA is available; a no-op otherwise).
        threads: threads converting on the CPU (default: ``conversion_threads()``).
        stats: a ``LoaderStats`` where copies to a CUDA device are counted (``h2d_bytes``)
            and timed (``h2d_s``, CUDA events).
    """

    def __init__(
        self,
        spec: Transform,
        dtype: torch.dtype,
        channels_last: bool,
        device: torch.device,
        pin_memory: bool,
        threads: int | None = None,
        stats=None,
    ) -> None:
        self.dtype, self.device, self.channels_last = dtype, device, channels_last
        self.stats = stats
        self.threads = conversion_threads() if threads is None else threads
        self._pool: ThreadPoolExecutor | None = None
        self._memory = HostMemory()
        self.pin = bool(pin_memory) and torch.cuda.is_available()
        mean = torch.tensor(spec.mean, dtype=torch.float64)
        std = torch.tensor(spec.std, dtype=torch.float64)
        # table[v, c] = (v / 255 - mean[c]) / std[c], rounded once to the output dtype
        table = (torch.arange(256, dtype=torch.float64)[:, None] / 255.0 - mean) / std
        table = table.to(dtype if dtype != torch.uint8 else torch.float32)
        # cv2.LUT sees the table as numpy values with the output dtype's bytes.
        lut = (table.view(torch.int16) if _BITS[dtype] is np.int16 else table).numpy()
        self._lut3 = lut.reshape(256, 1, 3)  # per channel of an interleaved image
        self._luts = [np.ascontiguousarray(lut[:, c]) for c in range(3)]  # per plane
        self.scale = (1.0 / (255.0 * std)).float().view(1, 3, 1, 1).to(device)
        self.bias = (-mean / std).float().view(1, 3, 1, 1).to(device)

    def images(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels``: a uint8 ring slot, [N, 3, H, W] when ``channels_last`` is off, else
        [N, H, W, 3]; returns a new [N, 3, H, W] tensor."""
        if self.device.type == "cpu":
            return self._on_cpu(pixels)
        if self.pin:  # the ring slot is reused as soon as this returns: stage it, pinned
            host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
            host.numpy()[...] = pixels.numpy()  # numpy: torch's copy would spin OpenMP threads
            x = self._copy(host, non_blocking=True)
        else:  # a pageable copy has read the slot by the time it returns
            x = self._copy(pixels, non_blocking=False)
        x = x.permute(0, 3, 1, 2) if self.channels_last else x
        fmt = torch.channels_last if self.channels_last else torch.contiguous_format
        if self.dtype == torch.uint8:
            return x.contiguous(memory_format=fmt)
        out = torch.empty(x.shape, dtype=self.dtype, device=self.device, memory_format=fmt)
        return torch.addcmul(self.bias, x, self.scale, out=out)

    def _copy(self, host: torch.Tensor, non_blocking: bool) -> torch.Tensor:
        """``host`` on the device, on the current stream; counted and timed in ``stats``."""
        if self.stats is None:
            return host.to(self.device, non_blocking=non_blocking)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        x = host.to(self.device, non_blocking=non_blocking)
        end.record()
        self.stats.add(h2d_bytes=host.nbytes)
        self.stats.add_gpu_time("h2d", start, end)
        return x

    def _on_cpu(self, pixels: torch.Tensor) -> torch.Tensor:
        n = pixels.shape[0]
        if self.pin:
            out = torch.empty(pixels.shape, dtype=self.dtype, pin_memory=True)
        else:
            out = self._memory.empty(tuple(pixels.shape), self.dtype)
        src = pixels.numpy()
        dst = out.view(torch.int16).numpy() if _BITS[self.dtype] is np.int16 else out.numpy()
        if self.threads == 1 or n < 2 * self.threads:
            self._convert(src, dst, 0, n)
        else:
            bounds = np.linspace(0, n, self.threads + 1).astype(int).tolist()
            pool = self._executor()
            parts = [
                pool.submit(self._convert, src, dst, lo, hi)
                for lo, hi in itertools.pairwise(bounds)
            ]
            for part in parts:
                part.result()
        return out.permute(0, 3, 1, 2) if self.channels_last else out

    def _convert(self, src: np.ndarray, dst: np.ndarray, lo: int, hi: int) -> None:
        """Images ``lo:hi`` of ``src`` into ``dst``, of the same layout (NCHW or NHWC)."""
        if self.dtype == torch.uint8:
            dst[lo:hi] = src[lo:hi]
        elif self.channels_last:
            for i in range(lo, hi):
                cv2.LUT(src[i], self._lut3, dst=dst[i])
        else:
            for i in range(lo, hi):
                for c in range(3):
                    cv2.LUT(src[i, c], self._luts[c], dst=dst[i, c])

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="imfeed-convert")
        return self._pool

    def close(self) -> None:
        """Stop the conversion threads (started again when needed)."""
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def labels(self, values: np.ndarray) -> torch.Tensor:
        """Labels (int64) on the delivery device."""
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type == "cpu":
            return t
        if self.stats is not None:
            self.stats.add(h2d_bytes=t.nbytes)
        return t.to(self.device)

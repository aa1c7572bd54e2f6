"""profile(): wrap the loader of an existing training loop and learn whether the loop waits
for data (input-bound) or for the model (compute-bound), and which knob to try first.

    with loader.profile(dl) as prof:
        for images, labels in prof:
            ...  # the training step, unchanged
    print(prof.report())

What is measured: the host's wall time inside ``next()`` of the wrapped loader (waiting for
the next batch) against the wall time of the whole loop. CUDA work is asynchronous: the
host may queue kernels and ask for the next batch while the GPU is still busy, so a wait
is time in which the loop could not issue more work, not necessarily GPU idle time. The
clock stops after a ``torch.cuda.synchronize()`` so that images/s counts finished work, and
the GPU's own utilisation is sampled through NVML when ``pynvml`` (``nvidia-ml-py``) is
installed. Nothing is synchronised per step: the loop runs as it would unwrapped.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ingest.cores import usable_cores

INPUT_BOUND = 0.2  # at least this share of step time waiting for data: input-bound
COMPUTE_BOUND = 0.05  # at most this share: the loader keeps up


def _cuda():
    """torch.cuda when torch is loaded and CUDA is in use by this process, else None."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda


def _cpu_seconds() -> float:
    from loader.telemetry.proctree import tree_cpu_seconds

    return tree_cpu_seconds()


def _batch_size(batch) -> int:
    """Samples in a batch: the length of its first element (images) or of the batch."""
    first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
    shape = getattr(first, "shape", None)
    if shape is not None and len(shape):
        return int(shape[0])
    try:
        return len(first)
    except TypeError:
        return 1


class _GpuSampler:
    """Samples the GPU's utilisation (NVML, via torch.cuda.utilization) in a thread."""

    def __init__(self, interval: float = 0.1) -> None:
        self.interval, self.samples, self.device = interval, [], None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="profile-gpu", daemon=True)
        self.available = self._nvml()

    @staticmethod
    def _nvml() -> bool:
        try:
            import pynvml  # noqa: F401  (nvidia-ml-py provides it)
        except ImportError:
            return False
        return True

    def start(self) -> None:
        if self.available:
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            cuda = _cuda()
            if cuda is None or self.device is None:
                continue  # nothing on a GPU yet
            try:
                self.samples.append(float(cuda.utilization(self.device)))
            except Exception:  # NVML may refuse (no permission, MIG): report no figure
                self.available = False
                return

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
        return sum(self.samples) / len(self.samples) if self.samples else None


@dataclass
class Stats:
    """What a profiled loop measured (``Profile.stats``)."""

    steps: int
    images: int
    seconds: float
    wait_seconds: float
    cores_busy: float | None
    gpu_utilization: float | None

    @property
    def wait_share(self) -> float:
        """Share of the loop's wall time spent inside ``next()`` of the loader (0..1)."""
        return min(1.0, self.wait_seconds / self.seconds) if self.seconds > 0 else 0.0

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0


class Profile:
    """Iterates a loader like the loader itself, timing each wait for a batch.

    Args:
        loader: any iterable of batches (``loader.DataLoader``, torch's DataLoader, ...).
        warmup: steps to leave out of the figures (worker start-up, cudnn autotuning).
    """

    def __init__(self, loader: Iterable, warmup: int = 0) -> None:
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup={warmup!r} must be an int >= 0 (steps not counted)")
        self.loader, self.warmup = loader, warmup
        self.steps = self.images = self._seen = 0
        self.wait = self._seconds = self._cpu = 0.0
        self._span: tuple[float, float] | None = None  # (wall, cpu) when the open span began
        self._gpu = _GpuSampler()
        self._gpu_util: float | None = None

    def __enter__(self) -> Profile:
        self._gpu.start()
        return self

    def __exit__(self, *exc) -> None:
        self._gpu_util = self._gpu.stop()

    def __iter__(self) -> Iterator:
        """The loader's batches. Counted time runs from the first request after the warm-up
        to the end of the loader's epoch (or the loop's ``break``); iterating again (the
        next epoch) adds to the same figures, the time between epochs left out."""
        it, ended = iter(self.loader), 0.0
        try:
            while True:
                t0 = time.perf_counter()
                if self._seen >= self.warmup and self._span is None:
                    cuda = _cuda() if self.warmup else None
                    if cuda is not None:  # the warm-up's queued work is not counted
                        cuda.synchronize()
                        t0 = time.perf_counter()
                    self._span = (t0, _cpu_seconds())
                try:
                    batch = next(it)
                except StopIteration:
                    ended = time.perf_counter() - t0  # the call that found the end: no step
                    return
                self._seen += 1
                if self._span is not None:
                    self.wait += time.perf_counter() - t0
                    self.steps += 1
                    self.images += _batch_size(batch)
                self._note_device(batch)
                yield batch
        finally:
            self._close_span(ended)

    def _close_span(self, not_counted: float) -> None:
        if self._span is None:
            return
        cuda = _cuda()
        if cuda is not None:
            cuda.synchronize()  # count finished work, not work merely queued
        wall, cpu = self._span
        self._span = None
        self._seconds += time.perf_counter() - not_counted - wall
        self._cpu += _cpu_seconds() - cpu

    def _note_device(self, batch) -> None:
        if self._gpu.device is None:
            first = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
            device = getattr(first, "device", None)
            if device is not None and device.type == "cuda":
                self._gpu.device = device.index or 0

    @property
    def stats(self) -> Stats:
        """The figures so far (final once the loop has ended)."""
        seconds, cpu = self._seconds, self._cpu
        if self._span is not None:  # asked from inside the loop
            seconds += time.perf_counter() - self._span[0]
            cpu += _cpu_seconds() - self._span[1]
        busy = cpu / seconds if seconds > 0 else None
        return Stats(self.steps, self.images, seconds, self.wait, busy, self._gpu_util)

    def verdict(self) -> str:
        """Input-bound or compute-bound, in plain words, with the first knob to try."""
        return verdict(self.stats, self.loader)

    def report(self) -> str:
        """A few lines for a human: steps, images/s, wait share, CPU, GPU, verdict."""
        s = self.stats
        gpu = (
            f"{s.gpu_utilization:.0f}% (NVML, sampled every 0.1 s)"
            if s.gpu_utilization is not None
            else "not measured (no CUDA batches, or pynvml / nvidia-ml-py not installed)"
        )
        cores = f"{s.cores_busy:.1f} of {usable_cores()}" if s.cores_busy is not None else "?"
        cuda = self._gpu.device is not None or _cuda() is not None
        return "\n".join(
            [
                f"loader.profile: {s.steps} steps, {s.images} images in {s.seconds:.2f} s: "
                f"{s.images_per_s:.1f} img/s (after {self.warmup} warm-up steps)",
                f"waiting for data: {s.wait_share:.0%} of step time (host time inside next()"
                f"{'; CUDA work already queued keeps running meanwhile' if cuda else ''})",
                f"CPU cores busy: {cores} (this process and its children)",
                f"GPU utilisation: {gpu}",
                f"verdict: {self.verdict()}",
            ]
        )


def profile(loader: Iterable, warmup: int = 0) -> Profile:
    """Wrap ``loader`` to measure how much of a training loop waits for data.

    Args:
        loader: any iterable of batches: ``loader.DataLoader``, torch's DataLoader, ...
        warmup: first steps left out of the figures (worker start-up, cudnn autotuning).

    Returns:
        A context manager; iterate it in place of the loader, then call ``report()``
        (or read ``stats`` and ``verdict()``).

    Raises:
        ValueError: ``warmup`` is not an int >= 0.
    """
    return Profile(loader, warmup)


def verdict(stats: Stats, loader=None) -> str:
    """The plain-words verdict for ``stats`` measured on ``loader``."""
    share = stats.wait_share
    if stats.steps == 0:
        return "no steps measured (the loop ended within the warm-up steps)"
    if share <= COMPUTE_BOUND:
        return (
            f"compute-bound: the loop waited for data {share:.0%} of the time; the loader "
            "keeps up, a faster one would not speed this loop up (the model or the step is "
            "the limit)"
        )
    lead = "input-bound" if share >= INPUT_BOUND else "partly input-bound"
    return (
        f"{lead}: the loop waited for data {share:.0%} of the time; first knob to try: "
        f"{knob(stats, loader)}"
    )


def knob(stats: Stats, loader) -> str:
    """The first thing to change when a loop waits for data on ``loader``."""
    from loader.dataloader import DataLoader

    cores = usable_cores()
    workers = getattr(loader, "num_workers", None)
    saturated = stats.cores_busy is not None and stats.cores_busy >= 0.85 * cores
    if getattr(loader, "_gpu_stage", None) is not None:  # our GPU path
        stage = loader.stats()
        if stage.get("stage_busy_s", 0.0) >= stage.get("stage_wait_s", 0.0):
            return (
                "smaller images: rebuild the store with `ingest build --max-size 512` (the "
                "GPU decoder, whose time grows with each image's pixels, is the limit: its "
                "thread waits for the workers less than it works)"
            )
    if workers is not None and workers < cores and not saturated:
        return f"more workers (num_workers={workers} now, this process may use {cores} cores)"
    if not isinstance(loader, DataLoader):
        return (
            "loader.DataLoader over a store (`ingest build SRC OUT`): it decodes each JPEG "
            "once, at reduced scale when the crop allows"
        )
    return _our_knob(loader, saturated)


def _our_knob(loader, saturated: bool) -> str:
    import inspect

    from loader.decode import decoders

    gpu = getattr(loader, "device", None)
    on_gpu = gpu is not None and getattr(gpu, "type", str(gpu)) == "cuda"
    gpu_decoders = [d for d in decoders() if d != "cpu"]
    if on_gpu and getattr(loader, "decoder", "cpu") == "cpu" and gpu_decoders:
        return f'GPU decode, decoder="{gpu_decoders[0]}": it takes the decoding off the CPU'
    if saturated:
        return (
            "smaller images: rebuild the store with `ingest build --max-size 512` (decoding "
            "is what saturates the CPU)"
        )
    if "cache" in inspect.signature(type(loader).__init__).parameters:
        return 'cache="shm": the CPU is not saturated, so the loop waits on storage'
    return "a faster disk: copy the store to /dev/shm (the CPU is not saturated: storage is)"

"""The DALI decoder: batched JPEG decode of only each sample's crop window, through DALI.

``nvidia.dali.fn.decoders.image_slice`` on DALI's "mixed" device decodes a batch with the
GPU's hardware JPEG engines and nvjpeg's CUDA decoder side by side, and decodes only the
region it is given (ROI decode): RandomResizedCrop keeps 8-100% of an image, so most of a
full decode's pixels would be thrown away. The regions are the sampler's crop windows, so
the samples are the same on every backend; the rest of the augmentation (resize, flip,
normalise) is the loader's own kernels, as for the other GPU decoders.

DALI is an optional extra (``pip install 'imfeed[dali]'``), imported when this decoder is
made. One pipeline, asynchronous and pipelined as DALI's own loaders run theirs, is fed by
the loader (``external_source``) ``DEPTH`` batches at a time, so one batch's CPU stage runs
while another's GPU stage does. Only one thread of ours ever calls it (DALI's pipeline
object is not made to be shared between threads): the loader's decode threads hand it
their batches and wait. Each output is copied into one tensor of our allocator before the
pipeline may reuse its buffers. On an H200, decode alone: 28.9k img/s this way against
15-18k for synchronous pipelines (``benchmarks/results/gpu-h200-split.log``).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import importlib
import os
import queue
import re
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np
import torch

from ingest.cstderr import filtered
from loader.decode_nvjpeg import raise_if_not_the_data

# nvImageCodec (inside DALI) prints to stderr, whatever DALI's log level: "[ERROR] ..."
# (colour codes around the level) for each stream it cannot parse, and when a pipeline is
# built, which optional codec libraries (nvTIFF, nvJPEG2000) it did not find.
_LIBRARY_LINES = re.compile(
    r"^\s*(\x1b\[[0-9;]*m)?\[(FATAL|ERROR|WARNING|INFO|DEBUG|TRACE)\]"
    r"|^Failed to load nv|^Note: If using nvImageCodec"
)

# The share of the JPEGs DALI gives its hardware engines (the rest go to nvjpeg's CUDA
# decoder, whose Huffman stage runs on DALI's CPU threads). On an H200 with 8 threads:
# all of them 28.9k img/s, 65% 31.4k in one run each (gpu-h200-split.log); all of them
# leaves the cores to the training process.
HW_DECODER_LOAD = 1.0
MAX_THREADS = 8  # DALI's CPU threads (4: 22.5k img/s, 8: 28.9k, 12: 24.8k on the H200)
# Batches in the pipeline at once (its prefetch queue), one per decode thread. With 2, the
# pipeline ran one batch at a time in the loader (12.8-15.6k img/s on the H200,
# gpu-h200-async): while its thread waits for the oldest batch, the next one often has not
# come yet, and it is fed only once that wait ends.
DEPTH = 3
_IDLE_S = 1.0  # how often an idle pipeline thread checks that its decoder still exists


class DaliDecoder:
    """Decodes the crop windows of lists of JPEG byte tensors into uint8 [3, h, w] tensors.

    Args:
        device: the CUDA device to decode on (the CPU only in tests: DALI's CPU decoder).
        antialias: accepted for the registry's common signature; resizing is not done here.
        batch_size: the most images one call decodes.
        threads: DALI's CPU threads (default: ``MAX_THREADS``, fewer on a small machine).
        hw_decoder_load: share of the JPEGs for the hardware engines.

    Raises:
        ValueError: DALI is not installed, or no CUDA device.
    """

    name = "dali"
    in_workers = False
    devices = ("cuda",)
    crop_windows = True  # decode_batch takes each image's window and decodes only that
    concurrent_calls = DEPTH  # callers whose batches the pipeline works on at once

    def __init__(
        self,
        device: torch.device | str | None = None,
        antialias: bool = True,
        batch_size: int = 256,
        threads: int | None = None,
        hw_decoder_load: float = HW_DECODER_LOAD,
    ) -> None:
        del antialias
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("decoder='dali' decodes on a CUDA device; use decoder='cpu'")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        try:
            importlib.import_module("nvidia.dali")
        except ImportError:
            raise ValueError(
                "decoder='dali' needs NVIDIA DALI: pip install 'imfeed[dali]', or use "
                "decoder='nvjpeg'"
            ) from None
        self.batch_size = int(batch_size)
        self.threads = threads or max(1, min(MAX_THREADS, (os.cpu_count() or 1) // 2))
        self.hw_decoder_load = float(hw_decoder_load)
        build = functools.partial(
            _build, self.batch_size, self.threads, self.device, self.hw_decoder_load
        )
        self._runner = _Runner(build, self.device)

    def decode_batch(
        self, encoded: list[torch.Tensor], windows: np.ndarray
    ) -> list[torch.Tensor | None]:
        """Decode window ``windows[k]`` (y, x, h, w) of every JPEG of ``encoded``.

        Returns:
            One RGB tensor [3, h, w] per input (views of one buffer, ready on return), or
            None where that input could not be decoded (the caller retries those on the
            CPU).

        Raises:
            RuntimeError: the device failed (out of memory, a CUDA error).
        """
        if not encoded:
            return []
        windows = np.asarray(windows, dtype=np.int64)[:, :4]
        try:
            return self._runner.decode(encoded, windows)
        except PipelineThreadError:
            raise
        except RuntimeError as e:
            raise_if_not_the_data(e)
            # One bad stream fails the whole batch: find it by decoding one by one.
            return [self._one(data, w) for data, w in zip(encoded, windows, strict=True)]

    def _one(self, data: torch.Tensor, window: np.ndarray):
        try:
            return self._runner.decode([data], window[None])[0]
        except PipelineThreadError:
            raise
        except RuntimeError as e:
            raise_if_not_the_data(e)
            return None


def _build(batch_size: int, threads: int, device: torch.device, hw_decoder_load: float):
    """A built DALI pipeline: JPEG bytes, window anchors and shapes in; windows' RGB out."""
    from nvidia.dali import fn, pipeline_def, types

    cuda = device.type == "cuda"
    mixed = {"hw_decoder_load": hw_decoder_load} if cuda else {}

    @pipeline_def(
        batch_size=batch_size,
        num_threads=threads,
        device_id=(device.index or 0) if cuda else None,
        prefetch_queue_depth=DEPTH,
        exec_async=True,
        exec_pipelined=True,
    )
    def graph():
        jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
        anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
        shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
        return fn.decoders.image_slice(
            jpegs, anchor, shape, device="mixed" if cuda else "cpu",
            output_type=types.RGB, axis_names="WH",
            normalized_anchor=False, normalized_shape=False, **mixed,
        )  # fmt: skip

    with filtered(_LIBRARY_LINES):  # optional codecs it did not find, among others
        pipe = graph()
        pipe.build()
    return pipe


class _Runner:
    """The one thread that calls the pipeline, and the queue the callers put batches on.

    The thread holds no reference to the decoder: once the decoder is gone, it ends and
    lets the pipeline (and its GPU memory) go."""

    def __init__(self, build, device: torch.device) -> None:
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._build, self._device = build, device
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.most_in_flight = 0  # the most callers' batches in the pipeline at once

    def decode(self, encoded: list[torch.Tensor], windows: np.ndarray) -> list:
        future: Future = Future()
        self._requests.put((encoded, windows, future))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=_drive,
                    args=(weakref.ref(self), self._requests, self._build, self._device),
                    name="imfeed-dali", daemon=True,
                )  # fmt: skip
                self._thread.start()
        thread = self._thread
        while True:
            try:
                return future.result(timeout=_IDLE_S)
            except FutureTimeout:
                if not thread.is_alive() and not future.done():
                    raise PipelineThreadError("the DALI pipeline's thread ended") from None


class PipelineThreadError(RuntimeError):
    """The thread that runs the DALI pipeline failed (its error was raised to the batches
    it held); the decoder cannot go on."""


def _drive(owner: weakref.ref, requests: queue.SimpleQueue, build, device) -> None:
    """The pipeline's thread: see ``_serve``. Should it fail, the batches it holds and
    those still queued get the error, never a wait without end."""
    flight: collections.deque = collections.deque()  # (future, windows) or None
    try:
        _serve(owner, requests, build, device, flight)
    except BaseException as e:
        error = PipelineThreadError(f"the DALI pipeline's thread failed: {e!r}")
        _fail(flight, error, None)
        while True:
            try:
                _fail(flight, error, requests.get_nowait()[2])
            except queue.Empty:
                break


def _serve(owner, requests, build, device, flight: collections.deque) -> None:
    """Keep up to DEPTH batches in the pipeline; hand out results in the order the batches
    came. A pipelined pipeline's first run takes DEPTH batches, so the first batch is fed
    DEPTH times and the copies' results dropped (None in ``flight``, which holds
    (future, windows) in feed order)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    stream = torch.cuda.Stream(device) if cuda else None
    pipe = None
    while True:
        if len(flight) < DEPTH:
            try:
                request = requests.get(timeout=_IDLE_S) if not flight else requests.get_nowait()
            except queue.Empty:
                request = None
            if request is None and not flight:
                if owner() is None:
                    return
                continue
            if request is not None:
                encoded, windows, future = request
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    if pipe is None:
                        pipe = build()
                        _feed(pipe, encoded, windows)
                        flight.append((future, windows))
                        for _ in range(DEPTH - 1):
                            _feed(pipe, encoded, windows)
                            flight.append(None)
                    else:
                        _feed(pipe, encoded, windows)
                        flight.append((future, windows))
                    pipe.schedule_run()
                except BaseException as e:
                    _fail(flight, e, future)
                    pipe = None
                    continue
                runner = owner()
                if runner is not None:
                    busy = sum(entry is not None for entry in flight)
                    runner.most_in_flight = max(runner.most_in_flight, busy)
                del runner
                if len(flight) < DEPTH:
                    continue  # take the next batch first, if one is waiting
        entry = flight.popleft()
        try:
            with filtered(_LIBRARY_LINES):  # its complaints about a bad stream
                (out,) = pipe.outputs()
            if entry is not None:
                future, windows = entry
                future.set_result(_to_torch(out, windows, device, stream))
        except BaseException as e:  # the pipeline is unusable: every batch in it fails
            _fail(flight, e, None if entry is None else entry[0])
            pipe = None


def _feed(pipe, encoded: list[torch.Tensor], windows: np.ndarray) -> None:
    """Queue one batch on the pipeline's inputs (DALI copies the bytes)."""
    pipe.feed_input("jpegs", [t.numpy() for t in encoded])
    pipe.feed_input("anchor", np.ascontiguousarray(windows[:, [1, 0]], dtype=np.float32))
    pipe.feed_input("shape", np.ascontiguousarray(windows[:, [3, 2]], dtype=np.float32))


def _fail(flight: collections.deque, error: BaseException, future: Future | None) -> None:
    """Fail ``future`` and every batch in flight with ``error``; empty ``flight``."""
    futures = [future] + [entry[0] for entry in flight if entry is not None]
    flight.clear()
    for f in futures:
        if f is not None and not f.done():
            f.set_exception(error)


def _to_torch(out, windows: np.ndarray, device: torch.device, stream) -> list:
    """Copy DALI's ragged output into one tensor; a sample of the wrong shape is None.
    The copy is complete on return: the pipeline may reuse its buffers."""
    shapes = [tuple(s) for s in out.shape()]
    sizes = [int(np.prod(s)) for s in shapes]
    if stream is not None:
        with torch.cuda.stream(stream):
            buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        _wait_for(out, stream, device)
        target = ctypes.c_void_p(buffer.data_ptr())
        out.copy_to_external(target, stream.cuda_stream, non_blocking=True)
        stream.synchronize()
    else:
        buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        out.copy_to_external(ctypes.c_void_p(buffer.data_ptr()))
    images, at = [], 0
    for shape, size, (_, _, h, w) in zip(shapes, sizes, windows.tolist(), strict=True):
        view = buffer[at : at + size]
        at += size
        ok = shape == (h, w, 3)
        images.append(view.view(h, w, 3).permute(2, 0, 1) if ok else None)
    return images


def _wait_for(out, stream: torch.cuda.Stream, device: torch.device) -> None:
    """Make ``stream`` wait for the work DALI did on its own stream to produce ``out``."""
    handle = getattr(out, "stream", None)
    if callable(handle):
        handle = handle()
    if not handle:
        return  # DALI finished its work before returning (or used the legacy stream)
    event = torch.cuda.Event()
    event.record(torch.cuda.ExternalStream(int(handle), device=device))
    stream.wait_event(event)

"""GpuStage: one gathered ring slot -> a finished batch on the GPU, on side streams.

For each slot the workers filled (``loader.gpu.encoded``) it decodes the JPEG bytes with the
GPU decoder (one batched call), retries any image the decoder rejects on the CPU (then,
like the CPU path, replaces a record that fails there too), crops/resizes/flips/normalises
every GPU-decoded image straight into the output batch (``loader.gpu.augment``), gathers
the rows the workers decoded on the CPU from the ring's shared memory (registered with
CUDA: ``loader.gpu.mapped``; else through pinned memory) and normalises them into the same
batch. The decode (which ``start`` hands to the caller's decode threads: several at
once where the decoder allows) runs on one high-priority side stream, the rest
(``finish``) on another, which ends with an event the training stream waits on; nothing
synchronises the device.

With ``cpu_share="auto"`` it sizes the workers' share of a batch by feedback: the
prefetch thread should never wait for the workers (they decode their share while the GPU
decodes the rest), so the share grows while that wait is under ``_TARGET_IDLE`` of the
thread's time and shrinks as soon as the workers hold the thread up. Feedback rather than
a model of rates, because what the workers get depends on what else runs on the machine
(the training process above all), which a rate measured in a worker does not show. An
epoch's first batch steers nothing: the thread waits for it while the workers start on the
epoch (counted in ``stage_wait_s`` all the same). Steered by, a wait that is nearly all
of the batch's time took up to 0.475 off the share at every epoch's start, which then grew
back by at most 0.025 a batch.

The share moves only once the training loop is seen not to wait for batches: under
``_LOOP_WAIT`` of its time over its last ``_LOOP_WINDOW`` hand-offs (an epoch's first left
out). A loop that waits more has the loader for its limit, and the share then shrinks by
``_GAIN`` times the share of the loop's time spent waiting, each batch. Steered by the
workers' wait alone, the share grew to 11-30% with the loader alone on the H200, which then
fed 12.7-19.7k img/s, against 27.3-32.2k with no share, in each of the 7 bench runs that
had both (``gpu-h200-picker7`` to ``carry2``, ``loader-dali-auto`` against ``loader-dali``):
there the prefetch thread is the limit, the share's rows cost it more than the GPU decode
they save, and the workers keep up with it. With the loop's wait steering too, the share
stayed at 0 alone (27.5k img/s against 27.4k, ``gpu-h200-autogate``).

A loop that waits has the loader for its limit only where the prefetch thread is busy
all the time: the share shrinks only while that thread holds finished batches (the queue
of them full, the loop not taking them) under ``_HELD`` of its time over the same
window. Beside ResNet-50 on the H200 the loop waits for a slow batch now and then while
the thread holds batches three quarters of its time; shrinking the share there put more
of the decode on the GPU beside the model, the loop waited more, and the share settled
low in 4 of 14 bench runs (ResNet-50 at 97.1-98.2% of its ceiling, against 98.0-99.1%).
Alone the thread holds batches 0.2% of its time, and the rule is as before
(``benchmarks/README.md``, "The share's loop-wait rule").

Whether a share pays at all is then measured, not inferred: with "auto", the picker
(``loader.gpu.tuning.picker``) tries each of the decoder's ways with the share and without ("+cpu"),
and keeps the one with which the training loop takes batches soonest; only the batches
of a way with the share steer it. The loop's wait does not show what a share costs the
loop's own steps: beside ResNet-18 in the same run it stopped waiting (5% of its step
time, 23% with no share) as the share grew to 0.9, and trained at 72% of its ceiling
against 80% (10 cores busy against 3.5; ResNet-50 98.9% against 98.4%). Its pace shows it.
With the ways tried (``gpu-h200-autoways``), the engines without the share were kept alone
(27.2k img/s) and beside ResNet-18 (23.2 ms a batch against 24.4 with it), CUDA with the
share beside ResNet-50 (55.0 against 56.5 without; 99% of its ceiling against 98%).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import CancelledError
from typing import NamedTuple

import numpy as np
import torch

from loader.augment import Transform
from loader.decode import get_decoder
from loader.gpu.augment import GpuAugment, Rows, cut, upload
from loader.gpu.encoded import EncodedBatches
from loader.gpu.mapped import MappedRows
from loader.gpu.nvjpeg import check_decoded
from loader.gpu.tuning.picker import WayPicker
from loader.telemetry.stats import LoaderStats

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # the unverified stores this process was told of


def warn_unverified(store, decoder: str) -> None:
    """Say once per store that one built with --no-verify brings its corrupt JPEGs to the
    GPU decoders as they are: they decode them to garbage without an error, where the
    CPU path's strict decode finds and replaces them; decoding every JPEG on the CPU as
    well would forgo the GPU path, so the check is left to ``ingest verify``."""
    root = os.path.realpath(store.root)
    if store.manifest.get("options", {}).get("verify", True) is not False or root in _WARNED:
        return
    _WARNED.add(root)
    log.warning(
        "DataLoader: %s was built with --no-verify; decoder=%r decodes its JPEGs on the GPU, "
        "where a corrupt one becomes an image of garbage pixels without an error (the CPU "
        "decoder replaces it): run `ingest verify %s` to find any, or rebuild it without "
        "--no-verify (logged once)", store.root, decoder, store.root,
    )  # fmt: skip


_TARGET_IDLE = 0.05  # share of the prefetch thread's time spent waiting for the workers
_GAIN = 0.5  # share change per batch for each unit of idle-time error
_MAX_AUTO_SHARE = 0.9
_LOOP_WAIT = 0.05  # share of the training loop's time spent waiting for batches
_LOOP_WINDOW = 8  # hand-offs over which that share is measured
_HELD = 0.2  # share of the prefetch thread's time holding batches the loop has not taken
_START_SHARE = 0.25  # of the ways with a share (cpu_share="auto"), before any steering
WITH_SHARE = "+cpu"  # the name of a way whose batches the workers take a share of
_MAX_PLANNED = 4096  # ways remembered for batches planned and not started, at most


class _StreamPool:
    """The stages' side streams, given back when their loader is closed or let go, and
    lent again to the next stage made. torch's caching allocator reuses a freed block only
    for allocations on the stream it was made on: with new streams for each loader, a
    loader built again after a preemption left the blocks of the one before it cached for
    no one. On the H200, a soak with a rebuild every 20 epochs: device memory in use grew
    1,797 MiB over 8 rebuilds, and 66 MiB over 9 with the streams lent again
    (``benchmarks/results/gpu-h200-soak2-*``)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list] = {}
        self._lock = threading.Lock()

    def lend(self, device: torch.device, role: str) -> torch.cuda.Stream:
        """A stream of ``role`` on ``device``: one given back, else a new one (of high
        priority: data before training work)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            free = self._free.get((index, role))
            if free:
                return free.pop()
        return torch.cuda.Stream(index, priority=-1)

    def give_back(self, lent: dict) -> None:
        """Take back the streams of ``lent`` (role: stream), which is emptied: given once."""
        with self._lock:
            while lent:
                role, stream = lent.popitem()
                self._free.setdefault((stream.device.index, role), []).append(stream)


_STREAMS = _StreamPool()


class Call:
    """A call whose outcome one thread waits for while another makes it (``_decode``, in a
    decode thread of ``loader.gpu.prefetch``): the few parts of a ``Future`` used here, but
    the outcome is let go of as it is taken. An error keeps its traceback, which holds the
    frames of the thread that waited for it, whose locals hold the call: a Future keeping
    the error made a cycle, and kept the stage, the iterator and the loader alive until a
    full collection (``tests/test_gpu_path.py``)."""

    def __init__(self, fn=None) -> None:
        self.fn = fn
        self._done = threading.Event()
        self._outcome: tuple | None = None  # (True, value) or (False, error)

    @classmethod
    def of(cls, fn) -> Call:
        """``fn`` called here (its error raised here)."""
        call = cls()
        call._outcome = (True, fn())
        call._done.set()
        return call

    def run(self) -> None:
        """Make the call (once), in the calling thread."""
        fn, self.fn = self.fn, None
        if fn is None or self._done.is_set():
            return
        try:
            outcome = (True, fn())
        except BaseException as e:  # the waiting thread raises it
            outcome = (False, e)
        del fn  # (the stage, in the loader)
        self._outcome = outcome
        del outcome
        self._done.set()
        # An error's traceback holds this frame (its callees' caller): not the call, which
        # holds the error until it is taken (a cycle, where it never is).
        del self

    def cancel(self) -> None:
        """Where it has not run: it never will, and ``result`` raises CancelledError."""
        if not self._done.is_set():
            self.fn, self._outcome = None, (False, CancelledError())
            self._done.set()

    def cancelled(self) -> bool:
        outcome = self._outcome
        return outcome is not None and isinstance(outcome[1], CancelledError)

    def result(self, timeout: float | None = None):
        """The call's value, or its error raised; taken once."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the call was not done within {timeout} s")
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            raise RuntimeError("imfeed bug: a call's outcome was taken twice")
        ok, value = outcome
        del outcome
        if ok:
            return value
        try:
            raise value
        finally:
            del value


class Started(NamedTuple):
    """A batch between ``GpuStage.start`` and ``GpuStage.finish``."""

    views: dict
    gpu_rows: np.ndarray
    report: object
    decode: Call  # _decode, its result
    busy: float  # seconds start took
    way: str = ""  # the picker's way of the batch (WITH_SHARE: with the workers' share)


class GpuStage:
    """Turns gathered slots into output batches on ``device``.

    Args:
        producer: the loader's ``EncodedBatches`` (its CPU decoder serves the retries).
        spec: the transform (output size, mean, std, antialias).
        dtype: output dtype (float dtypes are normalised, uint8 is left raw).
        channels_last: deliver in ``torch.channels_last`` memory format.
        device: the CUDA device.
        decoder: registry name of the GPU decoder.
        cpu_share: "auto" or a fixed fraction of GPU-decodable samples the workers decode.
        num_workers: worker processes (without any, "auto" keeps everything on the GPU).
        stats: where stage timings go.
    """

    def __init__(
        self,
        producer: EncodedBatches,
        spec: Transform,
        dtype: torch.dtype,
        channels_last: bool,
        device: torch.device,
        decoder: str,
        cpu_share: float | str,
        num_workers: int,
        stats: LoaderStats,
    ) -> None:
        self.producer, self.device, self.dtype, self.stats = producer, device, dtype, stats
        self.spec, self.size = spec, spec.size
        self.format = torch.channels_last if channels_last else torch.contiguous_format
        self.decoder = get_decoder(decoder, device=device, batch_size=producer.batch_size)
        warn_unverified(producer.store, decoder)
        # A decoder that decodes only the crop windows (DALI) gets them with the bytes.
        self.windows = bool(getattr(self.decoder, "crop_windows", False))
        self.augment = GpuAugment(spec.size, spec.mean, spec.std, spec.antialias, stats=stats)
        # The side streams (none off CUDA: the CPU, in tests), lent by ``_STREAMS``.
        self._lent: dict = {}  # the streams lent to this stage (``_StreamPool``)
        self._streams = weakref.finalize(self, _STREAMS.give_back, self._lent)
        self._streams.atexit = False
        self.stream = self.decode_stream = None
        self._borrow_streams()
        self._mapped: MappedRows | None = None  # the ring's pixel rows, where kernels read them
        self.auto = cpu_share == "auto" and num_workers > 0  # no workers: nothing to share
        self._starting = False  # the next batch finished is an epoch's first
        self.loop = WindowShare(_LOOP_WINDOW)  # the training loop's waiting for batches
        # The prefetch thread's holding finished batches the loop has not taken (a full
        # queue), from batch to batch, and since the last batch.
        self.held = WindowShare(_LOOP_WINDOW)
        self._held_s = 0.0
        if cpu_share == "auto":  # the share of the ways with one (none without workers)
            cpu_share = _START_SHARE if self.auto else 0.0
        producer.cpu_share = cpu_share
        self._labels = producer.store.labels
        self._index = producer.store.index
        self._in_flight: collections.deque = collections.deque()  # (tensors, done event)
        self._in_flight_lock = threading.Lock()  # decode threads release, finish appends
        # Threads that may decode at once (see ``loader.decode.Decoder``).
        self.concurrent_calls = int(getattr(self.decoder, "concurrent_calls", 1))
        # The ways to make batches, of which the picker keeps the one with which the
        # training loop takes them soonest (``loader.gpu.tuning.picker``): the decoder's, each also
        # with
        # the workers' share where it is "auto". Chosen as each batch is planned (the share
        # is the workers'), remembered by the batch's seed (in its slot) until it is
        # started: however many batches planned are dropped, none takes another's way.
        ways = self.decode_ways()
        if self.auto:
            ways += tuple(way + WITH_SHARE for way in ways)
        self.picker = WayPicker(ways) if len(ways) > 1 else None
        self._fixed_way = ways[0]  # the way of every batch, where there is no picker
        self._planned: dict[int, str] = {}  # by seed: the ways planned, not yet started
        self._planned_lock = threading.Lock()  # the batches are planned on two threads
        # A thread that would not stop at an iteration's close may still be in the stage:
        # then ``release`` leaves it as it is.
        self.abandoned = False
        producer.share_of_next = weakref.WeakMethod(self._plan_way)

    def _borrow_streams(self) -> None:
        """The side streams, where the device is CUDA: ``stream`` for the batches' finish,
        ``decode_stream`` for the decoders. Decoded images stay referenced until the
        kernels reading them are done (see ``_decode``); decoding runs on a stream of its
        own, so its allocations never reuse memory our kernels may still read (the
        decoders write on internal streams)."""
        if self.device.type == "cuda" and not self._lent:
            self._lent["finish"] = self.stream = _STREAMS.lend(self.device, "finish")
            self._lent["decode"] = self.decode_stream = _STREAMS.lend(self.device, "decode")

    def decode_ways(self) -> tuple[str, ...]:
        """The ways this stage decodes (one here; ``DaliStage``: the engines or CUDA)."""
        return ("gpu",)

    def fix_way(self, way: str) -> None:
        """Make every batch planned from now on ``way`` (one of the picker's), without
        trials: to measure each way alone (``benchmarks/diagnose_training.py``)."""
        self.picker, self._fixed_way = None, way

    def _plan_way(self, seed: int) -> float:
        """The picker's way for the batch of ``seed`` being planned (remembered for its
        start), and the workers' share of it."""
        way = self.picker.next() if self.picker is not None else self._fixed_way
        with self._planned_lock:
            self._planned[seed] = way
            if len(self._planned) > _MAX_PLANNED:  # dropped without ``settle``: let go
                del self._planned[next(iter(self._planned))]
        return self._share_of(way)

    def _share_of(self, way: str) -> float:
        """The workers' share of a batch of ``way`` (with "auto": none on a way without it)."""
        if self.auto and not way.endswith(WITH_SHARE):
            return 0.0
        return self.producer.cpu_share

    def _kept_way(self) -> str:
        """The picker's way between trials, or the one fixed where there is no picker."""
        return self.picker.way if self.picker is not None else self._fixed_way

    def _next_way(self, views: dict) -> str:
        """The way planned for the batch being started (without one, as for the batches
        planned before a picker was given: the way kept)."""
        with self._planned_lock:
            way = self._planned.pop(int(views["seed"][0]), None)
        return way if way is not None else self._kept_way()

    def process(self, slot: dict[str, torch.Tensor], report, waited: float = 0.0) -> tuple:
        """The batch in ``slot`` (``report.n`` samples) as (images, labels, indices, event).

        The slot must stay untouched until ``event`` completes (the workers' rows may be
        read there by a kernel: ``loader.gpu.mapped``); so are the tensors ready.
        ``waited``: how long the caller waited for the workers to fill this slot.
        """
        return self.finish(self.start(slot, report), waited)

    def start(self, slot: dict[str, torch.Tensor], report, submit=None, way=None) -> Started:
        """First half of ``process``: hand the slot's JPEGs to the GPU decoder, through
        ``submit(fn) -> Call`` (a decode thread: the caller goes on meanwhile) or here.
        The slot must stay untouched until the event ``finish`` returns completes.
        ``way``: the batch's, where the caller has taken it already."""
        t0 = time.perf_counter()
        n = report.n
        views, gpu_rows, spans = read_slot(slot, n)
        way = self._next_way(views) if way is None else way
        # A decoder fed numpy arrays (DALI) gets numpy slices: a torch tensor's .numpy()
        # per image would be 256 torch calls a batch, each letting the GIL go.
        data = views["data"] if getattr(self.decoder, "takes_numpy", False) else slot["data"]
        decode = functools.partial(self._decode, views, gpu_rows, data, spans, n)
        call = Call.of(decode) if submit is None else submit(decode)
        return Started(views, gpu_rows, report, call, time.perf_counter() - t0, way)

    def finish(self, started: Started, waited: float = 0.0) -> tuple:
        """Second half of ``process``: wait for the decode, then crop, resize and normalise
        on the side stream; (images, labels, indices, event)."""
        t0 = time.perf_counter()
        views, gpu_rows, report = started.views, started.gpu_rows, started.report
        n = report.n
        crops, decoded, expected, decode_s, decoded_event, early = started.decode.result()
        with self._on_side_stream(self.stream):
            if self.stream is not None:  # the decoded images are written in stream order
                self.stream.wait_event(decoded_event)
            ok, images = self._keep_decoded(views, gpu_rows, decoded, expected, report)
            begin = _event(self.device)
            out = torch.empty(
                (n, 3, *self.size), dtype=self.dtype, device=self.device,
                memory_format=self.format,
            )  # fmt: skip
            self.augment(images, crops[ok], gpu_rows[ok], out)
            cpu_rows = np.flatnonzero(views["lengths"][:n] < 0)
            indices = views["indices"][:n].copy()
            labels = self._labels[indices]
            mapped = False
            if early is not None and len(early[1]) == len(cpu_rows):  # no CPU retries
                rows, labels = upload(self.device, cpu_rows, labels, stats=self.stats)
                self.augment.pixels(early[0], rows, out)
                mapped = early[2]
            elif len(cpu_rows):
                (pixels, rows, labels), mapped = self.rows_up(views, cpu_rows, labels)
                self.augment.pixels(pixels, rows, out)
            else:
                (labels,) = upload(self.device, labels, stats=self.stats)
            done = _event(self.device)
        with self._in_flight_lock:  # with the pixels uploaded on the decode stream
            self._in_flight.append(((images, early), done))
        self.stats.add_gpu_time("augment", begin, done)
        self._account(report, len(images), len(cpu_rows), decode_s, mapped)
        self._steer(waited, time.perf_counter() - t0 + started.busy, started.way)
        return out, labels, indices, done

    def _decode(self, views, gpu_rows, data, spans: tuple[list, list], n: int) -> tuple:
        """GPU-decode the JPEGs at ``spans`` (starts, lengths) of ``data`` on the decode
        stream: (the crop rows to apply to the decoded images, the images or None, the
        (height, width) each must have, seconds, an event after the decode's work on the
        decode stream, and the pixels of the rows the workers decoded with those rows, or
        None where there are none).

        The workers' rows are sent to the device here, in a decode thread, not in
        ``finish``: the prefetch thread was the limit with a CPU share on an H200
        (gathering them took 15-19% of its time, gpu-h200-probe-shares2.log), while a
        decode thread would wait for the decoder's lock. So are the JPEGs cut out of the
        slot (``cut``: two torch calls where 256 slices took several ms beside a busy Python
        thread)."""
        cpu0 = time.thread_time()
        # Images of two batches ago are let go, once their kernels are surely done: only
        # then may the decoders' allocations take their memory.
        with self._in_flight_lock:
            done = [self._in_flight.popleft() for _ in range(len(self._in_flight) - 1)]
        for _, event in done:
            event.synchronize()
        del done
        crops = views["crops"][gpu_rows]
        encoded = cut(data, *spans)
        with self._on_side_stream(self.decode_stream):
            cpu_rows = np.flatnonzero(views["lengths"][:n] < 0)
            early = None
            if len(cpu_rows):
                (pixels, *_), mapped = self.rows_up(views, cpu_rows)
                early = (pixels, cpu_rows, mapped)
            t0 = time.perf_counter()
            if self.windows:
                decoded = self.decoder.decode_batch(encoded, crops[:, 0:4])
                expected = crops[:, [2, 3]]  # the windows' heights and widths
                crops = crops.copy()
                crops[:, 0:2] = 0  # each decoded image is its window
            else:
                decoded = self.decoder.decode_batch(encoded)
                at = views["indices"][gpu_rows]
                expected = np.stack([self._index["height"][at], self._index["width"][at]], 1)
            ready = _event(self.device)
        # What the decode threads take from the training loop's interpreter, among others.
        self.stats.add(decode_threads_cpu_s=time.thread_time() - cpu0)
        return crops, decoded, expected, time.perf_counter() - t0, ready, early

    def map_rows(self, pixels: torch.Tensor) -> None:
        """Read the workers' rows from ``pixels`` (the ring's pixel buffer, every slot)
        where they lie (``loader.gpu.mapped``), on a CUDA device."""
        if self.device.type == "cuda":
            self._mapped = MappedRows(pixels, self.device)

    def rows_up(self, views: dict, cpu_rows: np.ndarray, *arrays: np.ndarray) -> tuple:
        """([the slot's pixel rows ``cpu_rows``, ``cpu_rows``, *``arrays``] on the device,
        on the current stream; whether the rows were gathered by a kernel from the ring's
        registered memory rather than copied through a pinned buffer)."""
        mapped = self._mapped  # (decode threads call this too)
        if mapped is not None:
            rows, *rest = upload(self.device, cpu_rows, *arrays, stats=self.stats)
            pixels = mapped.rows(views["pixels"], rows)
            if pixels is not None:
                self.stats.add(h2d_bytes=pixels.nbytes)
                return [pixels, rows, *rest], True
            if mapped.failed:  # it cannot be read so: as before, from now on
                self._mapped = None
        pixels = Rows(views["pixels"], cpu_rows)
        return upload(self.device, pixels, cpu_rows, *arrays, stats=self.stats), False

    def _on_side_stream(self, stream) -> contextlib.AbstractContextManager:
        if stream is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.device))
        stack.enter_context(torch.cuda.stream(stream))
        return stack

    def _keep_decoded(self, views, gpu_rows, decoded, expected, report) -> tuple[np.ndarray, list]:
        """Which of ``gpu_rows`` decoded usably (a mask) and their images; the others are
        decoded (or replaced) on the CPU into their pixel rows, here, before the slot is
        let go. ``expected``: the (height, width) each decoded image must have."""
        ok, images = np.ones(len(gpu_rows), dtype=bool), []
        rows = zip(gpu_rows.tolist(), decoded, expected.tolist(), strict=True)
        for k, (row, image, shape) in enumerate(rows):
            try:
                if image is None:
                    raise ValueError("rejected by the GPU decoder")
                check_decoded(image, shape)
            except ValueError:  # DecodeError too: retry on the CPU, as the issue promises
                self._cpu_retry(views, row, report)
                ok[k] = False
                continue
            images.append(image)
        return ok, images

    def _cpu_retry(self, views: dict, row: int, report) -> None:
        i = int(views["indices"][row])
        crop = views["crops"][row]
        key = (int(views["seed"][0]), row)  # as the workers key their replacements
        written = self.producer.decode_sample(i, crop, views["pixels"][row], key, report)
        views["indices"][row] = written
        views["lengths"][row] = -1
        self.stats.add(gpu_rejected=1)

    def _account(
        self, report, on_gpu: int, on_cpu: int, decode_s: float, mapped: bool = False
    ) -> None:
        """A batch finished: ``on_cpu`` rows the workers decoded, read where they lie
        (``mapped``) or copied."""
        self.stats.add(
            gpu_decoded=on_gpu, cpu_decoded=on_cpu,
            gpu_decode_s=decode_s, cpu_decode_s=report.decode_s,
            worker_read_s=max(0.0, report.worker_s - report.decode_s),
            **({"mapped_rows": on_cpu} if mapped else {}),
        )  # fmt: skip

    def _steer(self, waited: float, busy: float, way: str) -> None:
        """Move the workers' share towards the point where the thread barely waits (by a
        batch of a way with the share: one without tells nothing of it)."""
        self.stats.add(stage_wait_s=waited, stage_busy_s=busy)
        self.held.handed(self._held_s, time.perf_counter())
        self._held_s = 0.0
        starting, self._starting = self._starting, False
        if not self.auto or starting or not way.endswith(WITH_SHARE):
            return
        loop_waits = self.loop.share()
        if loop_waits is None:  # too few hand-offs yet to tell whether the loop waits
            return
        held = self.held.share()
        if loop_waits > _LOOP_WAIT and (held is None or held < _HELD):
            share = self.producer.cpu_share - _GAIN * loop_waits  # the loader is its limit
        else:
            if loop_waits > _LOOP_WAIT:  # not the loader's pace: the workers' wait steers
                self.stats.add(loop_waits_held=1)
            idle = waited / max(waited + busy, 1e-9)
            share = self.producer.cpu_share + _GAIN * (_TARGET_IDLE - idle)
        self.producer.cpu_share = min(max(share, 0.0), _MAX_AUTO_SHARE)

    def epoch_started(self) -> None:
        """An epoch begins: its first batch's wait for the workers is their start (the
        plan dispatched, the first records read), not their pace, and steers nothing; the
        picker leaves out the burst of batches that follows."""
        self._starting = True
        self._borrow_streams()  # given back at a close, where the loader was closed
        self.loop.epoch_started()
        self.held.epoch_started()
        if self.picker is not None:
            self.picker.epoch_started()

    def settle(self) -> None:
        """An iteration closed: the batches planned and not handed off never will be
        (their ways are forgotten); wait for its work that still reads its ring slots
        (none here that matters: a decode thread's gather of the workers' rows may still
        read a slot for a batch that is dropped, whatever the workers write there)."""
        if self.picker is not None:
            self.picker.forget()
        with self._planned_lock:
            self._planned.clear()

    def release(self) -> None:
        """The loader was closed: let go of what the stage holds on the device (the images
        of the last batches kept for their kernels; the decoder's pipelines, where it has
        any), made again as a later iteration needs them; what the picker measured stays.
        Not where a thread that would not stop may still be in the stage (``abandoned``)."""
        if self.abandoned:
            return
        self.settle()
        for stream in (self.stream, self.decode_stream):  # the kernels reading what goes
            if stream is not None:
                stream.synchronize()
        with self._in_flight_lock:
            self._in_flight.clear()
        if self._mapped is not None:  # what it pins, until a later iteration reads rows
            self._mapped.release()
        release = getattr(self.decoder, "release", None)
        if release is not None:
            release()
        # Idle until a later iteration borrows streams again: the next loader built (a
        # rebuild after a preemption) makes its allocations where this one's were cached.
        _STREAMS.give_back(self._lent)

    def note_finished(self) -> None:
        """A batch was finished, ready to be handed off: the picker's measure of the
        loader's own pace, where there is one."""
        if self.picker is not None:
            self.picker.finished(time.perf_counter())

    def note_held(self, seconds: float) -> None:
        """The prefetch thread held a finished batch (or an epoch's end) ``seconds`` before
        the queue of them took it (full: the training loop had not taken those before)."""
        self._held_s += seconds
        self.stats.add(stage_held_s=seconds)

    def note_handoff(self, waited: float) -> None:
        """A batch was handed to the training loop, which ``waited`` seconds for it: the
        picker's measure of the loop's pace, and the CPU share's of whether the loop waits."""
        now = time.perf_counter()
        self.loop.handed(waited, now)
        if self.picker is not None:
            self.picker.handed(now)

    @property
    def cpu_share(self) -> float:
        """The workers' share of the batches of the way kept (with "auto": none on a way
        without it; the share its ways with one get is ``producer.cpu_share``)."""
        return self._share_of(self._kept_way())


def read_slot(slot: dict[str, torch.Tensor], n: int) -> tuple[dict, np.ndarray, tuple]:
    """A gathered slot's arrays as numpy views, the rows of its ``n`` samples whose JPEGs
    go to the GPU (the others the workers decoded), and their (starts, lengths) in it."""
    views = {k: v.numpy() for k, v in slot.items()}
    lengths, starts = views["lengths"][:n], views["starts"][:n]
    gpu_rows = np.flatnonzero(lengths >= 0)
    return views, gpu_rows, (starts[gpu_rows].tolist(), lengths[gpu_rows].tolist())


class WindowShare:
    """The share of a thread's time spent one way over its last ``window`` intervals, each
    from the mark before: the training loop's waiting for batches, from hand-off to
    hand-off; the prefetch thread's holding finished batches the loop has not taken, from
    batch to batch. The first interval after an iteration began is left out (the loop's
    own work between epochs, the workers' start; an iteration that carries on into the
    next epoch, ``persistent_workers``, keeps it). Any thread."""

    def __init__(self, window: int) -> None:
        self._gaps: collections.deque = collections.deque(maxlen=window)  # (gap, waited)
        self._last: float | None = None
        self._skip = False
        self._lock = threading.Lock()

    def handed(self, waited: float, now: float) -> None:
        """An interval ends at ``now``, ``waited`` seconds of it spent the way counted."""
        with self._lock:
            last, self._last = self._last, now
            if last is not None and not self._skip:
                self._gaps.append((now - last, waited))
            self._skip = False

    def epoch_started(self) -> None:
        with self._lock:
            self._skip = True

    def share(self) -> float | None:
        """None until ``window`` gaps are in."""
        with self._lock:
            if len(self._gaps) < self._gaps.maxlen:
                return None
            gaps, waits = map(sum, zip(*self._gaps, strict=True))
        return min(waits / max(gaps, 1e-9), 1.0)


class _Done:
    """A completed event, where there is no CUDA stream (the CPU, in tests)."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return 0.0


def _event(device: torch.device):
    """A timing event recorded now on the current stream (a completed stand-in on CPU)."""
    if device.type != "cuda":
        return _Done()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

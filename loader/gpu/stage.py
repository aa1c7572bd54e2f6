"""GpuStage: one gathered ring slot -> a finished batch on the GPU, on side streams.

For each slot the workers filled (``loader.gpu.encoded``) it decodes the JPEG bytes with
the GPU decoder in one batched call, retries any image the decoder rejects on the CPU
(then, like the CPU path, replaces a record that fails there too), crops, resizes, flips
and normalises the decoded images straight into the output batch (``loader.gpu.augment``),
with a pixel store's crop windows in the same launch, and adds the rows the workers
decoded; both read where they lie in the ring's shared memory (``loader.gpu.uploads``;
else through pinned memory).

``start`` hands the decode to the caller's decode threads (several at once where the
decoder allows) and ``finish`` does the rest, each on a high-priority side stream
(``loader.gpu.streams``); the batch ends with an event the training stream waits on, so
nothing synchronises the device. The way of each batch and the workers' share of it are
the tuning's (``loader.gpu.tuning.ways``).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import weakref
from typing import NamedTuple

import numpy as np
import torch

from loader.augment import Transform
from loader.decode import get_decoder
from loader.gpu.augment import GpuAugment
from loader.gpu.calls import Call
from loader.gpu.encoded import EncodedBatches
from loader.gpu.host_arrays import cut, upload
from loader.gpu.nvjpeg import check_decoded
from loader.gpu.ragged import Ragged
from loader.gpu.steps import BatchSteps
from loader.gpu.streams import STREAMS, on_side_stream, recorded_event
from loader.gpu.tuning.ways import TunedStage
from loader.gpu.unverified import warn_unverified
from loader.gpu.uploads import SlotUploads
from loader.ring import Slot
from loader.telemetry.stats import LoaderStats


class Started(NamedTuple):
    """A batch between ``GpuStage.start`` and ``GpuStage.finish``."""

    views: dict
    gpu_rows: np.ndarray
    report: object
    decode: Call  # _decode, its result
    busy: float  # seconds start took
    way: str = ""  # the picker's way of the batch


class GpuStage(TunedStage):
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
        # A recipe's steps beyond the crop: then batches are cropped to uint8 first.
        self.steps = BatchSteps(spec, dtype, self.format, stats)
        if self.steps.active:
            self.dtype = torch.uint8
        self.decoder = get_decoder(decoder, device=device, batch_size=producer.batch_size)
        warn_unverified(producer.store, decoder)
        # A decoder that decodes only the crop windows (DALI) gets them with the bytes.
        self.windows = bool(getattr(self.decoder, "crop_windows", False))
        self.augment = GpuAugment(spec.size, spec.mean, spec.std, spec.antialias, stats=stats)
        # The side streams (none off CUDA: the CPU, in tests), lent by ``STREAMS``.
        self._lent: dict = {}  # the streams lent to this stage
        self._streams = weakref.finalize(self, STREAMS.give_back, self._lent)
        self._streams.atexit = False
        self.stream = self.decode_stream = None
        self._borrow_streams()
        self.uploads = SlotUploads(device, stats)  # the workers' rows, pixel windows
        self._labels = producer.store.labels
        self._index = producer.store.index
        self._in_flight: collections.deque = collections.deque()  # (tensors, done event)
        self._in_flight_lock = threading.Lock()  # decode threads release, finish appends
        # Threads that may decode at once (see ``loader.decode.Decoder``).
        self.concurrent_calls = int(getattr(self.decoder, "concurrent_calls", 1))
        self._tune(cpu_share, num_workers)
        # A thread that would not stop at an iteration's close may still be in the stage:
        # then ``release`` leaves it as it is.
        self.abandoned = False

    def _borrow_streams(self) -> None:
        """The side streams, where the device is CUDA: ``stream`` for the batches' finish,
        ``decode_stream`` for the decoders. Decoded images stay referenced until the
        kernels reading them are done (see ``_decode``); decoding runs on a stream of its
        own, so its allocations never reuse memory our kernels may still read (the
        decoders write on internal streams)."""
        if self.device.type == "cuda" and not self._lent:
            self._lent["finish"] = self.stream = STREAMS.lend(self.device, "finish")
            self._lent["decode"] = self.decode_stream = STREAMS.lend(self.device, "decode")

    def decode_ways(self) -> tuple[str, ...]:
        """The ways this stage decodes (one here; ``DaliStage``: the engines or CUDA)."""
        return ("gpu",)

    def process(self, slot: dict[str, torch.Tensor], report, waited: float = 0.0) -> tuple:
        """The batch in ``slot`` (``report.n`` samples) as (images, labels, indices, event).

        The slot must stay untouched until ``event`` completes (the workers' rows may be
        read there by a kernel, the pixel windows copied from there: ``loader.gpu.mapped``);
        so are the tensors ready.
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
        with on_side_stream(self.device, self.stream):
            # The pixel windows' copy, queued first: it runs while the decode may not be done.
            windows, window_crops, window_rows = self.uploads.windows(views, n)
            if self.stream is not None:  # the decoded images are written in stream order
                self.stream.wait_event(decoded_event)
            ok, images = self._keep_decoded(views, gpu_rows, decoded, expected, report)
            begin = recorded_event(self.device)
            out = torch.empty(
                (n, 3, *self.size), dtype=self.dtype, device=self.device,
                memory_format=self.format,
            )  # fmt: skip
            self.augment(  # the decoded JPEGs and the pixel windows, in one launch
                Ragged.of(images).join(windows), np.concatenate([crops[ok], window_crops]),
                np.concatenate([gpu_rows[ok], window_rows]), out,
            )  # fmt: skip
            cpu_rows = np.flatnonzero(views["lengths"][:n] < 0)
            indices = views["indices"][:n].copy()
            labels = self._labels[indices]
            mapped = False
            if early is not None and len(early[1]) == len(cpu_rows):  # no CPU retries
                rows, labels = upload(self.device, cpu_rows, labels, stats=self.stats)
                self.augment.pixels(early[0], rows, out)
                mapped = early[2]
            elif len(cpu_rows):
                (pixels, rows, labels), mapped = self.uploads.rows(views, cpu_rows, labels)
                self.augment.pixels(pixels, rows, out)
            else:
                (labels,) = upload(self.device, labels, stats=self.stats)
            if self.steps.active:
                out = self.steps(out, int(views["seed"][0]), views)
            done = recorded_event(self.device)
        with self._in_flight_lock:  # with the pixels uploaded on the decode stream
            self._in_flight.append(((images, early), done))
        self.stats.add_gpu_time("augment", begin, done)
        self._account(report, len(images), len(cpu_rows), decode_s, mapped, len(windows))
        self._steer(waited, time.perf_counter() - t0 + started.busy, started.way)
        return out, labels, indices, done

    def _decode(self, views, gpu_rows, data, spans: tuple[list, list], n: int) -> tuple:
        """GPU-decode the JPEGs at ``spans`` (starts, lengths) of ``data`` on the decode
        stream: (the crop rows to apply to the decoded images, the images or None, the
        (height, width) each must have, seconds, an event after the decode's work on the
        decode stream, and the pixels of the rows the workers decoded with those rows, or
        None where there are none).

        The workers' rows are sent to the device here, in a decode thread, not in
        ``finish``: with a CPU share the prefetch thread is the limit, and gathering them
        took a sixth of its time, while a decode thread would only wait for the decoder's
        lock. So are the JPEGs cut out of the slot (``cut``)."""
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
        with on_side_stream(self.device, self.decode_stream):
            cpu_rows = np.flatnonzero(views["lengths"][:n] < 0)
            early = None
            if len(cpu_rows):
                (pixels, *_), mapped = self.uploads.rows(views, cpu_rows)
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
            ready = recorded_event(self.device)
        # What the decode threads take from the training loop's interpreter, among others.
        self.stats.add(decode_threads_cpu_s=time.thread_time() - cpu0)
        return crops, decoded, expected, time.perf_counter() - t0, ready, early

    def map_ring(self, tensors: dict[str, torch.Tensor]) -> None:
        """Read the workers' rows and the pixel windows from the ring's buffers
        (``tensors``: name -> every slot's) where they lie, on a CUDA device."""
        self.uploads.map_ring(tensors)

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
        self, report, on_gpu: int, on_cpu: int, decode_s: float, mapped: bool, windows: int
    ) -> None:
        """A batch finished: ``on_cpu`` rows the workers decoded, read where they lie
        (``mapped``) or copied; ``windows`` pixel windows cropped on the GPU."""
        self.stats.add(
            gpu_decoded=on_gpu, cpu_decoded=on_cpu, gpu_cropped=windows,
            gpu_decode_s=decode_s, cpu_decode_s=report.decode_s,
            worker_read_s=max(0.0, report.worker_s - report.decode_s),
            **({"mapped_rows": on_cpu} if mapped else {}),
        )  # fmt: skip

    def epoch_started(self) -> None:
        """An epoch begins (see ``TunedStage``); the streams are borrowed again, where a
        close gave them back."""
        self._borrow_streams()
        super().epoch_started()

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
        self.uploads.release()
        release = getattr(self.decoder, "release", None)
        if release is not None:
            release()
        # Idle until a later iteration borrows streams again: the next loader built (a
        # rebuild after a preemption) makes its allocations where this one's were cached.
        STREAMS.give_back(self._lent)


def read_slot(slot: Slot, n: int) -> tuple[dict, np.ndarray, tuple]:
    """A gathered slot's arrays as numpy views, the rows of its ``n`` samples whose JPEGs
    go to the GPU decoder (the others: pixel windows, or decoded by the workers), and
    their (starts, lengths) in it."""
    views = slot.arrays
    lengths, starts = views["lengths"][:n], views["starts"][:n]
    gpu_rows = np.flatnonzero((lengths >= 0) & (views["channels"][:n] == 0))
    return views, gpu_rows, (starts[gpu_rows].tolist(), lengths[gpu_rows].tolist())

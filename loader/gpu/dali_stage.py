"""DaliStage: with ``decoder="dali"``, one DALI pipeline runs the whole GPU stage.

The workers gather each batch's JPEG bytes as for the other GPU decoders (and decode a CPU
share where asked); the pipeline (``loader.gpu.dali_graph``) decodes, resizes, flips and
normalises in DALI's own threads and streams. The prefetch thread only feeds it (``start``)
and copies its output into the batch (``finish``): a few calls a batch, where the
decode-only DALI backend's Python work (feeding, the ragged copy-out, the kernels' tables)
held the loader far below DALI's own pace.

The pipeline is asynchronous: up to ``depth`` batches are in it, their outputs coming back
in the order fed; a new one is primed with copies of its first batch, whose outputs are
dropped. On CUDA two pipelines differ in how the mixed decoder takes the JPEGs (the
hardware engines or CUDA kernels); which lets the model beside it train faster depends on
the model, so the ``WayPicker`` tries both. A batch a pipeline fails on is decoded again
the ``GpuStage`` way, and a new pipeline is fed again the batches the failed one held.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from ingest.cores import half_the_cores
from ingest.cstderr import filtered
from loader.gpu.dali_decode import HW_DECODER_LOAD, LIBRARY_LINES, copy_into, jpeg_batch
from loader.gpu.dali_graph import Graph, build_pipeline, dali_dtype, window_arguments
from loader.gpu.host_arrays import cut, upload
from loader.gpu.nvjpeg import raise_if_not_the_data
from loader.gpu.stage import GpuStage, Started, read_slot
from loader.gpu.streams import on_side_stream, recorded_event
from loader.gpu.tuning.share import WITH_SHARE
from loader.hostmem import trim_heap

MAX_THREADS = 8  # DALI's CPU threads (parsing; Huffman decode of what the engines skip)
# The pipelines, by the share of the JPEGs DALI's mixed decoder gives the hardware engines
# (the rest: CUDA kernels after a Huffman decode on DALI's CPU threads).
ENGINES, CUDA = "engines", "cuda"
_HW_LOAD = {ENGINES: HW_DECODER_LOAD, CUDA: 0.0}
# DALI reads the JPEGs in the ring's slot instead of copying them when fed (half the
# prefetch thread's time feeding). The slot stays untouched until the batch's output is
# taken, and ``settle`` waits for what an abandoned epoch left in the pipeline before its
# slots go back to the workers.
NO_COPY = True


class DaliStarted(NamedTuple):
    """A batch fed to the pipeline, between ``DaliStage.start`` and ``finish``."""

    slot: dict
    views: dict
    gpu_rows: np.ndarray
    report: object
    ticket: object  # what the pipeline will return its output for (``_Ticket``)
    busy: float  # seconds start took
    way: str  # the picker's (``GpuStage.start``)


class _Ticket:
    """A batch for the pipeline of ``kind``: what it is fed (to feed it again to a new
    pipeline, should the one holding it fail on an earlier batch)."""

    def __init__(self, encoded: list, args: dict, kind: str) -> None:
        self.encoded, self.args, self.kind = encoded, args, kind


class _Pipeline:
    """A built DALI pipeline and the tickets of the batches in it, oldest first (None for
    a dummy batch)."""

    def __init__(self, pipe) -> None:
        self.pipe = pipe
        self.queue: list = []
        self.primed = False


class DaliStage(GpuStage):
    """``GpuStage`` whose decode, crop, resize, flip and normalisation run in one DALI
    pipeline. Same arguments; ``decoder`` names the DALI decoder, which serves the batches
    the pipeline fails on."""

    def __init__(self, *args, threads: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.threads = threads or half_the_cores(MAX_THREADS)
        # The batches the GPU stage holds: all but the one being finished may be in DALI.
        self.depth = 1 + self.concurrent_calls
        self._pipelines: dict[str, _Pipeline] = {}  # by kind, built when first needed
        self._out_dtype = dali_dtype(self.dtype)

    def decode_ways(self) -> tuple[str, ...]:
        """The engines or CUDA kernels on CUDA; on the CPU, DALI's one way."""
        return (ENGINES, CUDA) if self.device.type == "cuda" else (ENGINES,)

    def start(self, slot: dict[str, torch.Tensor], report, submit=None, way=None):
        """Feed the slot's JPEGs, their windows and flips to the pipeline and let it run."""
        t0 = time.perf_counter()
        n = report.n
        views, gpu_rows, spans = read_slot(slot, n)
        way = self._next_way(views) if way is None else way
        if not len(gpu_rows):  # every row decoded by the workers: nothing for DALI
            return super().start(slot, report, way=way)
        encoded = cut(views["data"], *spans)
        ticket = _Ticket(encoded, self._arguments(views["crops"][gpu_rows]), self._kind(way))
        t_feed = time.perf_counter()
        try:
            self._feed(ticket)
        except RuntimeError as e:
            raise_if_not_the_data(e)
            self._pipelines.pop(ticket.kind, None)
            return super().start(slot, report, way=way)
        self.stats.add(dali_feed_s=time.perf_counter() - t_feed,
                       dali_cuda_batches=int(ticket.kind == CUDA))  # fmt: skip
        return DaliStarted(slot, views, gpu_rows, report, ticket, time.perf_counter() - t0, way)

    def finish(self, started, waited: float = 0.0) -> tuple:
        """Copy the pipeline's output for ``started`` into the batch, with the workers'
        rows; (images, labels, indices, event)."""
        if isinstance(started, Started):  # a batch started the GpuStage way
            return super().finish(started, waited)
        t0 = time.perf_counter()
        try:
            result = self._output_of(started.ticket)
        except RuntimeError as e:  # feeding it failed
            raise_if_not_the_data(e)
            self._pipelines.pop(started.ticket.kind, None)
            result = None
        if result is None:  # the pipeline failed on this batch
            self.stats.add(dali_batches_redone=1)
            again = super().start(started.slot, started.report, way=started.way)
            return super().finish(again._replace(busy=again.busy + started.busy), waited)
        decode_s = time.perf_counter() - t0
        views, gpu_rows, report = started.views, started.gpu_rows, started.report
        n = report.n
        indices = views["indices"][:n].copy()
        labels = self._labels[indices]
        cpu_rows = np.flatnonzero(views["lengths"][:n] < 0)
        with on_side_stream(self.device, self.stream):
            out = torch.empty(
                (n, 3, *self.size), dtype=self.dtype, device=self.device,
                memory_format=self.format,
            )  # fmt: skip
            windows, window_crops, window_rows = self.uploads.windows(views, n)
            mapped = False
            if len(cpu_rows):
                (pixels, rows, where, labels), mapped = self.uploads.rows(
                    views, cpu_rows, gpu_rows, labels
                )
                self.augment.pixels(pixels, rows, out)
            elif len(windows):
                where, labels = upload(self.device, gpu_rows, labels, stats=self.stats)
            else:
                (labels,) = upload(self.device, labels, stats=self.stats)
            if len(cpu_rows) or len(windows):  # DALI's images go to their rows
                out.index_copy_(0, where, self._copy_out(result, len(gpu_rows)).to(self.dtype))
                self.augment(windows, window_crops, window_rows, out)
            else:
                self._copy_out(result, n, into=out)
            if self.steps.active:
                out = self.steps(out, int(views["seed"][0]), views)
            done = recorded_event(self.device)
        self._account(report, len(gpu_rows), len(cpu_rows), decode_s, mapped, len(windows))
        self._steer(waited, time.perf_counter() - t0 + started.busy, started.way)
        return out, labels, indices, done

    def settle(self) -> None:
        """Wait for the batches still in the pipelines (their outputs dropped): they read
        their JPEGs in the ring's slots, which the workers refill once the epoch is closed."""
        super().settle()
        for kind, own in list(self._pipelines.items()):
            while own.queue:
                try:
                    self._next_output(own)
                except RuntimeError:  # whatever failed, nothing of this pipeline runs any more
                    del self._pipelines[kind]
                    break

    def release(self) -> None:
        """As ``GpuStage.release``, and the pipelines go (their device memory to DALI's
        pools); a later iteration builds them again."""
        super().release()
        if not self.abandoned:
            self._pipelines.clear()
            trim_heap()  # what their threads freed, resident until given back

    def _kind(self, way: str) -> str:
        """The pipeline of a batch of ``way``; in a trial, every one is built first (so
        that building one does not slow another's batches being measured)."""
        if self.picker is not None and self.picker.trialing:
            for kind in self.decode_ways():
                self._built(kind)
        return way.removesuffix(WITH_SHARE)

    # -- the pipeline -------------------------------------------------------------------

    def _feed(self, ticket: _Ticket) -> _Pipeline:
        """Feed one batch to its kind's pipeline (building and priming it first where there
        is none) and schedule its run."""
        own = self._built(ticket.kind)
        while len(own.queue) >= self.depth:  # left by an abandoned epoch: make room
            self._next_output(own)
        encoded, args = ticket.encoded, ticket.args
        with filtered(LIBRARY_LINES):
            if not own.primed:  # its first run starts `depth` iterations: whole batches,
                for _ in range(self.depth - 1):  # as one-sample ones slowed DALI down
                    self._feed_one(own, encoded, args)
                    own.queue.append(None)
            self._feed_one(own, encoded, args)
            own.queue.append(ticket)
            t0 = time.perf_counter()
            own.pipe.schedule_run()  # waits where DALI's queue of outputs is full
            self.stats.add(dali_schedule_s=time.perf_counter() - t0)
            own.primed = True
        return own

    def _built(self, kind: str) -> _Pipeline:
        """The pipeline of ``kind``, built where there is none."""
        own = self._pipelines.get(kind)
        if own is None:
            if not self._pipelines:  # a new stage, or one released: earlier pipelines' frees
                trim_heap()  # go back to the system first (a loader let go of is freed)
            with filtered(LIBRARY_LINES):  # optional codecs it did not find, among others
                own = self._pipelines[kind] = _Pipeline(self._build(kind))
        return own

    @staticmethod
    def _feed_one(own: _Pipeline, encoded: list, args: dict) -> None:
        own.pipe.feed_input("jpegs", jpeg_batch(encoded))
        for name, value in args.items():
            own.pipe.feed_input(name, value)

    def _output_of(self, ticket: _Ticket):
        """The pipeline's output for ``ticket``, or None where the pipeline failed on that
        batch. Outputs fed before it that nobody waits for (dummies, an abandoned epoch's)
        are dropped; where the pipeline holding it failed on one of those (or on a batch
        finished earlier), it is fed again to a new one."""
        for _ in range(2):
            own = self._pipelines.get(ticket.kind)
            if own is None or not any(t is ticket for t in own.queue):
                own = self._feed(ticket)
            while True:
                head = own.queue[0]
                try:
                    out = self._next_output(own)
                except RuntimeError as e:
                    raise_if_not_the_data(e)
                    del self._pipelines[ticket.kind]  # in an unknown state: a new one takes over
                    if head is ticket:
                        return None
                    break
                if head is ticket:
                    return out
        return None

    def _next_output(self, own: _Pipeline):
        own.queue.pop(0)
        with filtered(LIBRARY_LINES):  # its complaints about a bad stream: an error here
            (out,) = own.pipe.outputs(cuda_stream=self.stream)  # None off CUDA
        return out

    def _copy_out(self, out, count: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """DALI's dense output of ``count`` images as an [count, 3, H, W] tensor in the
        batch's dtype and memory format (``into`` where given), on the side stream."""
        shape = (count, 3, *self.size)
        same = self._out_dtype[1] == self.dtype
        if into is None or not same:
            target = torch.empty(
                shape, dtype=self._out_dtype[1], device=self.device, memory_format=self.format
            )
        else:
            target = into
        copy_into(target, out, self.stream)  # no stream off CUDA: done on return
        if into is not None and target is not into:
            into.copy_(target)
        return target

    @property
    def _centre_crop(self) -> bool:
        """Whether the windows are resized larger than the output and cropped ("eval"):
        then only the part of each window that makes the output is resized (a region of
        interest), which costs DALI a third of its speed, so only then."""
        return self.spec.kind == "eval"

    def _arguments(self, crops: np.ndarray) -> dict[str, np.ndarray]:
        """The pipeline's per-sample inputs for crop rows ``crops`` (``window_arguments``)."""
        return window_arguments(crops, self.size, self._centre_crop)

    def _build(self, kind: str):
        """A built pipeline of ``kind`` (ENGINES or CUDA)."""
        return build_pipeline(
            Graph(
                batch_size=self.producer.batch_size, threads=self.threads, device=self.device,
                depth=self.depth, dtype=self.dtype, out_dtype=self._out_dtype[0],
                channels_last=self.format == torch.channels_last, size=self.size,
                mean=self.spec.mean, std=self.spec.std, antialias=self.spec.antialias,
                centre_crop=self._centre_crop, hw_load=_HW_LOAD[kind], no_copy=NO_COPY,
            )
        )  # fmt: skip

"""DaliStage: with ``decoder="dali"``, one DALI pipeline runs the whole GPU stage.

The workers gather each batch's JPEG bytes as for the other GPU decoders (and decode a
CPU share where asked); the pipeline decodes only each sample's crop window (the
sampler's windows: the same samples on every backend), resizes it to the output size
(antialiased, rounded to uint8), flips and normalises it into the output dtype and layout,
all in DALI's own threads and streams. The prefetch thread only feeds it (``start``) and
copies its output into the batch (``finish``): a few calls a batch instead of the
decode threads, the ragged copy-out and the loader's augmentation kernels of the
decode-only DALI backend, whose Python work inside the loader held it to 10-16k img/s on an
H200 while DALI's own pipelines ran at 24-32k (``benchmarks/results/gpu-h200-*.md``).

The pipeline is asynchronous and pipelined (DALI's default executor): up to ``depth``
batches are in it at once, fed ahead, and their outputs come back in the order they were
fed. Its first run starts ``depth`` iterations at once, so a new pipeline is primed with
copies of its first batch whose outputs are dropped (whole batches: primed with one-sample
batches, DALI ran at 12k img/s instead of 30.9k on the H200). A closed epoch waits for
what it left in the pipeline (``settle``).

On CUDA there are two pipelines that differ only in how DALI's mixed decoder takes the
JPEGs: the hardware JPEG engines ("engines": fastest alone, 34k img/s on the H200) or CUDA
kernels after a Huffman decode on DALI's CPU threads ("cuda"). Which one lets the model
beside it train faster depends on the model, and even on the loan of the machine (on the
H200, ResNet-50 at 98.1-98.3% of its ceiling the CUDA way against 95.8-96.0%; ResNet-18 at
71.9-72.1% against 82.9-84.3%, then 89.7% against 79.6% on the next loan,
``gpu-h200-diagnose3/4-*.log``), so a ``WayPicker`` tries both and keeps the one with which
the training loop takes batches sooner (``loader.gpu.tuning.picker``; with ``cpu_share="auto"``,
each
also with the workers' share and without: ``loader.gpu.stage``); ``note_finished`` and
``note_handoff`` tell it.

A batch the pipeline fails on (a stream no decoder takes, a window outside its image) is
decoded again the way of the decode-only DALI backend (``GpuStage``): image by image where
the batch fails, an image the GPU cannot decode retried on the CPU and, failing there too,
replaced and counted. A new pipeline takes over, fed again the batches the failed one held.
nvImageCodec's line about such a stream is printed from DALI's own thread; the captures
around feeding and taking outputs miss it when it comes between them (tested: at most
that one line, or the colour code before it).

The pixels differ from the loader's own kernels only by DALI's resampling (same filter:
a triangle as wide as the scale when shrinking, bilinear otherwise; the tests state the
tolerance).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np
import torch

from ingest.cores import half_the_cores
from ingest.cstderr import filtered
from loader.gpu.augment import cut, upload
from loader.gpu.dali_decode import _LIBRARY_LINES, HW_DECODER_LOAD, copy_into, jpeg_batch
from loader.gpu.nvjpeg import raise_if_not_the_data
from loader.gpu.stage import WITH_SHARE, GpuStage, Started, _event, read_slot
from loader.hostmem import trim_heap

MAX_THREADS = 8  # DALI's CPU threads (parsing; Huffman decode of what the engines skip)
# The pipelines, by the share of the JPEGs DALI's mixed decoder gives the hardware engines
# (the rest: CUDA kernels after a Huffman decode on DALI's CPU threads).
ENGINES, CUDA = "engines", "cuda"
_HW_LOAD = {ENGINES: HW_DECODER_LOAD, CUDA: 0.0}
# DALI reads the JPEGs in the ring's slot instead of copying them when fed: 2.6 ms of the
# prefetch thread's time a batch instead of 5.2 on the H200 (dali-stage-probe.json). The
# slot stays untouched until the batch's output is taken, and ``settle`` waits for what an
# abandoned epoch left in the pipeline before its slots go back to the workers.
NO_COPY = True
# More arguments of the engines' decoder (benchmarks/diagnose_training.py tries some).
# Telling it the store's largest image (``preallocate_*_hint``) left its stalls beside
# ResNet-50 on the H200 as they were: 95.0% of the model's ceiling against 94.9%
# (``prealloc``, gpu-h200-diagnose7-resnet50.log).
ENGINE_ARGS: dict = {}


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
        self._out_dtype = self._dali_dtype()

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
        with self._on_side_stream(self.stream):
            out = torch.empty(
                (n, 3, *self.size), dtype=self.dtype, device=self.device,
                memory_format=self.format,
            )  # fmt: skip
            if len(cpu_rows):
                (pixels, rows, where, labels), mapped = self.rows_up(
                    views, cpu_rows, gpu_rows, labels
                )
                out.index_copy_(0, where, self._copy_out(result, len(gpu_rows)).to(self.dtype))
                self.augment.pixels(pixels, rows, out)
            else:
                mapped = False
                (labels,) = upload(self.device, labels, stats=self.stats)
                self._copy_out(result, n, into=out)
            done = _event(self.device)
        self._account(report, len(gpu_rows), len(cpu_rows), decode_s, mapped)
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
        with filtered(_LIBRARY_LINES):
            if not own.primed:  # its first run starts `depth` iterations: whole batches,
                for _ in range(self.depth - 1):  # as one-sample ones left DALI at 12k img/s
                    self._feed_one(own, encoded, args)  # against 30.9k (dali-alone2.json)
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
            with filtered(_LIBRARY_LINES):  # optional codecs it did not find, among others
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
        with filtered(_LIBRARY_LINES):  # its complaints about a bad stream: an error here
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

    def _dali_dtype(self) -> tuple:
        """(DALI's output type, the torch dtype it is) for the batch's dtype: bfloat16,
        which DALI does not produce, comes as float32 and is cast on the side stream."""
        from nvidia.dali import types

        pairs = {
            torch.uint8: (types.UINT8, torch.uint8),
            torch.float16: (types.FLOAT16, torch.float16),
        }
        return pairs.get(self.dtype, (types.FLOAT, torch.float32))

    @property
    def _centre_crop(self) -> bool:
        """Whether the windows are resized larger than the output and cropped ("eval"):
        then the part of each window that makes the output is given to the resize (a
        region of interest), which costs DALI a third of its speed (22.1k img/s against
        30.8k with 8 threads on the H200, dali-graphs.json), so only then."""
        return self.spec.kind == "eval"

    def _arguments(self, crops: np.ndarray) -> dict[str, np.ndarray]:
        """The pipeline's per-sample inputs for crop rows ``crops`` (``CROP_COLUMNS``):
        the window to decode (x, y and w, h), the flip and, for a centre crop, the part of
        the window resized to the output (y, x from and to, in the window's pixels)."""
        c = crops.astype(np.float32)
        y, x, h, w, rh, rw, oy, ox = (c[:, k] for k in range(8))
        args = {
            "anchor": np.ascontiguousarray(np.stack([x, y], 1)),
            "shape": np.ascontiguousarray(np.stack([w, h], 1)),
            "flip": np.ascontiguousarray(crops[:, 8].astype(np.int32)),
        }
        if self._centre_crop:
            out_h, out_w = self.size
            sy, sx = h / rh, w / rw  # window pixels per resized pixel
            start = np.stack([oy * sy, ox * sx], 1)
            end = np.stack([(oy + out_h) * sy, (ox + out_w) * sx], 1)
            args.update(roi_start=np.ascontiguousarray(start), roi_end=np.ascontiguousarray(end))
        return args

    def _build(self, kind: str):
        from nvidia.dali import fn, pipeline_def, types

        cuda = self.device.type == "cuda"
        raw = self.dtype == torch.uint8
        mean = [0.0] * 3 if raw else [m * 255 for m in self.spec.mean]
        std = [1.0] * 3 if raw else [s * 255 for s in self.spec.std]
        out_h, out_w = self.size
        layout = "HWC" if self.format == torch.channels_last else "CHW"
        mixed = {"hw_decoder_load": _HW_LOAD[kind]} if cuda else {}
        if cuda and _HW_LOAD[kind] > 0:
            mixed.update(ENGINE_ARGS)

        @pipeline_def(
            batch_size=self.producer.batch_size,
            num_threads=self.threads,
            device_id=(self.device.index or torch.cuda.current_device()) if cuda else None,
            prefetch_queue_depth=self.depth,
            exec_async=True,
            exec_pipelined=True,
        )
        def graph():
            def given(name: str, dtype, ndim: int = 1, **kwargs):
                return fn.external_source(name=name, dtype=dtype, ndim=ndim, **kwargs)

            jpegs = given("jpegs", types.UINT8, no_copy=NO_COPY)
            images = fn.decoders.image_slice(
                jpegs, given("anchor", types.FLOAT), given("shape", types.FLOAT),
                device="mixed" if cuda else "cpu", output_type=types.RGB, axis_names="WH",
                normalized_anchor=False, normalized_shape=False, **mixed,
            )  # fmt: skip
            roi = {}
            if self._centre_crop:
                roi = {
                    "roi_start": given("roi_start", types.FLOAT),
                    "roi_end": given("roi_end", types.FLOAT),
                    "roi_relative": False,
                }
            images = fn.resize(
                images, resize_y=out_h, resize_x=out_w, interp_type=types.INTERP_LINEAR,
                antialias=self.spec.antialias, **roi,
            )  # fmt: skip
            return fn.crop_mirror_normalize(
                images, dtype=self._out_dtype[0], output_layout=layout, mean=mean, std=std,
                mirror=given("flip", types.INT32, ndim=0),
            )  # fmt: skip

        pipe = graph()
        pipe.build()
        return pipe

"""DataLoader: a drop-in for torch.utils.data.DataLoader that reads stores fast.

Given a store path (or an ``LMDBDataset`` without a transform) it plans each epoch itself
(``loader.plan.sampler``), decodes in worker processes into a shared-memory ring
(``loader.workers``, ``loader.cpu.batches``) and delivers ``(images, labels)`` batches on the
device. Given any other Dataset it *is* torch's DataLoader, built with the same arguments.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import os
import sys
import threading
import weakref

import torch
import torch.utils.data

from ingest import format as fmt
from loader import options as opt
from loader.augment import Transform, resolve_transform
from loader.cpu.batches import PixelBatches
from loader.cpu.output import BatchOutput, resolve_device, resolve_dtype
from loader.decode import runs_in_workers, runs_whole_stage
from loader.epoch import EpochIterator
from loader.gpu.dali_stage import DaliStage
from loader.gpu.encoded import EncodedBatches
from loader.gpu.prefetch import GpuEpochIterator, batches_on_gpu, ring_slots
from loader.gpu.stage import GpuStage
from loader.plan.sampler import EpochPlan, RankSampler, check_state
from loader.store import verify_advice
from loader.telemetry.stats import LoaderStats
from loader.workers import Ring, WorkerPool

log = logging.getLogger(__name__)


class _Workers:
    """The worker pool of a loader, held apart so that a finaliser can stop it."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None

    def stop(self, graceful: bool = True) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.close(graceful)


class DataLoader:
    """Batches of ``(images, labels)`` from a store, or torch's DataLoader for a Dataset.

    The arguments shared with ``torch.utils.data.DataLoader`` keep its names, order and
    defaults. Reading a store, ``sampler`` may be a ``DistributedSampler`` (its rank, world
    size, shuffle, seed, drop_last and ``set_epoch`` are followed, its batches are
    reproduced), ``RandomSampler`` or ``SequentialSampler``; ``batch_sampler``/``collate_fn``
    do not apply, ``in_order`` is always honoured and ``pin_memory_device`` is superseded by
    ``device``. Use it from one thread at a time, as torch's: while one thread's iteration
    lasts, ``iter()``, ``set_epoch()`` and ``load_state_dict()`` from another raise
    RuntimeError; ``next()`` on one iterator from several threads gives each batch to one.

    Args:
        dataset: a store directory (made by ``ingest build``), an ``LMDBDataset`` without a
            transform or with a standard torchvision recipe (``loader.recipes``), or any other
            Dataset (then this returns torch's DataLoader, and the store-only arguments
            below are ignored with a warning).
        transform: "train", "eval" or a ``loader.Transform`` (required for a store path).
        image_size: output size of "train"/"eval", int or (height, width); default 224.
        mean, std: normalisation (RGB, 0..1); default ImageNet's.
        dtype: images dtype: float32 (default), float16, bfloat16 or uint8 (not normalised).
        channels_last: deliver images in ``torch.channels_last`` memory format.
        device: where batches go: "cpu" or a CUDA device (default: "cuda" when available).
        seed: seed of the epoch order and the augmentation (default: the sampler's, else
            ``generator``'s, else drawn from torch's global RNG, rank 0's under
            torch.distributed, so that ``torch.manual_seed`` makes a run repeatable).
        rank, world_size: this process's share (default: from torch.distributed, else 0/1).
        with_indices: batches are ``(images, labels, indices)``; indices stay on the CPU.
        decoder: "auto" (default: on a CUDA device "dali" where DALI is installed, else
            "nvjpeg"; "cpu" without one), or a backend
            of ``loader.decode.decoders()``: "cpu" decodes in the workers; "nvjpeg" decodes
            batches on the GPU (torchvision's nvjpeg) and augments them there, the workers
            only gathering encoded bytes (and decoding ``cpu_share`` of them); "dali" (with
            ``pip install 'imfeed[dali]'``) runs decode and augmentation in one DALI
            pipeline, decoding only each crop window: the fastest on an H200 (32.7k img/s,
            1.14x DALI's own best pipeline and 1.4x "nvjpeg" in the same run), its pixels
            resampled by DALI rather than by the loader's kernels; on CUDA its decode runs
            on the hardware engines or in CUDA kernels, whichever lets the training loop
            take batches sooner (measured by trials, ``loader.gpu.tuning.picker``).
        cpu_share: GPU path: fraction of the JPEGs the workers decode on the CPU beside the
            GPU decoder (default 0: all on the GPU, which measured fastest on an H200 with
            nothing else running, and gives bit-for-bit reproducible pixels); "auto" tries
            each way of decoding with a share and without, keeps the one with which the
            training loop takes batches soonest (``loader.gpu.tuning.picker``), and steers the share
            as it runs: it grows while the loop does not wait for batches and the workers
            keep up, and shrinks while either waits (``loader.gpu.stage``). Beside a
            model that keeps the GPU busy the GPU decoder slows far more than the workers
            do: on an H200, 0.3 trained ResNet-50 at 97% of its ceiling where 0 gave 92%,
            with about 5 more cores busy.
        cache, cache_limit, cache_root: a node-wide RAM copy of the shards, shared by all
            processes and workers (``cache="shm"`` or ``"shm:keep"``): as on ``LMDBDataset``.
        max_pixels: the most pixels decoded for one image; a store holding a larger one
            is refused at open (default 178,956,970, the build's default): as on
            ``LMDBDataset``.
        worker_nice: added to the workers' niceness (0 to 19): with more, the training
            process's threads (the training loop, the prefetch thread, DALI's threads) get
            the cores first and the workers take what is left.
        verbose: print which path was taken and why (it is always logged at INFO).

    Attributes:
        dataset: the ``LMDBDataset`` read.
        sampler: the sampler given, else a ``loader.plan.sampler.RankSampler``; ``len`` is this
            rank's number of samples per epoch, as torch's.
        bad_samples: {sample index: "path: reason"} of records that failed to decode; each
            was replaced by another sample and logged once.
        num_replaced: how many samples were replaced so far (every occurrence).

    Raises:
        ValueError: an argument is invalid (the message says which and what to do).
        ingest.format.StoreError: the path is not a complete store.
    """

    def __new__(cls, dataset, *args, verbose: bool = False, **kwargs):
        names = ("batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn")
        given = dict(zip(names, args, strict=False)) | kwargs
        fast, why = opt.route(dataset, given)
        _say(f"loader.DataLoader: {'fast path' if fast else 'torch DataLoader'}: {why}", verbose)
        if fast:
            return super().__new__(cls)
        return torch.utils.data.DataLoader(dataset, *args, **opt.ignore_store_only(kwargs, why))

    def __init__(
        self,
        dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler=None,
        batch_sampler=None,
        num_workers: int = 0,
        collate_fn=None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn=None,
        multiprocessing_context=None,
        generator=None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        transform: str | Transform | None = None,
        image_size: int | tuple[int, int] | None = None,
        mean: tuple[float, float, float] | None = None,
        std: tuple[float, float, float] | None = None,
        dtype: torch.dtype | str | None = None,
        channels_last: bool = False,
        device: torch.device | str | None = None,
        seed: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        with_indices: bool = False,
        decoder: str = "auto",
        cpu_share: float | str = 0.0,
        cache: str | None = None,
        cache_limit: int | str | None = None,
        cache_root: str | os.PathLike | None = None,
        max_pixels: int | None = None,
        worker_nice: int = 0,
        verbose: bool = False,
    ) -> None:
        opt.check_not_for_store(sampler, batch_sampler, collate_fn)
        transform = opt.store_transform(dataset, transform)
        self.batch_size = opt.check_batch_size(batch_size)
        if isinstance(drop_last, (str, bytes)) or drop_last not in (True, False):  # "no": True
            raise ValueError(f"drop_last={drop_last!r} is invalid: pass True or False")
        self.num_workers, self.prefetch_factor, self.timeout = opt.check_workers(
            num_workers, prefetch_factor, timeout
        )
        self.transform = resolve_transform(transform, image_size, mean, std)
        self.device = resolve_device(device)
        self.decoder = opt.resolve_decoder(decoder, self.device)
        cpu_share = opt.check_cpu_share(cpu_share)
        self._stats = LoaderStats()
        self._output = BatchOutput(
            self.transform, resolve_dtype(dtype), bool(channels_last), self.device, pin_memory,
            stats=self._stats,
        )  # fmt: skip
        self.store, self.dataset = opt.open_store(
            dataset, cache=cache, cache_limit=cache_limit, cache_root=cache_root,
            max_pixels=max_pixels,
        )  # fmt: skip
        follow = opt.check_sampler(sampler, shuffle, len(self.store), rank, world_size)
        self.seed, self._seed_chosen = opt.resolve_seed(
            seed, generator, follow.pop("seed"), follow["world_size"]
        )
        self.drop_last, self.with_indices = bool(drop_last), bool(with_indices)
        self.pin_memory = self._output.pin
        self.persistent_workers = bool(persistent_workers)
        self.worker_init_fn = worker_init_fn
        self.worker_nice = opt.check_worker_nice(worker_nice)
        self._context = opt.mp_context(multiprocessing_context)
        self._plan = EpochPlan(
            len(self.store), self.batch_size, seed=self.seed, drop_last=self.drop_last, **follow
        )
        # torch's loader.plan.sampler: the sampler given, else this rank's share of each epoch.
        self.sampler = sampler if sampler is not None else RankSampler(self._plan, self.set_epoch)
        # A DistributedSampler's epoch (its set_epoch) decides each epoch, as in torch.
        self._follows = isinstance(sampler, torch.utils.data.DistributedSampler)
        if self._follows:
            self._plan.set_epoch(sampler.epoch)
        self._labels = self.store.labels
        self._gpu_stage: GpuStage | None = None
        if runs_in_workers(self.decoder):
            self._producer = PixelBatches(
                self.store, self.transform, self.batch_size, self.decoder,
                planar=not channels_last,
            )  # fmt: skip
            slots = 1 if self.num_workers == 0 else self.num_workers * self.prefetch_factor
        else:  # workers gather encoded bytes (and decode a CPU share); the GPU does the rest
            self._producer = EncodedBatches(self.store, self.transform, self.batch_size)
            stage = DaliStage if runs_whole_stage(self.decoder) else GpuStage
            self._gpu_stage = stage(
                self._producer, self.transform, self._output.dtype, bool(channels_last),
                self.device, self.decoder, cpu_share, self.num_workers, self._stats,
            )  # fmt: skip
            # and one finished, whose slot waits for its GPU work (GpuEpochIterator)
            on_gpu = batches_on_gpu(self._gpu_stage.concurrent_calls) + 1
            slots = ring_slots(self.batch_size, self.num_workers, self.prefetch_factor, on_gpu)
        self._ring = Ring(self._producer.buffers(), slots, shared=self.num_workers > 0)
        if self._gpu_stage is not None:
            self._gpu_stage.map_rows(self._ring.tensors["pixels"])
        self._workers = _Workers()
        # Iterations being closed (their workers' chunks drained), maybe on a prefetch
        # thread that let go of its iterator last: a new iteration waits for them, or the
        # chunks they drain would reach it.
        self._closes = threading.Condition()
        self._closing = 0
        self._finalizer = weakref.finalize(self, self._workers.stop, False)
        # What starts or moves an iteration runs one call at a time, and only in the thread
        # whose iteration is under way, if any (``_check_thread``).
        self._control = threading.RLock()
        self._active: weakref.ref | None = None
        # A finished iterator that went on into the next epoch's first batches
        # (``loader.epoch``), for the next iteration to take on.
        self._carry: EpochIterator | None = None
        # The active iterator once its epoch's last batch is out, until the loop asks past
        # it: a loop bounded by len(loader) (zip, islice) drops it unended, and the next
        # iteration (or set_epoch, load_state_dict) ends it as StopIteration would
        # (``_end_active``) and takes it on.
        self._read: EpochIterator | None = None
        self._resume = False  # a loaded state waits to be resumed by the next iteration
        self.bad_samples: dict[int, str] = {}
        self.num_replaced = 0
        if self._gpu_stage is not None:
            _close_at_exit_first(self)

    # -- the torch-like surface ---------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self._plan)

    def __iter__(self) -> EpochIterator:
        """The batches of the current epoch: the rest of it after ``load_state_dict``,
        otherwise all of it (a loop that stopped early starts that epoch again)."""
        with self._control:
            self._check_thread("iter()")
            return self._start_iteration()

    def _start_iteration(self) -> EpochIterator:
        self._end_active("a new iteration")
        self._wait_for_closes()
        self._follow_sampler_epoch()
        if not self._resume and self._plan.consumed:
            self._plan.set_epoch(self._plan.epoch)
        self._resume = False
        carry = self._carry
        if carry is not None and carry.follows_on(self._plan):
            self._carry = None
            carry.carry_on(self._plan)
            self._active = weakref.ref(carry)
            return carry
        self._drop_carry()  # its batches are of an epoch this loop does not read now
        if self.num_workers and self._workers.pool is None:
            self._workers.pool = WorkerPool(
                self._producer, self._ring, self.num_workers, self._context, self.worker_init_fn,
                nice=self.worker_nice,
            )  # fmt: skip
        it = EpochIterator(self) if self._gpu_stage is None else GpuEpochIterator(self)
        self._active = weakref.ref(it)
        return it

    def _follow_sampler_epoch(self) -> None:
        """Read the epoch of the DistributedSampler given as ``sampler=`` (its last
        ``set_epoch``), from its start, unless a loaded state resumes that very epoch."""
        if self._follows and not (self._resume and self.sampler.epoch == self._plan.epoch):
            self._resume = False
            self._plan.set_epoch(self.sampler.epoch)

    @property
    def _pool(self) -> WorkerPool | None:
        return self._workers.pool

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advances when an epoch is read to its end:
        once its last batch is out with persistent workers, otherwise once the loop asks
        past it; with a DistributedSampler, its epoch unless a loaded state resumes
        another)."""
        if self._follows and not (self._resume and self.sampler.epoch == self._plan.epoch):
            return self.sampler.epoch  # as _follow_sampler_epoch will decide
        return self._plan.epoch + (self._read is not None)  # read whole, not yet ended

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order next, from its start (as ``DistributedSampler``);
        after ``load_state_dict`` of a state of that same epoch, resume it instead."""
        with self._control:
            self._check_thread("set_epoch()")
            self._end_active("set_epoch()")
            if self._follows:
                self.sampler.set_epoch(epoch)
            if not (self._resume and epoch == self._plan.epoch):
                self._plan.set_epoch(epoch)
                self._resume = False

    def state_dict(self) -> dict:
        """Progress (JSON-able): the epoch and the batches delivered so far (at an
        epoch's last batch, that epoch with every batch delivered, as inside a ``for``
        loop: a resume then reads what is left of it, nothing, and goes on), and the store's
        build identity ("store") where the store records one."""
        build = self.store.manifest.get("build")  # a version 1 store records none
        return self._plan.state_dict() | ({"store": build} if build else {})

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` output, possibly saved with another world size: the
        next iteration yields the rest of that epoch, later ones continue from there. A
        state that does not fit raises ``ValueError`` and changes nothing: one saved
        reading another store (its build identity, where both record one) included."""
        with self._control:
            self._check_thread("load_state_dict()")
            self._load_state(state)

    def _load_state(self, state: dict) -> None:
        check_state(state)  # before a drawn seed yields to its seed
        saved, build = state.get("store"), self.store.manifest.get("build")
        if saved and build and saved != build:  # the same size would have let it through
            raise ValueError(
                f"the state was saved reading another store (build {saved}) than this "
                f"loader's {self.store.root} (build {build}); load it into a loader of "
                "that store, or start afresh (a store built again from files with other "
                "modification times is another build: drop the state's 'store' to resume)"
            )
        reseed = not self._seed_chosen and "seed" in state  # a drawn seed yields to it
        probe = copy.copy(self._plan)
        if reseed:
            probe.reseed(state["seed"])
        probe.load_state_dict(state)  # raises here, before the iteration under way ends
        self._end_active("load_state_dict()")
        if reseed:
            self._plan.reseed(state["seed"])
            self.seed = self._plan.seed
        self._plan.load_state_dict(state)
        self._resume = True

    def stats(self) -> dict:
        """Where the time went so far, per stage (seconds, counts; also per sample).

        Keys (those of stages that ran): ``batches``, ``samples``; ``wait_s``: the training
        loop's wait for the next batch; ``worker_read_s``: worker time reading records;
        ``cpu_decode_s``: worker time decoding on the CPU; ``gpu_decode_s``: the GPU
        decoder's wall time (with "dali": the prefetch thread's wait for the pipeline's
        output), ``dali_feed_s``: its time feeding the pipeline (``dali_schedule_s`` of it
        in DALI's ``schedule_run``, which waits while DALI's queue of outputs is full),
        ``dali_batches_redone``: batches the pipeline failed on, decoded again image by
        image; ``augment_s``: GPU time of cropping, resizing and normalising (CUDA events);
        ``gpu_decoded``/``cpu_decoded`` and ``gpu_share``: samples decoded on each side;
        ``gpu_rejected``: JPEGs the GPU decoder refused (decoded on the CPU);
        ``cpu_share``: the workers' current share of the GPU-decodable samples of the
        batches of the way kept (with ``cpu_share="auto"``, 0 on a way without it),
        ``loop_wait_share`` the share of the training loop's time spent waiting for
        batches over its last 8 (what ``cpu_share="auto"`` steers by, with
        ``stage_wait_s`` below; None before 8), ``held_share`` the share of the prefetch
        thread's time holding finished batches the loop had not taken, over its last 8
        (a loop's wait shrinks an auto share only while it is under 0.2; ``loop_waits_held``
        counts the batches at which it did not, the loop waiting over 5% of its time);
        ``epochs_carried``: epochs whose first batches were made while the loop finished
        the one before (``persistent_workers=True``), ``carries_dropped``: such batches
        dropped, the next iteration reading another epoch or place;
        ``starved_handoffs``: batches handed to a training stream with no work left queued
        (the model waited for data; on CUDA); ``pending_handoffs``: batches handed off
        with their GPU work still running (the training stream waits for it; on CUDA);
        where the loader picks among ways of making batches (``decoder="dali"`` on CUDA:
        the engines or CUDA kernels; ``cpu_share="auto"``: each with the workers' share
        or without, "+cpu"), ``way``: the way kept between trials (``loader.gpu.tuning.picker``),
        ``way_trials`` the trials so far, ``way_trialing`` whether one is under way,
        ``way_trial_causes`` what started the last trials ("first", "drift": the loop's
        pace moved, "recheck", "close": the trial before could not tell the ways apart; up
        to 8 decided, oldest first, then the one under way if any),
        ``way_paces_ms`` each way's pace in the last trial (milliseconds a batch, the
        faster is kept: ``loader.gpu.tuning.picker``), ``way_drifts_ms`` for each of those trials
        that
        a drift started, the kept way's pace and the pace it had moved to; with ``decoder="dali"``,
        ``dali_cuda_batches`` the batches it decoded with CUDA kernels instead of the
        hardware engines;
        ``prefetch_cpu_s``: the GPU path's prefetch thread's own CPU time, and
        ``decode_threads_cpu_s`` its decode threads' (time these threads may take from the
        training loop's Python, though part of it runs without the GIL);
        ``stage_wait_s``/``stage_busy_s``: that thread's time waiting for the workers and
        working (what ``cpu_share="auto"`` balances), ``stage_held_s`` holding finished
        batches while the queue of them was full (the loop's pace, not the loader's);
        ``h2d_bytes``: bytes this loader copied to the device (batches decoded on the CPU,
        labels, the GPU kernels' tables; a GPU decoder copies the JPEG bytes inside its
        call, in ``gpu_decode_s``) and ``h2d_s``: GPU time of the CPU path's batch copies
        (CUDA events; on the GPU path its few copies run between the augmentation's events,
        in ``augment_s``); ``mapped_rows``: the workers' rows a kernel read where they lie
        (the ring's pixel buffer registered with CUDA, ``loader.gpu.mapped``). Worker times add
        up over workers (CPU seconds, not wall time).
        """
        out = self._stats.snapshot()
        out["decoder"] = self.decoder
        if self._gpu_stage is not None:
            out["cpu_share"] = self._gpu_stage.cpu_share
            out["loop_wait_share"] = self._gpu_stage.loop.share()
            out["held_share"] = self._gpu_stage.held.share()
            picker = self._gpu_stage.picker
            if picker is not None:  # read under its lock: the prefetch thread decides
                summary = picker.summary()
                out["way"] = summary.pop("way")
                out.update({f"way_{k}": v for k, v in summary.items()})
        return out

    def cache_stats(self) -> dict[str, int] | None:
        """Shard cache counts of this process and its workers (hits, misses, bytes_copied,
        from_original, replaced); None without ``cache=``."""
        return self.dataset.cache_stats()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the running workers (empty when none run)."""
        return self._pool.pids if self._pool is not None else []

    def close(self) -> None:
        """Stop the workers now and let go of the GPU stage's pipelines and buffers (a later
        iteration starts and builds them again)."""
        if self._foreign_iteration() is not None:  # its thread may be waiting on them:
            self._workers.stop(graceful=False)  # it is told so, and nothing is drained
        self._end_active("close()", stopping=True)
        self._drop_carry()
        self._workers.stop()
        self._output.close()
        with self._closes:
            closing = self._closing  # an iteration closing on its prefetch thread
        if self._gpu_stage is not None and not closing:
            self._gpu_stage.release()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- called by EpochIterator ----------------------------------------------------------

    def _deliver(self, slot: dict[str, torch.Tensor], report) -> tuple:
        self._note_bad(report.bad)
        self._stats.add(
            batches=1, samples=report.n, cpu_decoded=report.cpu_decoded,
            cpu_decode_s=report.decode_s,
        )  # fmt: skip
        indices = slot["indices"][: report.n].numpy().copy()
        images = self._output.images(slot["images"][: report.n])
        labels = self._output.labels(self._labels[indices])
        if self.with_indices:
            return images, labels, torch.from_numpy(indices)
        return images, labels

    def _path_of(self, index: int) -> str:
        """Sample ``index``'s source path for a message (never an error: it is metadata)."""
        try:
            return fmt.shown(self.store.paths[index])
        except fmt.StoreError as e:
            return f"its path unknown: {e}"

    def _note_bad(self, bad: list[tuple[int, str]]) -> None:
        for index, reason in bad:
            self.num_replaced += 1
            if index not in self.bad_samples:
                path = self._path_of(index)
                self.bad_samples[index] = f"{path}: {reason}"
                log.warning(
                    "DataLoader: sample %d (%s) could not be decoded (%s); it is replaced "
                    "by another sample, now and in later epochs (logged once)%s",
                    index,
                    path,
                    reason,
                    verify_advice(reason, self.store.root),
                )

    def _iteration_ended(
        self, it: EpochIterator, finished: bool, drained: bool, failed: bool = False
    ) -> None:
        active = self._active is not None and self._active() is it
        if self._read is it:
            self._read = None
        # A loop bounded by len(loader) (zip, islice) reads every batch but never sees
        # StopIteration: its epoch is done all the same, the next one must not repeat it.
        finished = finished or (active and self._plan.remaining() == 0)
        if finished and active:
            self._plan.end_epoch()
        if active:
            self._active = None
        # After an error (a dead or failed worker, a timeout, Ctrl-C) batches in flight may
        # never come: stop the workers at once rather than wait for them.
        keep = self.persistent_workers and not failed and (drained or it.drain(30.0))
        if not keep and self._workers.pool is it._pool:  # not those of a later iteration
            self._workers.stop(graceful=finished)

    @contextlib.contextmanager
    def _closing_iteration(self):
        """Around an iteration's close: counted while it runs (``_wait_for_closes``)."""
        with self._closes:
            self._closing += 1
        try:
            yield
        finally:
            with self._closes:
                self._closing -= 1
                self._closes.notify_all()

    def _wait_for_closes(self, timeout: float = 120.0) -> None:
        """Wait until no iteration is being closed on another thread; past ``timeout``
        (a close that hangs), stop the workers: the next iteration starts new ones."""
        with self._closes:
            if self._closes.wait_for(lambda: self._closing == 0, timeout):
                return
        self._workers.stop(graceful=False)

    def _end_read(self) -> None:
        """An epoch read whole is over, whether or not the loop asked past its last batch."""
        if self._read is not None:
            self._end_active("its epoch was read whole")

    def _hold_if_read(self, it: EpochIterator) -> bool:
        """``it`` (going on into the next epoch) delivered a batch: hold it if that was
        its epoch's last (True)."""
        if self._plan.remaining():
            return False
        self._read = it
        return True

    def _iteration_parked(self, it: EpochIterator) -> bool:
        """``it`` delivered its epoch to the end and went on into the next: keep it for
        the next iteration (False, and nothing done, if it was not the active one)."""
        if self._active is None or self._active() is not it or self._plan.remaining():
            return False
        self._plan.end_epoch()
        self._active = self._read = None
        self._carry = it
        return True

    def _drop_carry(self) -> None:
        carry, self._carry = self._carry, None
        if carry is not None:
            carry.discard()

    def _end_active(self, reason: str, stopping: bool = False) -> None:
        it = self._active() if self._active is not None else None
        self._read = None
        if it is not None:
            if stopping:
                it.close(reason)
            else:
                with it.taking:  # not under a next() of another thread
                    if self._plan.remaining():
                        it.close(reason)
                    else:  # every batch taken, StopIteration never asked for (zip, islice)
                        it.end_read()  # (held since its last batch: see ``_read``)
        self._active = None

    def _foreign_iteration(self) -> threading.Thread | None:
        """The thread whose iteration is under way, if another than this one and alive (a
        thread that has ended gives its iteration up)."""
        it = self._active() if self._active is not None else None
        owner = it.consumer if it is not None else None
        if owner is None or owner is threading.current_thread() or not owner.is_alive():
            return None
        return owner

    def _check_thread(self, call: str) -> None:
        """Refuse ``call`` during another thread's iteration: it would end that iteration
        under it (its batches lost or repeated, its workers stopped while it waits)."""
        owner = self._foreign_iteration()
        if owner is not None:
            raise RuntimeError(
                f"{call} in thread {threading.current_thread().name!r}: this DataLoader is "
                f"being iterated in thread {owner.name!r}; use it from one thread at a time "
                "(as torch's DataLoader): end that iteration first (read it to its end, or "
                "close()), or make one DataLoader per thread"
            )

    def __repr__(self) -> str:
        return (
            f"loader.DataLoader({os.fspath(self.store.root)!r}, batch_size={self.batch_size}, "
            f"shuffle={self._plan.shuffle}, num_workers={self.num_workers}, "
            f"transform={self.transform}, device={str(self.device)!r})"
        )


_ON_GPU: weakref.WeakSet = weakref.WeakSet()  # the loaders with a GPU stage


def _close_at_exit_first(loader: DataLoader) -> None:
    """Have ``loader`` closed at the interpreter's exit before the exit hooks registered
    so far run (those run last to first): DALI's shuts every pipeline down, and a prefetch
    thread still making the next epoch's batches would meet a pipeline shut down under it
    and build another, which then aborted the process at its end (exit status 134, with
    DALI's AssertionError and "terminate called without an active exception" on the
    terminal, where the script had not closed its loader)."""
    _ON_GPU.add(loader)
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    for loader in list(_ON_GPU):
        try:
            loader.close()
        except Exception as e:  # the others are closed all the same
            log.warning("DataLoader: closing %r at exit failed: %s", loader, e)


def _say(message: str, verbose: bool) -> None:
    """Log which path a DataLoader takes and why (at INFO; also on stderr if verbose)."""
    log.info(message)
    if verbose:
        print(message, file=sys.stderr)

"""DataLoader: a drop-in for torch.utils.data.DataLoader that reads stores fast.

Given a store path (or an ``LMDBDataset`` without a transform) it plans each epoch itself
(``loader.plan.sampler``), decodes in worker processes into a shared-memory ring
(``loader.workers``, ``loader.cpu.batches``) and delivers ``(images, labels)`` batches on the
device. Given any other Dataset it *is* torch's DataLoader, built with the same arguments.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.utils.data

from loader import options as opt
from loader.augment import Transform, resolve_transform
from loader.cpu.output import BatchOutput, resolve_device, resolve_dtype
from loader.epoch import EpochIterator
from loader.executor import build_executor
from loader.plan.sampler import EpochPlan, RankSampler
from loader.session import Session, Settings
from loader.telemetry.stats import LoaderStats

log = logging.getLogger(__name__)


class _Setting:
    """A DataLoader attribute kept in its session's ``Settings`` (iterations read it)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else getattr(obj._session.settings, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj._session.settings, self.name, value)


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
            pipeline, decoding only each crop window (the fastest way; its pixels
            resampled by DALI rather than by the loader's kernels); on CUDA its decode runs
            on the hardware engines or in CUDA kernels, whichever lets the training loop
            take batches sooner (measured by trials, ``loader.gpu.tuning.picker``).
        cpu_share: GPU path: fraction of the JPEGs the workers decode on the CPU beside the
            GPU decoder (default 0: all on the GPU, the fastest with nothing else running,
            and bit-for-bit reproducible pixels); "auto" tries each way of decoding with a
            share and without, keeps the one with which the training loop takes batches
            soonest (``loader.gpu.tuning.picker``), and steers the share as it runs: it
            grows while the loop does not wait for batches and the workers keep up, and
            shrinks while either waits (``loader.gpu.tuning.share``). Beside a model that keeps
            the GPU busy the GPU decoder slows far more than the workers do, and a share
            pays off.
        cache, cache_limit, cache_root: a node-wide RAM copy of the shards, shared by all
            processes and workers (``cache="shm"`` or ``"shm:keep"``): as on ``LMDBDataset``.
        max_pixels: the most pixels decoded for one image; a store holding a larger one
            is refused at open (default 178,956,970, the build's default): as on
            ``LMDBDataset``.
        worker_nice: added to the workers' niceness (0 to 19): with more, the training
            process's threads (the training loop, the prefetch thread, DALI's threads) get
            the cores first and the workers take what is left.
        verbose: print which path was taken and why, and whether the workers start again
            each epoch (both are always logged at INFO).

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
        batch_size = opt.check_batch_size(batch_size)
        drop_last = opt.check_flag("drop_last", drop_last)
        channels_last = opt.check_flag("channels_last", channels_last)
        with_indices = opt.check_flag("with_indices", with_indices)
        num_workers, prefetch_factor, timeout = opt.check_workers(
            num_workers, prefetch_factor, timeout
        )
        self.transform = resolve_transform(transform, image_size, mean, std)
        self.device = resolve_device(device)
        self.decoder = opt.resolve_decoder(decoder, self.device)
        cpu_share = opt.check_cpu_share(cpu_share)
        self._stats = LoaderStats()
        self._output = BatchOutput(
            self.transform, resolve_dtype(dtype), channels_last, self.device, pin_memory,
            stats=self._stats,
        )  # fmt: skip
        self.store, self.dataset = opt.open_store(
            dataset, cache=cache, cache_limit=cache_limit, cache_root=cache_root,
            max_pixels=max_pixels,
        )  # fmt: skip
        follow = opt.check_sampler(sampler, shuffle, len(self.store), rank, world_size)
        seed, seed_chosen = opt.resolve_seed(
            seed, generator, follow.pop("seed"), follow["world_size"]
        )
        settings = Settings(
            batch_size, num_workers, prefetch_factor, timeout, bool(persistent_workers),
            with_indices, worker_init_fn, opt.check_worker_nice(worker_nice), seed,
            opt.mp_context(multiprocessing_context),
        )  # fmt: skip
        if num_workers and not persistent_workers:
            _say(opt.RESTARTED_WORKERS, verbose)
        self.drop_last = drop_last
        self.pin_memory = self._output.pin
        self._plan = EpochPlan(
            len(self.store), batch_size, seed=seed, drop_last=self.drop_last, **follow
        )
        self._producer, self._ring, self._gpu_stage = build_executor(
            self.store, self.transform, self.decoder, self.device, self._output, self._stats,
            settings, channels_last, cpu_share,
        )  # fmt: skip
        self._session = Session(
            store=self.store, plan=self._plan, producer=self._producer, ring=self._ring,
            output=self._output, stats=self._stats, gpu_stage=self._gpu_stage,
            settings=settings, sampler=sampler, seed_chosen=seed_chosen,
            label=self._describe(settings),
        )  # fmt: skip
        self._workers = self._session.workers
        # As torch's ``loader.sampler``: the sampler given, else this rank's share of each epoch.
        self.sampler = (
            sampler if sampler is not None else RankSampler(self._plan, self._session.set_epoch)
        )

    # The arguments an iteration reads live in the session's settings.
    batch_size = _Setting()
    num_workers = _Setting()
    prefetch_factor = _Setting()
    timeout = _Setting()
    persistent_workers = _Setting()
    with_indices = _Setting()
    worker_init_fn = _Setting()
    worker_nice = _Setting()
    seed = _Setting()

    # -- the torch-like surface ---------------------------------------------------------

    @property
    def batch_sampler(self) -> torch.utils.data.BatchSampler:
        """As torch's: ``sampler``'s indices in batches (what scripts probe for
        ``set_epoch``, e.g. timm's ``train.py``); the loader's own batches are these."""
        return torch.utils.data.BatchSampler(self.sampler, self.batch_size, self.drop_last)

    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return len(self._plan)

    def __iter__(self) -> EpochIterator:
        """The batches of the current epoch: the rest of it after ``load_state_dict``,
        otherwise all of it (a loop that stopped early starts that epoch again)."""
        return self._session.start()

    @property
    def epoch(self) -> int:
        """The epoch the next iteration reads (advances when an epoch is read to its end:
        once its last batch is out with persistent workers, otherwise once the loop asks
        past it; with a DistributedSampler, its epoch unless a loaded state resumes
        another)."""
        return self._session.epoch

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order next, from its start (as ``DistributedSampler``);
        after ``load_state_dict`` of a state of that same epoch, resume it instead."""
        self._session.set_epoch(epoch)

    def state_dict(self) -> dict:
        """Progress (JSON-able): the epoch and the batches delivered so far (at an
        epoch's last batch, that epoch with every batch delivered, as inside a ``for``
        loop: a resume then reads what is left of it, nothing, and goes on), and the store's
        build identity ("store") where the store records one."""
        return self._session.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` output, possibly saved with another world size: the
        next iteration yields the rest of that epoch, later ones continue from there. A
        state that does not fit raises ``ValueError`` and changes nothing: one saved
        reading another store (its build identity, where both record one) included."""
        self._session.load_state_dict(state)

    def stats(self) -> dict:
        """Where the time went so far, per stage: seconds and counts (also per sample), of
        the stages that ran; each key is described in docs/loader.md ("dl.stats()")."""
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
        pool = self._session.pool
        return pool.pids if pool is not None else []

    @property
    def bad_samples(self) -> dict[int, str]:
        """{sample index: "path: reason"} of the records that failed to decode."""
        return self._session.delivery.bad_samples

    @property
    def num_replaced(self) -> int:
        """How many samples were replaced so far (every occurrence)."""
        return self._session.delivery.num_replaced

    @property
    def _carry(self):  # the iterator parked for the next iteration (read by tests)
        return self._session.carry

    @property
    def _read(self):  # the iterator read whole, not yet ended (read by tests)
        return self._session.read

    def close(self) -> None:
        """Stop the workers now and let go of the GPU stage's pipelines and buffers (a later
        iteration starts and builds them again)."""
        self._session.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return self._describe(self._session.settings)

    def _describe(self, settings: Settings) -> str:
        return (
            f"loader.DataLoader({os.fspath(self.store.root)!r}, "
            f"batch_size={settings.batch_size}, shuffle={self._plan.shuffle}, "
            f"num_workers={settings.num_workers}, transform={self.transform}, "
            f"device={str(self.device)!r})"
        )


def _say(message: str, verbose: bool) -> None:
    """Log which path a DataLoader takes and why (at INFO; also on stderr if verbose)."""
    log.info(message)
    if verbose:
        print(message, file=sys.stderr)

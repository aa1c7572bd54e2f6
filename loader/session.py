"""Session: one DataLoader's iteration lifecycle (epochs, carry-over, resume, close).

The facade (``loader.dataloader``) builds the executor's parts and hands them here; the
epoch iterators (``loader.epoch``, ``loader.gpu.prefetch``) talk to this object only. It
holds no reference to the facade, and an iterator holds it strongly only until its epoch's
last batch is out (``EpochIterator``): so no cycle keeps a loader, its workers or its GPU
stage alive once the training code lets go of them.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import logging
import threading
import weakref

import torch

from loader.delivery import Delivery
from loader.epoch import EpochIterator
from loader.gpu.prefetch import GpuEpochIterator
from loader.plan.sampler import EpochPlan, check_state
from loader.workers import WorkerPool

log = logging.getLogger("loader.dataloader")


@dataclasses.dataclass
class Settings:
    """The loader's arguments an iteration reads (the facade's attributes of those names)."""

    batch_size: int
    num_workers: int
    prefetch_factor: int
    timeout: float
    persistent_workers: bool
    with_indices: bool
    worker_init_fn: object
    worker_nice: int
    seed: int
    context: object


class Workers:
    """The worker pool of a loader, held apart so that a finaliser can stop it."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None

    def stop(self, graceful: bool = True) -> None:
        if self.pool is not None:
            pool, self.pool = self.pool, None
            pool.close(graceful)


class Session:
    """The state of a loader's iterations: the plan, the workers, the active iterator.

    What starts or moves an iteration runs one call at a time, and only in the thread
    whose iteration is under way, if any (``check_thread``)."""

    def __init__(
        self, *, store, plan: EpochPlan, producer, ring, output, stats, gpu_stage,
        settings: Settings, sampler, seed_chosen: bool, label: str,
    ) -> None:  # fmt: skip
        self.store, self.plan, self.settings = store, plan, settings
        self.producer, self.ring, self.output = producer, ring, output
        self.stats, self.gpu_stage = stats, gpu_stage
        self.sampler = sampler  # followed where it is a DistributedSampler, as in torch
        self._follows = isinstance(sampler, torch.utils.data.DistributedSampler)
        if self._follows:
            self.plan.set_epoch(sampler.epoch)
        self._seed_chosen, self._label = seed_chosen, label
        # The CPU path erases the delivered batch (the GPU stage its own).
        spec = producer.spec if gpu_stage is None else None
        self.delivery = Delivery(store, output, stats, settings, spec)
        self.workers = Workers()
        self._finalizer = weakref.finalize(self, self.workers.stop, False)
        # Iterations being closed (their workers' chunks drained), maybe on a prefetch
        # thread that let go of its iterator last: a new iteration waits for them, or the
        # chunks they drain would reach it.
        self._closes = threading.Condition()
        self._closing = 0
        self.control = threading.RLock()
        self._active: weakref.ref | None = None
        # A finished iterator that went on into the next epoch's first batches
        # (``loader.epoch``), for the next iteration to take on.
        self.carry: EpochIterator | None = None
        # The active iterator once its epoch's last batch is out, until the loop asks past
        # it: a loop bounded by len(loader) (zip, islice) drops it unended, and the next
        # iteration (or set_epoch, load_state_dict) ends it as StopIteration would
        # (``_end_active``) and takes it on.
        self.read: EpochIterator | None = None
        self._resume = False  # a loaded state waits to be resumed by the next iteration
        if gpu_stage is not None:
            _close_at_exit_first(self)

    @property
    def pool(self) -> WorkerPool | None:
        return self.workers.pool

    def __repr__(self) -> str:
        return self._label

    # -- what the facade calls ------------------------------------------------------------

    def start(self) -> EpochIterator:
        """The iterator of the current epoch: see ``DataLoader.__iter__``."""
        with self.control:
            self.check_thread("iter()")
            self._end_active("a new iteration")
            self._wait_for_closes()
            self._follow_sampler_epoch()
            if not self._resume and self.plan.consumed:
                self.plan.set_epoch(self.plan.epoch)
            self._resume = False
            carry = self.carry
            if carry is not None and carry.follows_on(self.plan):
                self.carry = None
                carry.carry_on(self.plan)
                self._active = weakref.ref(carry)
                return carry
            self.drop_carry()  # its batches are of an epoch this loop does not read now
            s = self.settings
            if s.num_workers and self.workers.pool is None:
                self.workers.pool = WorkerPool(
                    self.producer, self.ring, s.num_workers, s.context, s.worker_init_fn,
                    nice=s.worker_nice,
                )  # fmt: skip
            it = EpochIterator(self) if self.gpu_stage is None else GpuEpochIterator(self)
            self._active = weakref.ref(it)
            return it

    def _follow_sampler_epoch(self) -> None:
        """Read the epoch of the DistributedSampler given as ``sampler=`` (its last
        ``set_epoch``), from its start, unless a loaded state resumes that very epoch."""
        if self._follows_sampler():
            self._resume = False
            self.plan.set_epoch(self.sampler.epoch)

    def _follows_sampler(self) -> bool:
        return self._follows and not (self._resume and self.sampler.epoch == self.plan.epoch)

    @property
    def epoch(self) -> int:
        """See ``DataLoader.epoch``."""
        if self._follows_sampler():
            return self.sampler.epoch  # as _follow_sampler_epoch will decide
        return self.plan.epoch + (self.read is not None)  # read whole, not yet ended

    def set_epoch(self, epoch: int) -> None:
        """See ``DataLoader.set_epoch``."""
        with self.control:
            self.check_thread("set_epoch()")
            self._end_active("set_epoch()")
            if self._follows:
                self.sampler.set_epoch(epoch)
            if not (self._resume and epoch == self.plan.epoch):
                self.plan.set_epoch(epoch)
                self._resume = False

    def state_dict(self) -> dict:
        """See ``DataLoader.state_dict``."""
        build = self.store.manifest.get("build")  # a version 1 store records none
        return self.plan.state_dict() | ({"store": build} if build else {})

    def load_state_dict(self, state: dict) -> None:
        """See ``DataLoader.load_state_dict``."""
        with self.control:
            self.check_thread("load_state_dict()")
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
        probe = copy.copy(self.plan)
        if reseed:
            probe.reseed(state["seed"])
        probe.load_state_dict(state)  # raises here, before the iteration under way ends
        self._end_active("load_state_dict()")
        if reseed:
            self.plan.reseed(state["seed"])
            self.settings.seed = self.plan.seed
        self.plan.load_state_dict(state)
        self._resume = True

    def close(self) -> None:
        """See ``DataLoader.close``."""
        if self._foreign_iteration() is not None:  # its thread may be waiting on them:
            self.workers.stop(graceful=False)  # it is told so, and nothing is drained
        self._end_active("close()", stopping=True)
        self.drop_carry()
        self.workers.stop()
        self.output.close()
        with self._closes:
            closing = self._closing  # an iteration closing on its prefetch thread
        if self.gpu_stage is not None and not closing:
            self.gpu_stage.release()

    def end_read(self) -> None:
        """An epoch read whole is over, whether or not the loop asked past its last batch."""
        if self.read is not None:
            self._end_active("its epoch was read whole")

    def drop_carry(self) -> None:
        """Drop the batches made ahead for the next epoch, if any."""
        carry, self.carry = self.carry, None
        if carry is not None:
            carry.discard()

    # -- what the epoch iterators call ----------------------------------------------------

    def ended(self, it: EpochIterator, finished: bool, drained: bool, failed: bool) -> None:
        """Iteration ``it`` is over: its epoch ends if it was read whole, and its workers
        stop unless persistent (and drained of its batches)."""
        active = self._active is not None and self._active() is it
        if self.read is it:
            self.read = None
        # A loop bounded by len(loader) (zip, islice) reads every batch but never sees
        # StopIteration: its epoch is done all the same, the next one must not repeat it.
        finished = finished or (active and self.plan.remaining() == 0)
        if finished and active:
            self.plan.end_epoch()
        if active:
            self._active = None
        # After an error (a dead or failed worker, a timeout, Ctrl-C) batches in flight may
        # never come: stop the workers at once rather than wait for them.
        keep = self.settings.persistent_workers and not failed and (drained or it.drain(30.0))
        if not keep and self.workers.pool is it.pool:  # not those of a later iteration
            self.workers.stop(graceful=finished)

    @contextlib.contextmanager
    def closing(self):
        """Around an iteration's close: counted while it runs (``_wait_for_closes``)."""
        with self._closes:
            self._closing += 1
        try:
            yield
        finally:
            with self._closes:
                self._closing -= 1
                self._closes.notify_all()

    def hold_if_read(self, it: EpochIterator) -> bool:
        """``it`` (going on into the next epoch) delivered a batch: hold it if that was
        its epoch's last (True)."""
        if self.plan.remaining():
            return False
        self.read = it
        return True

    def park(self, it: EpochIterator) -> bool:
        """``it`` delivered its epoch to the end and went on into the next: keep it for
        the next iteration (False, and nothing done, if it was not the active one)."""
        if self._active is None or self._active() is not it or self.plan.remaining():
            return False
        self.plan.end_epoch()
        self._active = self.read = None
        self.carry = it
        return True

    # -- the active iteration -------------------------------------------------------------

    def _wait_for_closes(self, timeout: float = 120.0) -> None:
        """Wait until no iteration is being closed on another thread; past ``timeout``
        (a close that hangs), stop the workers: the next iteration starts new ones."""
        with self._closes:
            if self._closes.wait_for(lambda: self._closing == 0, timeout):
                return
        self.workers.stop(graceful=False)

    def _end_active(self, reason: str, stopping: bool = False) -> None:
        it = self._active() if self._active is not None else None
        self.read = None
        if it is not None:
            if stopping:
                it.close(reason)
            else:
                with it.taking:  # not under a next() of another thread
                    if self.plan.remaining():
                        it.close(reason)
                    else:  # every batch taken, StopIteration never asked for (zip, islice)
                        it.end_read()  # (held since its last batch: see ``read``)
        self._active = None

    def _foreign_iteration(self) -> threading.Thread | None:
        """The thread whose iteration is under way, if another than this one and alive (a
        thread that has ended gives its iteration up)."""
        it = self._active() if self._active is not None else None
        owner = it.consumer if it is not None else None
        if owner is None or owner is threading.current_thread() or not owner.is_alive():
            return None
        return owner

    def check_thread(self, call: str) -> None:
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


_ON_GPU: weakref.WeakSet = weakref.WeakSet()  # the sessions with a GPU stage


def _close_at_exit_first(session: Session) -> None:
    """Have ``session`` closed at the interpreter's exit before the exit hooks registered
    so far run (those run last to first): DALI's shuts every pipeline down, and a prefetch
    thread still making the next epoch's batches would meet a pipeline shut down under it,
    build another, and abort the process at its end."""
    _ON_GPU.add(session)
    atexit.unregister(_close_at_exit)
    atexit.register(_close_at_exit)


def _close_at_exit() -> None:
    for session in list(_ON_GPU):
        try:
            session.close()
        except Exception as e:  # the others are closed all the same
            log.warning("DataLoader: closing %r at exit failed: %s", session, e)

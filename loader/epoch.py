"""EpochIterator: yields the rest of one epoch's batches, in order, from workers or inline.

It keeps every ring slot busy: as soon as a slot is free the next batch is planned and
split into chunks, one task per chunk, so that all workers share each batch (the first
batch comes W times sooner and the end of an epoch leaves no worker idle). Finished batches
wait in a reorder buffer until their turn, and a slot is handed back once its batch has
been copied out. The loader's plan advances only when a batch is delivered, so
``state_dict()`` counts what the user has received, not what the workers have prefetched.

With persistent workers the last batches' refills already place the next epoch's first
ones (``EpochTasks``: the loader's plan one epoch on), and the finished iterator is kept by
the loader's session for the next iteration, which takes it on if its plan is that one and
drops it otherwise (``follows_on``, ``carry_on``, ``discard``): the next epoch starts with batches
made, not with idle workers.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

from ingest import format as fmt
from loader.cpu.batches import BatchReport
from loader.plan.sampler import EpochPlan
from loader.plan.tasks import EpochTasks, chunk_size

_POLL_S = 1.0  # longest wait between checks of the workers' liveness and of the timeout


class LoaderGone(RuntimeError):
    """The loader of an iteration read whole was freed (what the iteration still does is
    moot: nothing can take its batches)."""


class EpochIterator:
    """The iterator ``DataLoader.__iter__`` returns; see there.

    Args:
        session: the loader's ``loader.session.Session`` (plan, producer, ring, pool).
    """

    def __init__(self, session) -> None:
        # The session: held until the epoch's last batch is out, only referred to from then
        # on, while the session holds this iterator (``read``, then ``carry`` where it is
        # parked), so that the two do not hold each other: a loader let go of after an
        # epoch read to its end is freed at once, its thread and workers stopped. Where the
        # loop held only this iterator (``for batch in DataLoader(...)``), the session goes
        # with the last batch: the loop's next ask ends the iteration (``LoaderGone``).
        self._held = session
        self._loader_ref = weakref.ref(session)
        plan, settings = session.plan, session.settings
        self._official = plan.batches()  # advanced once per delivered batch
        self._length = plan.remaining()
        self._next_step = plan.step
        self._ring, self.pool = session.ring, session.pool
        self._producer = session.producer
        self._chunk = chunk_size(settings.batch_size, settings.num_workers)
        self._free = list(range(self._ring.slots - 1, -1, -1))
        self._pending: dict[int, list] = {}  # step -> [slot, chunks out, merged report]
        self._ready: dict[int, tuple[int, BatchReport]] = {}  # step -> (slot, report)
        self._closed = False
        self._failure: Exception | None = None  # raised by a refill after a delivery
        self.ended_by: str | None = None
        # With persistent workers an epoch's end does not stop the work: the next epoch's
        # first batches (the plan one epoch on) are made meanwhile, and the session keeps
        # the finished iterator for the next iteration to take on (``follows_on``).
        self._carries = settings.persistent_workers and self.pool is not None
        self._tasks = EpochTasks(plan, settings.seed, ahead=int(self._carries))
        self._epoch, self._seed = plan.epoch, settings.seed  # the loop's epoch
        self._parked = False  # read to its end, and on into the next epoch
        # next() one thread at a time: each batch to one of them, none lost or repeated.
        self.taking = threading.RLock()
        self.consumer = threading.current_thread()  # the last to take a batch, or its maker

    @property
    def _session(self):
        session = self._held if self._held is not None else self._loader_ref()
        if session is None:
            raise LoaderGone("imfeed: the loader of this iteration, read whole, was freed")
        return session

    def __iter__(self) -> EpochIterator:
        return self

    def follows_on(self, plan: EpochPlan) -> bool:
        """Whether ``plan`` (the loader's, at a new iteration) starts the epoch after this
        one's, from its start, with the same seed: the batches this iterator went on to."""
        where = (plan.epoch, plan.consumed, plan.step, plan.seed)
        return self._parked and where == (self._epoch + 1, 0, 0, self._seed)

    def carry_on(self, plan: EpochPlan) -> None:
        """Become the iterator of ``plan``'s epoch (``follows_on``): the loop takes the
        batches made for it, and the work may go on into the epoch after."""
        self._official = plan.batches()
        self._length = plan.remaining()
        self._epoch += 1
        self._held = self._loader_ref()  # the loop holds it again
        self.consumer = threading.current_thread()
        self._closed = self._parked = False  # in this order: see ``_dispatching``
        self.ended_by = None
        self._tasks.allow()
        self._session.stats.add(epochs_carried=1)

    def discard(self) -> None:
        """Stop a parked iterator: drop the batches made for an epoch the loop did not
        take, and hand the workers back."""
        if self._parked:
            self._parked = False
            if self._loader_ref() is None:  # freed: what it made is moot
                self._end_orphaned()
                return
            self._session.stats.add(carries_dropped=1)
            self._close(finished=False)

    def _epoch_over(self, carrying: bool) -> None:
        """The loop read the epoch to its end: kept by the session for the next iteration
        where the next epoch's first batches are under way (``carrying``), else closed."""
        if carrying and self._session.park(self):
            self._parked = self._closed = True  # in this order: see ``_dispatching``
            self._held = None  # the session holds it (``__init__``)
        else:
            self._close(finished=True)

    def end_read(self) -> None:
        """End an iteration the loop read to its last batch without asking past it (a loop
        bounded by ``len(loader)``: ``zip``, ``islice``) as that ask would have: parked
        where the next epoch's first batches are under way, closed as finished otherwise."""
        with contextlib.suppress(StopIteration):
            next(self)
            raise RuntimeError(
                "imfeed bug: an iteration read to its end delivered one batch more; "
                "please report it with dl.stats()"
            )

    def __len__(self) -> int:
        return self._length

    def __next__(self):
        with self.taking:
            self.consumer = threading.current_thread()
            try:
                return self._next()
            except LoaderGone:  # read whole, its loader let go of since: the epoch is over
                self._end_orphaned()
        raise StopIteration

    def _next(self):
        if self._closed:
            if self.ended_by:
                raise RuntimeError(
                    f"this iterator was ended by {self.ended_by}; start a new "
                    "one with iter(loader) or a new `for` loop"
                )
            raise StopIteration
        try:
            if self._carries and self._tasks.ended_before(self._next_step):
                raise StopIteration  # the epoch's last batch is out; the next one's are on
            if self._failure is not None:
                raise self._failure
            t0 = time.perf_counter()
            slot, report = self._produce()
            self._session.stats.add(wait_s=time.perf_counter() - t0)
            try:  # a failure here loses the batch: end the iteration, not only this call
                batch = self._session.delivery.batch(self._ring.slot(slot), report)
            finally:
                self._free.append(slot)
        except StopIteration:
            # A failed refill did not place the next epoch's batches: the workers start afresh.
            self._epoch_over(carrying=self._failure is None and self._carries)
            raise
        except BaseException:
            self._close(finished=False, failed=True)
            raise
        next(self._official)
        self._next_step += 1
        try:  # refill before returning, so workers run while the user trains
            self._dispatch()
        except Exception as e:  # the batch is delivered and counted: raise on the next call
            self._failure = e
        self._delivered()
        return batch

    def _delivered(self) -> None:
        """A batch is out: where it was its epoch's last, going on into the next, the loader
        holds this iterator until it is ended, and this iterator lets go of it
        (``__init__``)."""
        if self._carries and self._session.hold_if_read(self):
            self._held = None

    def _produce(self) -> tuple[int, BatchReport]:
        """The slot holding the next batch (StopIteration at the end of the epoch)."""
        if self.pool is None:
            step, indices, seed = next(self._tasks)
            slot = self._free.pop()
            views = self._ring.slot(slot).arrays
            decided = self._producer.decide(seed)
            return slot, self._producer.fill(views, 0, len(indices), indices, seed, *decided)
        self._dispatch()
        step = self._next_step
        if step not in self._pending and step not in self._ready:
            raise StopIteration
        self.pool.check_alive()
        timeout = self._session.settings.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while step not in self._ready:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise RuntimeError(
                    f"DataLoader timed out after {timeout} seconds waiting for "
                    f"batch {step} (timeout={timeout})"
                )
            self._take(self.pool.receive(wait))
        return self._ready.pop(step)

    def _next_ready(self) -> bool:
        """Whether ``_produce`` would return (or end the epoch) without waiting for the
        workers."""
        if self.pool is None:
            return True
        self._dispatch()
        step = self._next_step
        if step not in self._pending:
            return True  # ready, or the epoch is over
        self._take(self.pool.receive(0))
        return step in self._ready

    def _take(self, results) -> None:
        for step, _, report in results:
            entry = self._pending[step]
            entry[1] -= 1
            entry[2].merge(report)
            if not entry[1]:
                del self._pending[step]
                self._ready[step] = (entry[0], entry[2])

    def _dispatch(self) -> None:
        """Plan batches and send their chunks to the workers while slots are free."""
        while self.pool is not None and self._free and self._dispatching():
            task = next(self._tasks, None)
            if task is None:
                return
            step, indices, seed = task
            decided = self._producer.decide(seed)  # each worker plans the batch itself
            slot = self._free.pop()
            starts = range(0, len(indices), self._chunk)
            self._pending[step] = [slot, len(starts), BatchReport(len(indices), seed=seed)]
            for lo in starts:
                hi = min(lo + self._chunk, len(indices))
                self.pool.submit((slot, step, (lo, hi, indices, seed, *decided)))

    def _dispatching(self) -> bool:
        """Whether to place more batches with the workers: not once closed, unless parked
        (closed to the loop, its work going on into the next epoch). Parking sets
        ``_parked`` before ``_closed``, taking on clears ``_closed`` first: a prefetch
        thread reading the two meanwhile never finds the iterator closed and not parked."""
        return self._parked or not self._closed

    def close(self, reason: str | None = None) -> None:
        """Abandon the rest of the epoch (its progress stays as delivered); frees the workers."""
        if self._parked:
            self.discard()
        elif self._closed:
            return
        elif self._loader_ref() is None:  # read whole, its loader let go of since
            self._end_orphaned()
        else:
            self.ended_by = reason
            self._close(finished=False)

    def _close(self, finished: bool, failed: bool = False) -> None:
        """End the iteration (its workers drained or stopped), counted by the loader from
        its first step to its last: a new iteration waits for it (``_wait_for_closes``)."""
        with self._session.closing():
            self._close_counted(finished, failed)

    def _close_counted(self, finished: bool, failed: bool) -> None:
        self._closed = True
        # A failure found while refilling (a worker's error, read when a task was placed)
        # means a chunk that will never come: no draining waits for it.
        failed = failed or self._failure is not None
        self._failure = None  # its traceback holds this iterator: let it go now
        self._session.ended(self, finished, drained=not self._pending, failed=failed)

    def drain(self, timeout: float) -> bool:
        """Wait for batches still in the workers (to reuse the workers); False if it failed."""
        deadline = time.monotonic() + timeout
        try:
            while self._pending and time.monotonic() < deadline:
                self._take(self.pool.receive(min(_POLL_S, deadline - time.monotonic())))
        except (RuntimeError, fmt.StoreError):  # what a worker's failure raises
            return False
        return not self._pending

    def __del__(self) -> None:
        # At interpreter shutdown this may fail; the loader's finaliser stops the workers.
        with contextlib.suppress(Exception):
            if self._loader_ref() is None:  # freed with the loader that held it
                self._orphaned()
            else:
                self.close()

    def _end_orphaned(self) -> None:
        """End this iteration, its loader freed: nothing can take its batches."""
        self._closed, self._parked = True, False
        self._orphaned()

    def _orphaned(self) -> None:
        """Its loader, which held it (read whole or parked), was freed: stop what is this
        iterator's own (the loader's finaliser stopped the workers)."""

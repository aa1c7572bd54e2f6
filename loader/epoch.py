"""EpochIterator: yields the rest of one epoch's batches, in order, from workers or inline.

It keeps every ring slot busy: a task ``(slot, step, indices, seed)`` goes to a worker as
soon as a slot is free, finished batches wait in a reorder buffer until their turn, and a
slot is handed back once its batch has been copied out. The loader's plan advances only when
a batch is delivered, so ``state_dict()`` counts what the user has received, not what the
workers have prefetched.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterator

import numpy as np

from loader.sampler import EpochPlan, batch_seed

_POLL_S = 1.0  # longest wait between checks of the workers' liveness and of the timeout


def tasks(plan: EpochPlan, seed: int) -> Iterator[tuple[int, np.ndarray, int]]:
    """Yield (global step, indices, augmentation seed) for the rest of ``plan``'s epoch.

    Iterates a copy: the caller's plan is advanced separately, on delivery.
    """
    shadow = copy.copy(plan)
    for indices in shadow.batches():
        step = shadow.step - 1
        yield step, indices, batch_seed(seed, shadow.epoch, step, rank=shadow.rank)


class EpochIterator:
    """The iterator ``DataLoader.__iter__`` returns; see there.

    Args:
        loader: the owning ``loader.DataLoader`` (plan, producer, ring, pool, output).
    """

    def __init__(self, loader) -> None:
        self._loader = loader
        self._official = loader._plan.batches()  # advanced once per delivered batch
        self._tasks = tasks(loader._plan, loader.seed)
        self._length = loader._plan.remaining()
        self._next_step = loader._plan.step
        self._ring, self._pool = loader._ring, loader._pool
        self._free = list(range(self._ring.slots - 1, -1, -1))
        self._in_flight: set[int] = set()  # steps sent to workers, not yet back
        self._ready: dict[int, tuple[int, object]] = {}  # step -> (slot, report)
        self._closed = False
        self.ended_by: str | None = None

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return self._length

    def __next__(self):
        if self._closed:
            if self.ended_by:
                raise RuntimeError(
                    f"this iterator was ended by {self.ended_by}; start a new "
                    "one with iter(loader) or a new `for` loop"
                )
            raise StopIteration
        try:
            slot, report = self._produce()
        except StopIteration:
            self._close(finished=True)
            raise
        except BaseException:
            self._close(finished=False)
            raise
        try:
            batch = self._loader._deliver(self._ring.slot(slot), report)
        finally:
            self._free.append(slot)
        next(self._official)
        self._next_step += 1
        self._dispatch()  # refill before returning, so workers run while the user trains
        return batch

    def _produce(self) -> tuple[int, object]:
        """The slot holding the next batch (StopIteration at the end of the epoch)."""
        if self._pool is None:
            step, indices, seed = next(self._tasks)
            slot = self._free.pop()
            views = {k: v.numpy() for k, v in self._ring.slot(slot).items()}
            return slot, self._loader._producer.fill(views, indices, seed)
        self._dispatch()
        step = self._next_step
        if step not in self._in_flight and step not in self._ready:
            raise StopIteration
        self._pool.check_alive()
        timeout = self._loader.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while step not in self._ready:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            if wait <= 0:
                raise RuntimeError(
                    f"DataLoader timed out after {timeout} seconds waiting for "
                    f"batch {step} (timeout={timeout})"
                )
            self._take(self._pool.receive(wait))
        return self._ready.pop(step)

    def _take(self, results) -> None:
        for step, slot, report in results:
            self._in_flight.discard(step)
            self._ready[step] = (slot, report)

    def _dispatch(self) -> None:
        """Send tasks to the workers while slots are free."""
        while self._pool is not None and self._free and not self._closed:
            task = next(self._tasks, None)
            if task is None:
                return
            step, indices, seed = task
            slot = self._free.pop()
            self._pool.submit((slot, step, indices, seed))
            self._in_flight.add(step)

    def close(self, reason: str | None = None) -> None:
        """Abandon the rest of the epoch (its progress stays as delivered); frees the workers."""
        if not self._closed:
            self.ended_by = reason
            self._close(finished=False)

    def _close(self, finished: bool) -> None:
        self._closed = True
        self._loader._iteration_ended(self, finished, drained=not self._in_flight)

    def drain(self, timeout: float) -> bool:
        """Wait for batches still in the workers (to reuse the workers); False if it failed."""
        deadline = time.monotonic() + timeout
        try:
            while self._in_flight and time.monotonic() < deadline:
                self._take(self._pool.receive(min(_POLL_S, deadline - time.monotonic())))
        except RuntimeError:
            return False
        return not self._in_flight

    def __del__(self) -> None:
        # At interpreter shutdown this may fail; the loader's finaliser stops the workers.
        with contextlib.suppress(Exception):
            self.close()

"""The worker tasks of an epoch: which samples each batch takes, and with which seed.

A batch is split into chunks, one task per chunk, so that all workers share each batch
(the first batch comes W times sooner and an epoch's end leaves no worker idle). The tasks
iterate a copy of the loader's plan: the plan itself advances only on delivery.
"""

from __future__ import annotations

import collections
import copy
import threading
from collections.abc import Iterator

import numpy as np

from loader.plan.sampler import EpochPlan, batch_seed

MIN_CHUNK = 16  # samples per task at least: keeps the messages per image negligible


def chunk_size(batch_size: int, num_workers: int) -> int:
    """Samples per worker task: a batch split evenly over the workers, not too finely."""
    return max(MIN_CHUNK, -(-batch_size // max(1, num_workers)))


def tasks(plan: EpochPlan, seed: int) -> Iterator[tuple[int, np.ndarray, int]]:
    """Yield (global step, indices, augmentation seed) for the rest of ``plan``'s epoch.

    Iterates a copy, taken now (not at the first ``next``): the caller's plan is advanced
    separately, on delivery, and moves to the next epoch at the end of this one, which may
    come before the first task is asked for (an epoch with nothing left, as after loading
    the state saved at its last batch).
    """
    return _tasks_of(copy.copy(plan), seed)


def _tasks_of(shadow: EpochPlan, seed: int) -> Iterator[tuple[int, np.ndarray, int]]:
    for indices in shadow.batches():
        step = shadow.step - 1
        yield step, indices, batch_seed(seed, shadow.epoch, step, rank=shadow.rank)


class EpochTasks:
    """The worker tasks ``(key, indices, augmentation seed)`` of the rest of ``plan``'s
    epoch, then of up to ``ahead`` epochs after it (and one more per ``allow``): each
    ``plan`` one epoch on, as ``DataLoader`` moves it at an epoch's end. Keys are the
    epoch's steps, counted on across epochs (the first epoch's own steps, then the next
    one's from where it ended), so that batches keep one order; ``ends`` holds the key
    after each epoch's last batch, once its tasks began. Iterates copies of ``plan``.

    Once ``ahead`` runs out, ``next`` raises StopIteration, and yields again after
    ``allow`` (asked again at each free slot)."""

    def __init__(self, plan: EpochPlan, seed: int, ahead: int = 0) -> None:
        self._plan, self._seed = copy.copy(plan), seed
        self._tasks = tasks(plan, seed)
        self._offset = 0
        self._ahead = ahead
        # allow() is the training thread's; next and wait, the prefetch thread's.
        self._allowed = threading.Condition()
        self.ends = collections.deque([plan.step + plan.remaining()])
        self._end = self.ends[0]

    def ended_before(self, key: int) -> bool:
        """Whether an epoch ends before batch ``key`` (each end is told once)."""
        if self.ends and key == self.ends[0]:
            self.ends.popleft()
            return True
        return False

    def allow(self) -> None:
        with self._allowed:
            self._ahead += 1
            self._allowed.notify_all()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s until ``next`` may go on into another epoch."""
        with self._allowed:
            return self._allowed.wait_for(lambda: self._ahead > 0, timeout)

    def __iter__(self) -> EpochTasks:
        return self

    def __next__(self) -> tuple:
        task = next(self._tasks, None)
        while task is None:
            with self._allowed:
                if not self._ahead:
                    raise StopIteration
                self._ahead -= 1
            self._plan = copy.copy(self._plan)
            self._plan.end_epoch()
            self._tasks, self._offset = tasks(self._plan, self._seed), self._end
            self._end += len(self._plan)
            self.ends.append(self._end)
            task = next(self._tasks, None)
        step, indices, seed = task
        return self._offset + step, indices, seed

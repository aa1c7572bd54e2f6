"""TunedStage: the tuning wired into a GPU stage, each batch's way and the workers' share.

The ways to make batches are the stage's decode ways, each also with the workers' share
where ``cpu_share="auto"``; the ``WayPicker`` keeps the one with which the training loop
takes batches soonest, and the batches of a way with the share steer it
(``loader.gpu.tuning.share``). A batch's way is chosen as it is planned (the share is the
workers', who decode it as they gather the batch) and remembered by the batch's seed until
it is started: however many batches planned are dropped, none takes another's way.
"""

from __future__ import annotations

import threading
import time
import weakref

from loader.gpu.tuning.picker import WayPicker
from loader.gpu.tuning.share import LOOP_WINDOW, START_SHARE, WITH_SHARE, WindowShare, steered

_MAX_PLANNED = 4096  # ways remembered for batches planned and not started, at most


class TunedStage:
    """The base of ``GpuStage``, which sets ``producer`` and ``stats``, gives its
    ``decode_ways()``, calls ``_tune`` and reports its events (``note_*``,
    ``epoch_started``, ``settle``, ``_steer`` as each batch is finished)."""

    def _tune(self, cpu_share: float | str, num_workers: int) -> None:
        """Wire the tuning: ``cpu_share`` ("auto" or a fixed fraction) for ``num_workers``
        workers (without any, "auto" keeps everything on the GPU)."""
        producer = self.producer
        self.auto = cpu_share == "auto" and num_workers > 0  # no workers: nothing to share
        self._starting = False  # the next batch finished is an epoch's first
        self.loop = WindowShare(LOOP_WINDOW)  # the training loop's waiting for batches
        # The prefetch thread's holding finished batches the loop has not taken (a full
        # queue), from batch to batch, and since the last batch.
        self.held = WindowShare(LOOP_WINDOW)
        self._held_s = 0.0
        if cpu_share == "auto":  # the share of the ways with one (none without workers)
            cpu_share = START_SHARE if self.auto else 0.0
        producer.cpu_share = cpu_share
        ways = self.decode_ways()
        if self.auto:
            ways += tuple(way + WITH_SHARE for way in ways)
        self.picker = WayPicker(ways) if len(ways) > 1 else None
        self._fixed_way = ways[0]  # the way of every batch, where there is no picker
        self._planned: dict[int, str] = {}  # by seed: the ways planned, not yet started
        self._planned_lock = threading.Lock()  # the batches are planned on two threads
        producer.share_of_next = weakref.WeakMethod(self._plan_way)

    def decode_ways(self) -> tuple[str, ...]:
        raise NotImplementedError

    def fix_way(self, way: str) -> None:
        """Make every batch planned from now on ``way`` (one of the picker's), without
        trials: to measure each way alone."""
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
        share, left = steered(self.producer.cpu_share, waited, busy, loop_waits, self.held.share())
        if left:  # not the loader's pace: the workers' wait steered
            self.stats.add(loop_waits_held=1)
        self.producer.cpu_share = share

    def epoch_started(self) -> None:
        """An epoch begins: its first batch's wait for the workers is their start (the
        plan dispatched, the first records read), not their pace, and steers nothing; the
        picker leaves out the burst of batches that follows."""
        self._starting = True
        self.loop.epoch_started()
        self.held.epoch_started()
        if self.picker is not None:
            self.picker.epoch_started()

    def settle(self) -> None:
        """An iteration closed: the batches planned and not handed off never will be
        (their ways are forgotten)."""
        if self.picker is not None:
            self.picker.forget()
        with self._planned_lock:
            self._planned.clear()

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

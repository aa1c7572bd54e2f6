"""TunedStage: the tuning wired into a GPU stage, each batch's way and the workers' share.

The ways to make batches are the stage's decode ways, each also with the workers' share
where ``cpu_share="auto"``; the ``WayPicker`` keeps the one with which the training loop
takes batches soonest, and the batches of a way with the share steer it
(``loader.gpu.tuning.share``). Both feed the plan's ``Routing``, which the producer reads
as each batch is sent to the workers (the share is theirs: they decode it as they gather it).
"""

from __future__ import annotations

import time

from loader.gpu.tuning.routing import Routing
from loader.gpu.tuning.share import LOOP_WINDOW, START_SHARE, WITH_SHARE, WindowShare, steered


class TunedStage:
    """The base of ``GpuStage``, which sets ``producer`` and ``stats``, gives its
    ``decode_ways()``, calls ``_tune`` and reports its events (``note_*``,
    ``epoch_started``, ``settle``, ``_steer`` as each batch is finished)."""

    def _tune(self, cpu_share: float | str, num_workers: int) -> None:
        """Wire the tuning: ``cpu_share`` ("auto" or a fixed fraction) for ``num_workers``
        workers (without any, "auto" keeps everything on the GPU)."""
        auto = cpu_share == "auto" and num_workers > 0  # no workers: nothing to share
        self._starting = False  # the next batch finished is an epoch's first
        self.loop = WindowShare(LOOP_WINDOW)  # the training loop's waiting for batches
        # The prefetch thread's holding finished batches the loop has not taken (a full
        # queue), from batch to batch, and since the last batch.
        self.held = WindowShare(LOOP_WINDOW)
        self._held_s = 0.0
        if cpu_share == "auto":  # the share of the ways with one (none without workers)
            cpu_share = START_SHARE if auto else 0.0
        ways = self.decode_ways()
        if auto:
            ways += tuple(way + WITH_SHARE for way in ways)
        self.routing = Routing(ways, float(cpu_share), auto)
        self.producer.routing = self.routing  # what the plan reads for each batch

    def decode_ways(self) -> tuple[str, ...]:
        raise NotImplementedError

    def fix_way(self, way: str) -> None:
        """Make every batch planned from now on ``way`` (one of the picker's), without
        trials: to measure each way alone."""
        self.routing.fix(way)

    @property
    def picker(self):
        """The ``WayPicker`` trying the ways (None with one way, or one fixed)."""
        return self.routing.picker

    def _next_way(self, views: dict) -> str:
        """The way planned for the batch being started."""
        return self.routing.started(int(views["seed"][0]))

    def _steer(self, waited: float, busy: float, way: str) -> None:
        """Move the workers' share towards the point where the thread barely waits (by a
        batch of a way with the share: one without tells nothing of it)."""
        self.stats.add(stage_wait_s=waited, stage_busy_s=busy)
        self.held.handed(self._held_s, time.perf_counter())
        self._held_s = 0.0
        starting, self._starting = self._starting, False
        if not self.routing.auto or starting or not way.endswith(WITH_SHARE):
            return
        loop_waits = self.loop.share()
        if loop_waits is None:  # too few hand-offs yet to tell whether the loop waits
            return
        share, left = steered(self.routing.share, waited, busy, loop_waits, self.held.share())
        if left:  # not the loader's pace: the workers' wait steered
            self.stats.add(loop_waits_held=1)
        self.routing.share = share

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
        self.routing.forget()

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
        without it; the share its ways with one get is ``routing.share``)."""
        return self.routing.share_of(self.routing.kept())

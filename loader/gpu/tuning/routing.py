"""Routing: the way of each GPU batch and the workers' share of it, decided as it is sent.

``EncodedBatches.decide`` asks it for each batch's share, in the training process,
before the workers plan the batch with it; the GPU stage's tuning writes it (the picker,
the steered share) and reads back, as the batch starts, the way it was planned with.
Routing holds neither the stage nor the producer, so nothing calls back from the planner
into the stage, and a producer sent to spawned workers carries no tuning. A way is
remembered by the batch's seed until it starts: however many batches planned are
dropped, none takes another's way.
"""

from __future__ import annotations

import threading

from loader.gpu.tuning.picker import WayPicker
from loader.gpu.tuning.share import WITH_SHARE

_MAX_PLANNED = 4096  # ways remembered for batches planned and not started, at most


class Routing:
    """Each batch's way (tried by a ``WayPicker`` where there are several) and share.

    Args:
        ways: the ways to make batches (the first is kept where there is no picker).
        share: the workers' share of the GPU-decodable samples of a batch of a way that
            takes one: every way with a fixed share, those ending "+cpu" with "auto".
        auto: the share is steered, and only the ways ending "+cpu" take it.
    """

    def __init__(
        self, ways: tuple[str, ...] = ("gpu",), share: float = 0.0, auto: bool = False
    ) -> None:
        self.picker = WayPicker(ways) if len(ways) > 1 else None
        self.fixed = ways[0]  # the way of every batch, where there is no picker
        self.share = float(share)
        self.auto = auto
        self._planned: dict[int, str] = {}  # by seed: the ways planned, not yet started
        self._lock = threading.Lock()  # the batches are planned on two threads

    def plan(self, seed: int) -> float:
        """The workers' share of the batch of ``seed`` being planned (its way remembered)."""
        way = self.picker.next() if self.picker is not None else self.fixed
        with self._lock:
            self._planned[seed] = way
            if len(self._planned) > _MAX_PLANNED:  # dropped without ``forget``: let go
                del self._planned[next(iter(self._planned))]
        return self.share_of(way)

    def started(self, seed: int) -> str:
        """The way planned for the batch of ``seed`` being started (without one, as for
        batches planned before a picker was given: the way kept)."""
        with self._lock:
            way = self._planned.pop(seed, None)
        return way if way is not None else self.kept()

    def share_of(self, way: str) -> float:
        """The workers' share of a batch of ``way`` (with "auto": none on a way without it)."""
        if self.auto and not way.endswith(WITH_SHARE):
            return 0.0
        return self.share

    def kept(self) -> str:
        """The picker's way between trials, or the one fixed where there is no picker."""
        return self.picker.way if self.picker is not None else self.fixed

    def fix(self, way: str) -> None:
        """Make every batch planned from now on ``way``, without trials."""
        self.picker, self.fixed = None, way

    def forget(self) -> None:
        """The batches planned and not started never will be: their ways are let go."""
        if self.picker is not None:
            self.picker.forget()
        with self._lock:
            self._planned.clear()

    @property
    def pending(self) -> int:
        """Batches planned and not yet started."""
        with self._lock:
            return len(self._planned)

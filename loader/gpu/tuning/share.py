"""The workers' share of a GPU batch with ``cpu_share="auto"``, steered by feedback.

The prefetch thread should never wait for the workers (they decode their share while the
GPU decodes the rest), so the share grows while that wait is under ``_TARGET_IDLE`` of the
thread's time and shrinks as soon as the workers hold the thread up. Feedback rather than
a model of rates, because what the workers get depends on what else runs on the machine
(the training process above all), which a rate measured in a worker does not show.

The loop's wait steers too: a training loop that waits for batches (over ``_LOOP_WAIT``
of its time) while the prefetch thread is busy (holding finished batches under ``_HELD``
of its time) has the loader for its limit, and the share then shrinks, since alone the
share's rows cost that thread more than the GPU decode they save. Whether a share pays at
all is measured by the ``WayPicker``, which tries each way with it and without.
"""

from __future__ import annotations

import collections
import threading

WITH_SHARE = "+cpu"  # the name's end of a way whose batches the workers take a share of
START_SHARE = 0.25  # of the ways with a share, before any steering
LOOP_WINDOW = 8  # intervals over which the loop's waiting and the thread's holding count
_TARGET_IDLE = 0.05  # share of the prefetch thread's time spent waiting for the workers
_GAIN = 0.5  # share change per batch for each unit of idle-time error
_MAX_AUTO_SHARE = 0.9
_LOOP_WAIT = 0.05  # share of the training loop's time spent waiting for batches
_HELD = 0.2  # share of the prefetch thread's time holding batches the loop has not taken


def steered(share: float, waited: float, busy: float, loop_waits: float, held) -> tuple:
    """(the share after a batch of a way with it, whether the loop's wait was left to the
    workers' as not the loader's doing). ``waited``, ``busy``: the prefetch thread's seconds
    for the batch; ``loop_waits``, ``held``: ``WindowShare.share`` of the loop's waiting and
    of the thread's holding batches (None: too few intervals yet)."""
    left = False
    if loop_waits > _LOOP_WAIT and (held is None or held < _HELD):
        share -= _GAIN * loop_waits  # the loader is the loop's limit
    else:
        left = loop_waits > _LOOP_WAIT
        idle = waited / max(waited + busy, 1e-9)
        share += _GAIN * (_TARGET_IDLE - idle)
    return min(max(share, 0.0), _MAX_AUTO_SHARE), left


class WindowShare:
    """The share of a thread's time spent one way over its last ``window`` intervals, each
    from the mark before: the training loop's waiting for batches, from hand-off to
    hand-off; the prefetch thread's holding finished batches the loop has not taken, from
    batch to batch. The first interval after an iteration began is left out (the loop's
    own work between epochs, the workers' start; an iteration that carries on into the
    next epoch, ``persistent_workers``, keeps it). Any thread."""

    def __init__(self, window: int) -> None:
        self._gaps: collections.deque = collections.deque(maxlen=window)  # (gap, waited)
        self._last: float | None = None
        self._skip = False
        self._lock = threading.Lock()

    def handed(self, waited: float, now: float) -> None:
        """An interval ends at ``now``, ``waited`` seconds of it spent the way counted."""
        with self._lock:
            last, self._last = self._last, now
            if last is not None and not self._skip:
                self._gaps.append((now - last, waited))
            self._skip = False

    def epoch_started(self) -> None:
        with self._lock:
            self._skip = True

    def share(self) -> float | None:
        """None until ``window`` gaps are in."""
        with self._lock:
            if len(self._gaps) < self._gaps.maxlen:
                return None
            gaps, waits = map(sum, zip(*self._gaps, strict=True))
        return min(waits / max(gaps, 1e-9), 1.0)

"""The WayPicker's drift rule: whether the kept way's pace has moved, and the loop's pauses.

Between trials the kept way's pace is followed by the median of its last ``track`` gaps,
so that one pause does not start a trial, and a drift is called only once that median has
stayed over ``drift`` from the pace the trial measured for ``track`` gaps in a row, so
that a slowdown of a few batches does not either. A gap over ``PAUSE`` times the median
of the last gaps, whatever their way, is a pause of the loop's own (an epoch's start, a
checkpoint, an evaluation), after which the picker leaves gaps out.
"""

from __future__ import annotations

import collections
import statistics

from loader.gpu.tuning.trial import PAUSE


class DriftWatch:
    """The gaps between hand-offs as the drift rule sees them; the picker's lock holds."""

    def __init__(self, track: int, drift: float) -> None:
        self.drift = drift
        self._recent: collections.deque = collections.deque(maxlen=track)  # the kept way's
        self._latest: collections.deque = collections.deque(maxlen=track)  # any gap
        self._moved = 0  # hand-offs in a row with the median of the last ``track`` moved
        self.moved_to: tuple[float, float] | None = None  # the pace, the median: a drift

    def paused(self, gap: float) -> bool:
        """Note a gap between hand-offs, whatever its way; whether it is a pause of the
        loop's own: over ``PAUSE`` times the median of the last ones (a pace that lasts
        soon makes that median)."""
        paused = bool(self._latest) and gap > PAUSE * statistics.median(self._latest)
        self._latest.append(gap)
        return paused

    def kept(self, gap: float) -> None:
        """A gap between two batches of the kept way, between trials."""
        self._recent.append(gap)

    def restart(self) -> None:
        """Count the moved medians from none again (after a pause, an epoch's start)."""
        self._moved = 0

    def clear(self) -> None:
        """A trial decided: the gaps before it tell nothing of the way it kept."""
        self._recent.clear()
        self._moved = 0

    def median(self) -> float | None:
        """The kept way's pace now: the median of its last ``track`` gaps (None: fewer)."""
        if len(self._recent) < self._recent.maxlen:
            return None
        return statistics.median(self._recent)

    def moved(self, pace: float, now: float) -> bool:
        """Whether the median ``now`` has been over ``drift`` from ``pace`` for ``track``
        gaps in a row (then ``moved_to`` says from what to what)."""
        moved = abs(now - pace) > self.drift * pace
        self._moved = self._moved + 1 if moved else 0
        if self._moved < self._recent.maxlen:
            return False
        self.moved_to = (pace, now)
        return True

"""WayPicker: of several ways of making batches, the one with which the training loop takes
them soonest, found by trying each.

Which way is best depends on what trains beside the loader, and nothing the loader sees by
itself tells (the DALI engines are fastest alone, yet one model trains faster beside the
CUDA way, another beside the engines). So the picker measures the loop's pace itself, the
gaps between hand-offs and between batches finished, the slower of the two (the batches
made ahead hide a slow way for a while), in counterbalanced trials (``loader.gpu.tuning.
trial``). A trial too close to call is followed by one in the other order among the ways
still in the running; one decisive halfway (or a way's first ``probe`` gaps) stops early.
A new trial starts once ``warmup`` batches are handed off, when the kept way's pace moves
by over ``drift`` for ``track`` gaps in a row, and every ``recheck`` batches. Gaps after a
pause of the loop's own (over ``PAUSE`` times the median) or an epoch's start are left out.
The ways of batches started and not yet finished or handed off are remembered in order, so
each gap counts for its own batch's way.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from loader.gpu.tuning.drift import DriftWatch
from loader.gpu.tuning.trial import (
    COUNTED,
    HALF,
    LAST,
    SKIPPED,
    Trial,
    averaged,
    next_opener,
    plan,
    running,
    steady_mean,
)

_RECHECK = 16  # whole trials' batches between two trials, by default


class WayPicker:
    """See the module docstring. ``next`` is called as a batch is started (its way),
    ``finished`` as one is ready to be handed off, ``handed`` as one is handed to the
    training loop, ``forget`` when the batches in flight are dropped (an epoch closed
    early), ``epoch_started`` as an epoch begins; any thread."""

    def __init__(
        self,
        ways: Sequence[str],
        window: int = 64,
        skip: int = 10,
        track: int = 8,
        drift: float = 0.5,
        recheck: int | None = None,
        warmup: int = 16,
        statistic=steady_mean,
        decisive: float | None = 1.25,
        close: float | None = 0.1,
        probe: int = 16,
    ) -> None:
        if len(ways) < 2 or 2 * skip + 3 > window:
            raise ValueError("WayPicker needs two ways or more and window >= 2 * skip + 3")
        self.ways = tuple(ways)
        self.way = self.ways[0]  # the way kept between trials
        self.window, self.skip = window, skip
        self.recheck = _RECHECK * 2 * len(self.ways) * window if recheck is None else recheck
        self.warmup, self.statistic, self.decisive = warmup, statistic, decisive
        self.close, self.probe = close, probe
        self.trials = 0
        self.pace: float | None = None  # seconds a batch, the kept way's in its trial
        # The last trials (``Trial``), oldest first: to tell afterwards why a way was kept.
        self.history: collections.deque = collections.deque(maxlen=8)
        self._handoffs = 0
        self._lock = threading.Lock()
        self._plan: list[tuple[str, int]] = []  # the trial's batches still to start:
        # (way, place: SKIPPED, COUNTED, LAST); started, not yet handed off: (way, place
        # or None)
        self._in_flight: collections.deque = collections.deque()
        self._unfinished: collections.deque = collections.deque()  # the same, to finish
        self._gaps: dict[str, list[float]] = {}  # by way, between hand-offs
        self._made: dict[str, list[float]] = {}  # by way, between batches finished
        self._last_made: tuple[str, float] | None = None
        self._drift = DriftWatch(track, drift)
        self._last: tuple[str, float] | None = None  # way and time of the last hand-off
        self._since = 0  # hand-offs since the last trial ended
        # Gaps still to leave out after the loop paused or an epoch began.
        self._quiet_handed = self._quiet_made = 0
        self._trialing = False
        self._cause = "first"
        self._order: tuple[str, ...] = self.ways  # the ways in the order of the last trial
        self._tried: tuple[str, ...] = self.ways  # the ways of the last trial
        if warmup == 0:
            self._start_trial("first")

    @property
    def trialing(self) -> bool:
        return self._trialing

    @property
    def cause(self) -> str:
        """What started the trial under way, or the last one."""
        return self._cause

    def summary(self) -> dict:
        """The way kept, the trials so far, whether one is under way, what started the
        last ones (decided, then the one under way) and each way's pace in the last
        decided (ms a batch): one consistent reading, whatever thread asks."""
        with self._lock:
            paces = self.history[-1].paces if self.history else {}
            return {
                "way": self.way, "trials": self.trials, "trialing": self._trialing,
                "trial_causes": [trial.cause for trial in self.history]
                + ([self._cause] if self._trialing else []),
                "paces_ms": {w: round(p * 1e3, 2) for w, p in paces.items()},
                "drifts_ms": [[round(p * 1e3, 2) for p in trial.moved]
                              for trial in self.history if trial.moved],
            }  # fmt: skip

    def next(self) -> str:
        """The way of the batch being started."""
        with self._lock:
            way, place = self._plan.pop(0) if self._plan else (self.way, None)
            self._in_flight.append((way, place))
            self._unfinished.append((way, place))
            return way

    def finished(self, now: float) -> None:
        """A batch was finished (ready to be handed off) at ``now``."""
        with self._lock:
            way, place = self._unfinished.popleft() if self._unfinished else (None, None)
            last, self._last_made = self._last_made, (way, now)
            if last is not None and self._quiet_made:
                self._quiet_made -= 1
            elif self._counted(place) and last is not None and last[0] == way:
                self._made[way].append(now - last[1])

    def handed(self, now: float) -> None:
        """A batch was handed off at ``now`` (seconds, any monotonic clock)."""
        with self._lock:
            self._handoffs += 1
            way, place = self._in_flight.popleft() if self._in_flight else (None, None)
            last, self._last = self._last, (way, now)
            fresh = False  # whether a gap joined those the kept way's pace is tracked by
            if last is not None:
                gap = now - last[1]
                if self._drift.paused(gap):  # the loop paused: what was made meanwhile follows
                    self._quiet_handed = self.skip
                    self._drift.restart()
                elif self._quiet_handed:
                    self._quiet_handed -= 1
                elif way is not None and last[0] == way:
                    if place is None:
                        if not self._trialing:
                            self._drift.kept(gap)
                            fresh = True
                    elif self._counted(place):
                        self._gaps[way].append(gap)
                        if len(self._gaps[way]) == self.probe and self._far_slower(way):
                            place = self._cut_run(way, place)
            if self._trialing:
                left = any(p is not None for _, p in self._in_flight)
                if place == LAST or not (self._plan or left):
                    self._decide()  # the rest of the trial's plan would measure nothing
                elif place == HALF and self._told_apart():
                    self._decide()
                return
            self._since += 1
            if self.trials == 0 and self._since >= self.warmup:
                self._start_trial("first")
            elif self._since >= self.recheck:
                self._start_trial("recheck")
            elif fresh and self._drifted():
                self._start_trial("drift")

    def forget(self) -> None:
        """The batches in flight will not be handed off."""
        with self._lock:
            self._in_flight.clear()
            self._unfinished.clear()
            self._last = self._last_made = None
            if self._trialing and not self._plan:
                self._decide()

    def epoch_started(self) -> None:
        """An epoch begins: its first batches come in a burst, made at once after the
        workers started on it (the next ``skip`` gaps each side are left out)."""
        with self._lock:
            self._quiet_handed = self._quiet_made = self.skip
            self._drift.restart()

    @staticmethod
    def _counted(place: int | None) -> bool:
        """Whether the gap before a batch at ``place`` is measured (in a trial, not one of
        the ``skip`` at either end of a run, beside another way's batches)."""
        return place is not None and place != SKIPPED

    def _pace_so_far(self, way: str) -> float:
        """``way``'s pace in the trial under way, by the gaps counted so far (3 or more)."""
        made = self._made[way]
        handed = self.statistic(self._gaps[way])
        return max(handed, self.statistic(made)) if len(made) >= 3 else handed

    def _far_slower(self, way: str) -> bool:
        """Whether ``way``, ``probe`` gaps into its first run, is already over ``decisive``
        times the pace of a way measured before it in this trial (over ``probe`` gaps or
        more: the gaps after an epoch's start are left out of a window)."""
        before = [w for w in self._tried if w != way and len(self._gaps[w]) >= self.probe]
        if self.decisive is None or not before or self.probe < 3:
            return False
        return self._pace_so_far(way) > self.decisive * min(map(self._pace_so_far, before))

    def _cut_run(self, way: str, place: int) -> int:
        """End ``way``'s run here: the rest of it is not started, and what is started is
        not counted (the next way's batches decode beside it). Where the end of the last
        way's first window was cut, the trial decides now if it tells the ways apart (it
        does unless ``way``'s pace has come back since); where its last counted gap was,
        the last counted gap left takes its place. The place of the batch handed off."""
        cut = []
        while self._plan and self._plan[0][0] == way:
            cut.append(self._plan.pop(0)[1])
        cut += [p for w, p in (*self._in_flight, *self._unfinished) if w == way]
        self._skip_started(lambda w: w == way)
        if LAST in cut:
            counted = [k for k, (_, p) in enumerate(self._plan) if p == COUNTED]
            if counted:
                self._plan[counted[-1]] = (self._plan[counted[-1]][0], LAST)
        return HALF if HALF in cut and place != LAST else place

    def _skip_started(self, which) -> None:
        """The batches started (not yet handed off, not yet finished) of the ways ``which``
        holds true for, and of a trial: not counted."""
        for queue in (self._in_flight, self._unfinished):
            marked = [(w, SKIPPED if p is not None and which(w) else p) for w, p in queue]
            queue.clear()
            queue.extend(marked)

    def _start_trial(self, cause: str, opener: str | None = None, among=None) -> None:
        """Plan a trial of the ways ``among`` (all by default), opened by ``opener``."""
        among = self.ways if among is None else tuple(w for w in self.ways if w in among)
        order = among if self.trials % 2 == 0 else among[::-1]
        if opener is not None:  # the last trial's order reversed, ``opener`` first
            order = (opener, *(w for w in self._order[::-1] if w != opener and w in among))
        self._order, self._tried = order, among
        self._skip_started(lambda w: True)  # a trial before's batches: not counted in this
        self._plan = plan(order, self.window, self.skip)
        self._gaps = {w: [] for w in self.ways}
        self._made = {w: [] for w in self.ways}
        self._trialing = True
        self._cause = cause
        self.trials += 1

    def _measured(self) -> Trial:
        """The trial as measured so far (the way kept: the one kept before it)."""
        handed = {w: self.statistic(g) for w, g in self._gaps.items() if len(g) >= 3}
        made = {w: self.statistic(g) for w, g in self._made.items() if len(g) >= 3}
        moved = self._drift.moved_to if self._cause == "drift" else None
        trial = Trial(self._handoffs, handed, made, self.way, self._cause, moved)
        if self._cause == "close":  # each way's pace: the mean of its paces in the two
            return trial._replace(handed=averaged(self.history[-1].paces, trial.paces), made={})
        return trial

    def _told_apart(self) -> bool:
        """Whether one window each way already sets a way's pace over ``decisive`` times
        another's in this trial: more than the loop's own drift moves either (the trial
        may stop)."""
        paces = [self._pace_so_far(w) for w in self._tried if len(self._gaps[w]) >= 3]
        if self.decisive is None or len(paces) < len(self._tried):
            return False
        return max(paces) > self.decisive * min(paces)

    def _too_close(self, paces: dict) -> bool:
        """Whether a trial (not itself the second of two) found the fastest two ways
        within ``close`` of each other: nearer than one trial tells apart, so another
        decides with it."""
        if self.close is None or self._cause == "close" or len(paces) < len(self._tried):
            return False
        fastest, second = sorted(paces.values())[:2]
        return second < (1 + self.close) * fastest

    def _decide(self) -> None:
        self._plan = []
        trial = self._measured()
        paces = trial.paces
        if self._too_close(paces):  # the next trial, in the other order, decides on both
            self.history.append(trial)
            among = running(paces, self.decisive)
            self._start_trial("close", next_opener(paces, self._order[0], among), among)
            return
        tried = {w: p for w, p in paces.items() if w in self._tried}  # a close trial: of
        if tried:  # its ways (otherwise, too few batches in a row, the way kept stays)
            self.way = min(tried, key=tried.__getitem__)
        self.pace = paces.get(self.way)
        self.history.append(trial._replace(kept=self.way))
        self._trialing = False
        self._since = 0
        self._drift.clear()

    def _drifted(self) -> bool:
        now = self._drift.median() if self.trials else None
        if now is None:
            return False
        if self.pace is None:  # the trial measured nothing: this is the kept way's pace
            self.pace = now
            return False
        return self._drift.moved(self.pace, now)

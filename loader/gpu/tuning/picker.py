"""WayPicker: of several ways of making batches, the one with which the training loop takes
them soonest, found by trying each.

Which way is best depends on what trains beside the loader, and nothing the loader sees by
itself tells. The DALI stage decodes fastest on the hardware JPEG engines (34k img/s alone
on the H200), yet ResNet-50 trained beside it at 95.8-96.0% of its ceiling, against
98.1-98.3% when DALI decoded with CUDA kernels; ResNet-18 went the other way, 82.9-84.3%
against 71.9-72.1% (``benchmarks/results/gpu-h200-diagnose3-*.log``), and on the next loan
of the machine 79.6% against 89.7% (``diagnose4``). Both models had work queued on their
stream at most hand-offs either way, so the stream's state does not tell either.

So the picker measures the training loop's pace itself: the time between hand-offs. A
trial runs the ways in a counterbalanced order, ``window`` batches each, then each again
in reverse (A B B A: the two B windows are one run); the first and last ``skip`` gaps of
each run are left out (the model trained on them beside batches of another way: a batch is
started a few batches before it is handed off), the mean of the others is each way's pace
(``steady_mean``), and the faster way is kept. Every other trial starts with the other way.

Counterbalanced, because the loop's own pace can move during a trial. DDP ResNet-50 on one
H200 (``benchmarks/ddp_two_gpus.py``, one rank, 16 cores), with trials of one window each
way in a row: in all 9 runs the way tried second measured slower. Where DALI decoded (8
runs), by 2.3-5.9 ms a batch (56.3-58.0 ms against 59.8-62.4), whichever way it was;
where the workers decoded every image (``cpu_share=1``: the two ways then differ in
nothing), by 0.65 ms. Tried first, the engines were kept, and the model trained at
96.4-97.0% of its ceiling (the three runs with ``cpu_share=0``, the loop on the default
stream); tried first, CUDA was kept: 97.7% and 97.8%; CUDA alone, no trials: 97.5% and
97.7%. In A B B A order a steady drift adds as much to each way's mean; two runs kept CUDA
(its pace 2.3-2.7 ms a batch under the engines'), 97.4% and 97.7% (``gpu-h200-ddp1.json``).

Ways closer than one trial tells apart are tried again, in the other order. Beside DDP
ResNet-50 on the H200, with each way fixed (``gpu-h200-ddp4.json``), the model trained at
98.3% of its ceiling the CUDA way in both runs, at 97.5% and 96.9% the engines way: about
0.6 ms a batch apart. Yet the A B B A trials beside it measured the way that opened
the trial the faster: CUDA opened in the 5 runs whose order is known (``ddp3``, ``ddp4``,
trial causes "first" then "drift") and measured 2.6-3.2 ms a batch under the engines; the
engines opened once and measured 2.1 ms under CUDA, were kept, and the model trained at
97.6%. So where a trial finds the fastest two ways within ``close`` (10%) of each other,
the next trial starts at once in the other order (B A A B), and each way's pace is the mean
of its two: whatever favours the way that opens a trial then favours each way once, and
each pace rests on twice the gaps. (The mean of the two paces, not of the gaps pooled:
each way's longer run falls in a different trial, so pooled gaps would weigh a drift
unevenly.) With more ways (``cpu_share="auto"``: four), the second trial is opened by
whichever of the fastest two did not open the first (by the same way where neither did:
its favour then goes to a way out of the running), the rest in the first trial's order
reversed, so that the two ways in the running each open one trial. The first of the two
keeps the way kept before it (its ``Trial.kept``), the second has the cause "close". With
it, all 5 runs kept CUDA, at 98.2-98.3% (``gpu-h200-ddp5.json``): the trial opened by CUDA
measured the engines 1.9-2.6 ms a batch slower, the one opened by the engines -0.4 to +0.9
ms. Over the stalls simulated below, 98 of 100 seeded loops kept the faster way, against 91
with one trial (``tests/test_pace.py``). With four ways as close as beside ResNet-50 on the
H200 (55.0-57.7 ms a batch) and the opener 4.5% faster, two trials kept the fastest in 100
simulated loops of 100, one trial in 61; with four spread wider than 10% (as beside
ResNet-18) but the fastest two 2% apart, and the fastest not first in the default order,
100 of 100 against none. The second trial costs little: the ways are close.

The first trial starts once ``warmup`` batches have been handed off (the workers and
pipelines started); a new one when the kept way's pace moves by more than ``drift``
(another model, evaluation, the loader left alone; the median of the last ``track`` gaps,
so that one pause does not start one, and moved as each of ``track`` gaps in a row joined
them, so that a slowdown of a few batches does not either: 6 gaps at over twice the pace
start none, 4 did before; the gaps left out after a pause or an epoch's start do not count,
and the count starts again after them) and every ``recheck`` batches (by default 16
times a whole trial's batches: 4,096 with two ways, 8,192 with four, so that rechecks take
the same share of the batches however many ways there are). The ``skip`` gaps
after a pause of the loop's own (a gap over ``PAUSE`` times the median of the last ones)
and after an epoch began (``epoch_started``) are left out of everything: the batches made
meanwhile come out at once. Counted, five such gaps out of eight halve the median and start
a trial (``tests/test_pace.py``). With the loader alone on the H200 (9 ms a batch the
engines way, 24 the CUDA way), 2 of 5 imfeed-bench runs timed passes at 17-18k img/s
instead of 27k; in the one whose figures came back, a second trial (128 batches the CUDA
way) ran from the first timed pass, an epoch's start, to the third (``gpu-h200-picker16``).
What started it was not recorded then; ``Trial.cause`` now is (``dl.stats()``), and for
a drift, the pace kept and the median it moved to (``Trial.moved``).

A trial stops halfway, once each way has had one window, where one way's pace is over
``decisive`` (1.25) times another's. No drift of the loop's seen so far comes near that
(2.3-5.9 ms a batch on 56-62 under DDP, 4-10%), and the rest of the trial would cost the
most there:
with the loader alone on the H200, the CUDA way's 128 batches of a whole trial took 24 ms
each against the engines' 9, 1.9 s more; stopped halfway, it spends 64 of them (and the
few already started). Sooner still: a way whose first ``probe`` (16) counted gaps already
put it over ``decisive`` times a way measured before it in the trial has its run
cut there (its batches started meanwhile are not counted), and where the cut run held the
end of the last way's first window, the trial decides at once if it tells the ways apart.
The CUDA way then spends 26 batches (10 left out, 16 counted). Beside ResNet-50 (ways
within 5%, stalls now and then) no run is cut: in 100 seeded loops, the same batches each
way as without cutting (``tests/test_pace.py``).

A trial too close to call is followed by one among the ways still in the running only:
the fastest two and any other within ``decisive`` of the fastest; the way kept is one of
those (a way left out keeps its pace of the first trial on record only: the loop may have
changed since). The batches of a trial still in flight as the next begins are not counted
in it. With ``cpu_share="auto"`` and the loader alone on the
H200 (``gpu-h200-suite``: engines 10.7 ms a batch, engines+cpu 9.9, the CUDA ways 24-25),
every trial found the engines ways within 10% and the CUDA ways 2.3 times slower; the
second trial ran all four ways again, and a drift trial with its second took 2 of 3 timed
passes to 13.9k img/s from 25k. Now the second tries only the engines ways; in the
simulation of those paces, the CUDA ways take 60 of the first 1,500 batches instead of 260,
and the 1,500 take 15.9 s instead of 18.8 (``tests/test_pace.py``).

The mean, not the median: beside ResNet-50 on the H200 the engines' steps took 55 ms at
the median, as the CUDA way's, but 97-109 ms at the 90th percentile (the loop waiting for
a batch now and then), and the model trained at 94.9% of its ceiling against 97.8%
(``gpu-h200-diagnose7-resnet50.log``); trials by median kept the engines in 3 of 5 runs.
What a stall costs is in the mean; a pause of the loop's own (an epoch's start, a
checkpoint, an evaluation) is not the loader's doing, so gaps over ``PAUSE`` times the
median are left out. The stalls are rare (one step in ten), so the windows are long: 44
gaps counted a run, 88 each way. With 12, many windows hold no stall, and the stalling way
looks the faster: trials by mean kept CUDA in 4 of 5 runs with windows of 64, 1 of 2 with
windows of 32 (``diagnose7``, ``diagnose8``, one run each way then); in a simulation of
those stalls, one trial (A B B A) kept the faster way in 91 seeded runs of 100 with windows
of 64, in 35 with windows of 24, and by medians in none (``tests/test_pace.py``; 98 with the
second trial above).

The batches made ahead hide a way slower than the model for a while: beside ResNet-50 on
the H200 (12 DALI threads), the engines' window handed batches off as fast as the CUDA
way's (55.7 ms against 56.0), yet kept, the engines fed the model at 94.3% of its ceiling;
the run that kept the CUDA way (8 threads) reached 97.6%
(``gpu-h200-diagnose5-resnet50.log``): the batches ready in the queue lasted past the
window. So the gaps between batches finished (``finished``: the loader's own
pace, the model's work beside it included) are measured the same way, and a way's pace is
the slower of the two: what the loop settles to once the queue has run dry or filled up.

The ways of the batches started and not yet finished, and not yet handed off, are
remembered in order (batches are finished and handed off in the order they were started),
so each gap is counted for the way of its batch, whatever the lag between starting a
batch and finishing or handing it off. (The GPU stage asks for a batch's way as it plans
it, some batches ahead of its decode: with ``cpu_share="auto"`` each way is tried with
the workers' share and without, and the workers decode the share as the batch is
gathered.)
"""

from __future__ import annotations

import collections
import statistics
import threading
from collections.abc import Sequence
from itertools import groupby
from typing import NamedTuple

PAUSE = 10  # a gap this many times a window's median is the loop's pause, not a stall
_RECHECK = 16  # whole trials' batches between two trials, by default
# Where a batch stands in a trial (None: started between trials).
_SKIPPED, _COUNTED, _LAST = 0, 1, 2  # _LAST: the trial's last counted gap; it then decides
_HALF = 3  # counted, the end of the first window of the last way: each way has had one


def steady_mean(gaps: Sequence[float]) -> float:
    """The mean of ``gaps`` without those over ``PAUSE`` times their median."""
    limit = PAUSE * statistics.median(gaps)
    return statistics.fmean(g for g in gaps if g <= limit)


class Trial(NamedTuple):
    """A trial's outcome: hand-offs before it ended, each way's pace by the gaps (seconds)
    between batches handed off and between batches finished, the way kept, and what
    started it ("first", "drift", "recheck"; "close": the trial after one too close to
    call, whose ``handed`` holds each way's pace over the two, the mean of its paces in
    each, and ``made`` nothing)."""

    handoffs: int
    handed: dict
    made: dict
    kept: str
    cause: str = "first"
    moved: tuple[float, float] | None = None  # "drift": the kept way's pace, and what it moved to

    @property
    def paces(self) -> dict:
        """Each way's pace: the slower of its two."""
        return {w: max(p, self.made.get(w, p)) for w, p in self.handed.items()}

    def report(self) -> dict:
        """The trial for a log or a benchmark's record, its paces in milliseconds a batch."""
        ms = {name: {w: round(p * 1e3, 2) for w, p in paces.items()}
              for name, paces in (("handed_ms", self.handed), ("made_ms", self.made))}  # fmt: skip
        moved = {"moved_ms": [round(p * 1e3, 2) for p in self.moved]} if self.moved else {}
        return {"cause": self.cause, "handoffs": self.handoffs, "kept": self.kept, **ms, **moved}


def _averaged(first: dict, second: dict) -> dict:
    """Each way's pace over two trials: the mean of the two, or the one measured."""
    return {w: (first[w] + second[w]) / 2 if w in first and w in second else
            first.get(w, second.get(w)) for w in {**first, **second}}  # fmt: skip


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
        self.window, self.skip, self.drift = window, skip, drift
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
        # (way, place: _SKIPPED, _COUNTED, _LAST); started, not yet handed off: (way, place
        # or None)
        self._in_flight: collections.deque = collections.deque()
        self._unfinished: collections.deque = collections.deque()  # the same, to finish
        self._gaps: dict[str, list[float]] = {}  # by way, between hand-offs
        self._made: dict[str, list[float]] = {}  # by way, between batches finished
        self._last_made: tuple[str, float] | None = None
        self._recent: collections.deque = collections.deque(maxlen=track)
        self._moved = 0  # hand-offs in a row with the median of the last ``track`` moved
        self._moved_to: tuple[float, float] | None = None  # the pace, the median: a drift
        self._latest: collections.deque = collections.deque(maxlen=track)  # any gap
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
                if self._note_gap(gap):  # the loop paused: what was made meanwhile follows
                    self._quiet_handed = self.skip
                    self._moved = 0
                elif self._quiet_handed:
                    self._quiet_handed -= 1
                elif way is not None and last[0] == way:
                    if place is None:
                        if not self._trialing:
                            self._recent.append(gap)
                            fresh = True
                    elif self._counted(place):
                        self._gaps[way].append(gap)
                        if len(self._gaps[way]) == self.probe and self._far_slower(way):
                            place = self._cut_run(way, place)
            if self._trialing:
                left = any(p is not None for _, p in self._in_flight)
                if place == _LAST or not (self._plan or left):
                    self._decide()  # the rest of the trial's plan would measure nothing
                elif place == _HALF and self._told_apart():
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
            self._moved = 0

    @staticmethod
    def _counted(place: int | None) -> bool:
        """Whether the gap before a batch at ``place`` is measured (in a trial, not one of
        the ``skip`` at either end of a run, beside another way's batches)."""
        return place is not None and place != _SKIPPED

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
        if _LAST in cut:
            counted = [k for k, (_, p) in enumerate(self._plan) if p == _COUNTED]
            if counted:
                self._plan[counted[-1]] = (self._plan[counted[-1]][0], _LAST)
        return _HALF if _HALF in cut and place != _LAST else place

    def _skip_started(self, which) -> None:
        """The batches started (not yet handed off, not yet finished) of the ways ``which``
        holds true for, and of a trial: not counted."""
        for queue in (self._in_flight, self._unfinished):
            marked = [(w, _SKIPPED if p is not None and which(w) else p) for w, p in queue]
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
        # A B ... B A, a window each; the same way twice in a row is one run.
        runs = [(way, len(list(same)) * self.window) for way, same in groupby(order + order[::-1])]
        self._plan = [
            (way, _COUNTED if self.skip <= k < length - self.skip else _SKIPPED)
            for way, length in runs
            for k in range(length)
        ]
        last = max(k for k, (_, place) in enumerate(self._plan) if place == _COUNTED)
        self._plan[last] = (self._plan[last][0], _LAST)
        half = len(order) * self.window - 1  # in the last way's run: counted
        self._plan[half] = (self._plan[half][0], _HALF)
        self._gaps = {w: [] for w in self.ways}
        self._made = {w: [] for w in self.ways}
        self._trialing = True
        self._cause = cause
        self.trials += 1

    def _measured(self) -> Trial:
        """The trial as measured so far (the way kept: the one kept before it)."""
        handed = {w: self.statistic(g) for w, g in self._gaps.items() if len(g) >= 3}
        made = {w: self.statistic(g) for w, g in self._made.items() if len(g) >= 3}
        moved = self._moved_to if self._cause == "drift" else None
        trial = Trial(self._handoffs, handed, made, self.way, self._cause, moved)
        if self._cause == "close":  # each way's pace: the mean of its paces in the two
            return trial._replace(handed=_averaged(self.history[-1].paces, trial.paces), made={})
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

    def _next_opener(self, paces: dict) -> str:
        """The way to open the second of two trials: of the fastest two, the one that did
        not open the first (each of them then opens one); the same opener where it was
        neither and is still in the running (its favour then goes to a way out of the
        two), the slower of the two where it is out of the second trial."""
        contenders = sorted(paces, key=paces.__getitem__)[:2]
        opener = self._order[0]
        if opener in self._running(paces) and opener not in contenders:
            return opener
        if opener not in contenders:  # out of the next trial: the slower of the two opens
            return contenders[1]
        return next(w for w in contenders if w != opener)

    def _running(self, paces: dict) -> tuple[str, ...]:
        """The ways still in the running after a trial too close to call: the fastest two,
        and any other within ``decisive`` of the fastest (every way where ``decisive`` is
        None)."""
        fastest, second = sorted(paces.values())[:2]
        limit = max(second, fastest * (self.decisive or float("inf")))
        return tuple(w for w in paces if paces[w] <= limit)

    def _decide(self) -> None:
        self._plan = []
        trial = self._measured()
        paces = trial.paces
        if self._too_close(paces):  # the next trial, in the other order, decides on both
            self.history.append(trial)
            self._start_trial("close", self._next_opener(paces), self._running(paces))
            return
        tried = {w: p for w, p in paces.items() if w in self._tried}  # a close trial: of
        if tried:  # its ways (otherwise, too few batches in a row, the way kept stays)
            self.way = min(tried, key=tried.__getitem__)
        self.pace = paces.get(self.way)
        self.history.append(trial._replace(kept=self.way))
        self._trialing = False
        self._since = 0
        self._recent.clear()
        self._moved = 0

    def _note_gap(self, gap: float) -> bool:
        """Note a gap between hand-offs, whatever its way; whether it is a pause of the
        loop's own: over ``PAUSE`` times the median of the last ones (a pace that lasts
        soon makes that median)."""
        paused = bool(self._latest) and gap > PAUSE * statistics.median(self._latest)
        self._latest.append(gap)
        return paused

    def _drifted(self) -> bool:
        if not self.trials or len(self._recent) < self._recent.maxlen:
            return False
        now = statistics.median(self._recent)
        if self.pace is None:  # the trial measured nothing: this is the kept way's pace
            self.pace = now
            return False
        moved = abs(now - self.pace) > self.drift * self.pace
        self._moved = self._moved + 1 if moved else 0
        if self._moved < self._recent.maxlen:
            return False
        self._moved_to = (self.pace, now)
        return True

"""A WayPicker trial's parts: its plan, the statistic of a pace, the ways of a second, its outcome.

A trial runs the ways in a counterbalanced order, ``window`` batches each and then each
again in reverse (A B B A: the two B windows are one run), so that a steady drift of the
training loop's own pace adds as much to each way's mean. Each batch of the plan has a
place: left out (the first and last ``skip`` of a run, trained beside another way's
batches), counted, the end of each way's first window (the trial may stop there), or the
last counted (the trial then decides).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from itertools import groupby
from typing import NamedTuple

PAUSE = 10  # a gap this many times a window's median is the loop's pause, not a stall
# Where a batch stands in a trial (None: started between trials).
SKIPPED, COUNTED, LAST = 0, 1, 2  # LAST: the trial's last counted gap; it then decides
HALF = 3  # counted, the end of the first window of the last way: each way has had one


def steady_mean(gaps: Sequence[float]) -> float:
    """The mean of ``gaps`` without those over ``PAUSE`` times their median: what a stall
    costs is in the mean, while a pause of the loop's own is not the loader's doing."""
    limit = PAUSE * statistics.median(gaps)
    return statistics.fmean(g for g in gaps if g <= limit)


def plan(order: Sequence[str], window: int, skip: int) -> list[tuple[str, int]]:
    """The batches of a trial of the ways in ``order``, as (way, place): A B ... B A, a
    window each, the same way twice in a row one run."""
    order = tuple(order)
    runs = [(way, len(list(same)) * window) for way, same in groupby(order + order[::-1])]
    batches = [
        (way, COUNTED if skip <= k < length - skip else SKIPPED)
        for way, length in runs
        for k in range(length)
    ]
    last = max(k for k, (_, place) in enumerate(batches) if place == COUNTED)
    batches[last] = (batches[last][0], LAST)
    half = len(order) * window - 1  # in the last way's run: counted
    batches[half] = (batches[half][0], HALF)
    return batches


def averaged(first: dict, second: dict) -> dict:
    """Each way's pace over two trials: the mean of the two, or the one measured."""
    return {w: (first[w] + second[w]) / 2 if w in first and w in second else
            first.get(w, second.get(w)) for w in {**first, **second}}  # fmt: skip


def running(paces: dict, decisive: float | None) -> tuple[str, ...]:
    """The ways still in the running after a trial too close to call: the fastest two,
    and any other within ``decisive`` of the fastest (every way where it is None)."""
    fastest, second = sorted(paces.values())[:2]
    limit = max(second, fastest * (decisive or float("inf")))
    return tuple(w for w in paces if paces[w] <= limit)


def next_opener(paces: dict, opener: str, among: tuple[str, ...]) -> str:
    """The way to open the second of two trials, the first opened by ``opener``: of the
    fastest two, the one that did not open the first (each of them then opens one); the
    same opener where it was neither and is still ``among`` those in the running (its
    favour then goes to a way out of the two), else the slower of the two."""
    contenders = sorted(paces, key=paces.__getitem__)[:2]
    if opener in among and opener not in contenders:
        return opener
    if opener not in contenders:  # out of the next trial: the slower of the two opens
        return contenders[1]
    return next(w for w in contenders if w != opener)


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

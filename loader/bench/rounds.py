"""The rounds of a run: the warm-up, then the timed passes, every pipeline alone in each.

The order rotates from round to round, so that a change of machine speed during the run
touches all pipelines alike. A run stopped midway (Ctrl-C, or SIGTERM as ``cli`` turns it)
keeps the rounds it finished and drops the one under way, with that round's failures: a
pipeline's process that the stop's signal killed is the stop's doing, not the pipeline's.
"""

from __future__ import annotations

from loader.bench import busy
from loader.bench.runner import PASS_TIMEOUT


def rounds(servers: dict, passes: int, say) -> tuple[dict, dict, int]:
    """Round 0 (warm-up) then ``passes`` timed rounds: ({name: [answer of each round]},
    {name: why it failed}, the timed rounds done, which is ``passes`` unless stopped)."""
    runs = {name: [] for name in servers}
    failed, before, done = {}, {}, 0
    try:
        for r in range(passes + 1):
            _round(servers, r, passes, runs, failed, say)
            done, before = r, dict(failed)
    except KeyboardInterrupt:
        failed = before
        runs = {name: answers[: done + 1] for name, answers in runs.items()}
        say(f"  stopped: {done} of {passes} timed passes done")
    return runs, failed, done


def _round(servers: dict, r: int, passes: int, runs: dict, failed: dict, say) -> None:
    """Round ``r``: each pipeline not failed yet, alone, starting from the ``r``-th; its
    answer appended to ``runs``, or its failure to ``failed``."""
    names = [n for n in servers if n not in failed]
    k = r % len(names) if names else 0
    for name in names[k:] + names[:k]:
        answer = servers[name].ask(("pass",) if r else ("warm-up",), PASS_TIMEOUT)
        if "error" in answer:
            failed[name] = f"failed in pass {r}: {answer['error']}"
            say(f"  {name}: {failed[name]}")
            continue
        runs[name].append(answer)
        rate = answer["images"] / answer["seconds"]
        cores = answer["cpu_seconds"] / answer["seconds"]
        tag = "warm-up" if r == 0 else f"pass {r}/{passes}"
        start = f", first batch in {answer['first_batch_seconds']:.1f} s" if r == 0 else ""
        say(f"  {tag:>10} {name:<14} {rate:9.1f} img/s  {cores:5.2f} cores busy{start}"
            + _others(answer))  # fmt: skip


def _others(answer: dict) -> str:
    """A note for a pass's line where other processes were busy beside it."""
    other = answer.get("other_cpu_seconds")
    if other is None or other / answer["seconds"] <= busy.THRESHOLD:
        return ""
    return f"  (the machine was busy: others took {other / answer['seconds']:.2f} cores)"

"""Whether the machine was quiet while a pipeline was timed: the CPU time every other process
took during the pass, that is the whole machine's busy time (/proc/stat) less the
pipeline's own process tree's, with the time a hypervisor gave to other virtual machines
(a cloud machine's neighbours take its cores that way, unseen by its processes). Figures
measured beside either say more about them than about the pipeline, so the run warns
where it saw one.
"""

from __future__ import annotations

import os

THRESHOLD = 0.25  # cores kept busy by other processes over a pass, on average
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds(stat: str) -> float | None:
    """CPU seconds all cores spent busy (user, nice, system, irq, softirq) or stolen by a
    hypervisor (steal) since boot, from the text of /proc/stat; None where it has no "cpu"
    line. Idle and I/O wait are left out: neither is someone else at work."""
    for line in stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[1:8])
            steal = int(fields[8]) if len(fields) > 8 else 0  # Linux 2.6.11 on
            return (user + nice + system + irq + softirq + steal) / _TICK
    return None


def machine_busy_seconds() -> float | None:
    """``busy_seconds`` of this machine now (None off Linux)."""
    try:
        with open("/proc/stat") as f:
            return busy_seconds(f.read())
    except OSError:
        return None


def others(before: float | None, after: float | None, own: float) -> float | None:
    """CPU seconds of the other processes (and of other virtual machines: steal) between
    two ``machine_busy_seconds``, given the pipeline's ``own`` over the same time (never
    below 0: the two clocks tick apart)."""
    if before is None or after is None:
        return None
    return round(max(0.0, after - before - own), 3)


def other_cores(timed: list[dict]) -> float | None:
    """The most cores other processes kept busy in any of a pipeline's timed passes."""
    seen = [p["other_cpu_seconds"] / p["seconds"] for p in timed
            if p.get("other_cpu_seconds") is not None]  # fmt: skip
    return round(max(seen), 2) if seen else None


def busy(results: dict, threshold: float = THRESHOLD) -> dict:
    """``{pipeline: cores}`` where other processes kept over ``threshold`` cores busy."""
    return {
        name: r["other_cores_busy"]
        for name, r in results.items()
        if r.get("status") == "ok" and (r.get("other_cores_busy") or 0.0) > threshold
    }


def warning(seen: dict, threshold: float = THRESHOLD) -> str | None:
    """A line for the table where ``seen`` (``busy``'s answer) is not empty, else None."""
    if not seen:
        return None
    worst = ", ".join(f"{n} ({c:.2f})" for n, c in sorted(seen.items(), key=lambda x: -x[1]))
    return (
        f"Warning: the machine was busy: other processes (or a hypervisor's other machines) "
        f"kept more than {threshold:.2f} cores "
        f"busy during the timed passes of {worst}; absolute figures mean little, run it "
        "again on a quiet machine"
    )

"""LoaderStats: where a loader's time goes, per stage, so a user can see what limits them.

Stages add seconds and sample counts as batches pass; GPU stages hand in pairs of CUDA
events, resolved into milliseconds only when someone asks (never a synchronisation on the
hot path). ``snapshot()`` is what ``DataLoader.stats()`` returns.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class LoaderStats:
    """Thread-safe counters of one loader (the prefetch thread and the training loop add)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, float] = defaultdict(float)
        self._events: list[tuple[str, object, object]] = []  # (stage, start, end) pending

    def add(self, **amounts: float) -> None:
        """Add to named totals, e.g. ``add(batches=1, wait_s=0.002)``."""
        with self._lock:
            for name, value in amounts.items():
                self._totals[name] += value

    def total(self, name: str) -> float:
        """One named total so far, as ``add`` left it: unlike ``snapshot``, this never
        waits for the device."""
        with self._lock:
            return self._totals.get(name, 0.0)

    def add_gpu_time(self, stage: str, start, end) -> None:
        """Count the GPU time between two recorded CUDA events under ``stage + "_s"``."""
        with self._lock:
            self._events.append((stage, start, end))
            if len(self._events) > 64:  # resolve old ones so the list stays short
                self._resolve(wait=False)

    def _resolve(self, wait: bool) -> None:
        pending = []
        for stage, start, end in self._events:
            if wait or end.query():
                end.synchronize()
                self._totals[stage + "_s"] += start.elapsed_time(end) / 1000.0
            else:
                pending.append((stage, start, end))
        self._events = pending

    def snapshot(self) -> dict:
        """Totals so far (seconds, counts), plus derived shares; see ``DataLoader.stats``."""
        with self._lock:
            self._resolve(wait=True)
            out = dict(self._totals)
        samples = out.get("samples", 0.0)
        for name in list(out):
            if name.endswith("_s") and samples:
                out[name[:-2] + "_us_per_sample"] = 1e6 * out[name] / samples
        on_gpu = out.get("gpu_decoded", 0.0) + out.get("gpu_cropped", 0.0)
        if on_gpu + out.get("cpu_decoded", 0.0):
            out["gpu_share"] = on_gpu / (on_gpu + out.get("cpu_decoded", 0.0))
        return out

    def reset(self) -> None:
        with self._lock:
            self._totals.clear()
            self._events = []

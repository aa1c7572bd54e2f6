"""What a copy costs a loader thread beside a busy Python thread (the training loop).

numpy and torch let the GIL go around a large copy; a thread that lets it go must then get
it back from a thread running Python, which drops it only when asked, after a switch
interval (5 ms). This times, per call, the copies the GPU path's threads make each batch
(the workers' rows of a 10% CPU share at batch 256; the augmentation kernels' row table)
and the torch calls a thread could make per image (a batch of DALI's windows as views),
alone and beside a thread running a pure Python loop, done by numpy, torch and the
loader's own ``gather`` / ``copy_holding_gil`` (memoryview copies, which keep the GIL).
Prints a table and writes JSON with the machine.

    python3 benchmarks/gil_copies.py [--calls 40] [--out gil-copies.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np
import torch

from loader.gpu.augment import Rows, copy_holding_gil, gather
from loader.gpu.dali_decode import hwc_views

SIZE = 224


def _echo(conn) -> None:
    while (message := conn.recv()) is not None:
        conn.send(message)


def round_trip():
    """A message to a worker process and its answer (what each worker task costs the
    loader's thread: a send and a receive, each a system call that lets the GIL go)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    ctx.Process(target=_echo, args=(there,), daemon=True).start()

    def call() -> None:
        here.send((0, 1, 2))
        here.recv()

    return call


def cases() -> dict:
    """name -> a copy to time (each writes the same bytes every call)."""
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (256, SIZE, SIZE, 3), dtype=np.uint8)  # a ring slot
    rows = np.sort(rng.choice(256, 26, replace=False))  # 10% of a batch of 256
    target = np.empty((len(rows), SIZE, SIZE, 3), dtype=np.uint8)
    table, into = np.ones(76_800, np.int32), np.empty(76_800, np.int32)  # ~300 window rows
    src, idx, out = (torch.from_numpy(a) for a in (pixels, rows.astype(np.int64), target))
    shapes = [(int(h), int(w), 3) for h, w in rng.integers(50, SIZE, (256, 2))]  # windows
    windows = np.array([s[:2] for s in shapes])
    sizes = [h * w * 3 for h, w, _ in shapes]
    decoded = torch.zeros(sum(sizes), dtype=torch.uint8)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()

    def one_call_views():
        return hwc_views(decoded, shapes, sizes, windows)

    def per_image_views():
        return [
            decoded[o : o + size].view(h, w, 3).permute(2, 0, 1)
            for o, size, (h, w, _) in zip(offsets, sizes, shapes, strict=True)
        ]

    pieces = [torch.zeros(5000, dtype=torch.uint8) for _ in range(256)]
    slot = torch.zeros(256 * 50_000, dtype=torch.uint8)  # a batch's JPEG bytes
    spans = [(k * 50_000, 42_000) for k in range(256)]
    return {
        "a worker task's message and answer (pipes)": round_trip(),
        "256 JPEGs cut out of a slot, torch slices": lambda: [slot[s : s + m] for s, m in spans],
        "256 images' views, view + permute each": per_image_views,
        "256 images' views, hwc_views (one call)": one_call_views,
        "256 .numpy() calls": lambda: [t.numpy() for t in pieces],
        "26 rows, np.take": lambda: np.take(pixels, rows, axis=0, out=target),
        "26 rows, torch.index_select": lambda: torch.index_select(src, 0, idx, out=out),
        "26 rows, loader gather": lambda: gather(Rows(pixels, rows), target),
        "row table 300 KB, numpy": lambda: into.__setitem__(Ellipsis, table),
        "row table 300 KB, copy_holding_gil": lambda: copy_holding_gil(into, table),
    }


@contextlib.contextmanager
def busy_python_thread():
    """A thread running a pure Python loop meanwhile, as a training loop holds the GIL:
    other threads wait for it each time they let it go."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin, name="busy-python", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def per_call_ms(fn, calls: int) -> float:
    """Mean milliseconds of one call (the mean, not the median: the waits for the GIL
    come now and then, and they are what adds up)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--out", default="gil-copies.json")
    a = ap.parse_args()
    torch.set_num_threads(1)
    calls = cases()
    results = {name: {} for name in calls}
    for setting, around in (
        ("alone", contextlib.nullcontext),
        ("beside a busy Python thread", busy_python_thread),
    ):
        with around():
            for name, fn in calls.items():
                results[name][setting] = round(per_call_ms(fn, a.calls), 3)
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "torch": torch.__version__,
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
    }
    print(f"{'call':44s} {'alone ms':>10s} {'beside a busy thread ms':>24s}")
    for name, r in results.items():
        print(f"{name:44s} {r['alone']:10.3f} {r['beside a busy Python thread']:24.3f}")
    print(machine)
    report = {"machine": machine, "mean_ms_per_call": results}
    Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

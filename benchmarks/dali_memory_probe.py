"""The DALI stage over many epochs of the GPU tests' small store: the device memory used
after each epoch, and when nvImageCodec's lines reach stderr.

Usage (GPU machine, wheels installed as in ../shared/GPU.md):
    python3 benchmarks/dali_memory_probe.py [--epochs 150] [--release]

``--release`` calls DALI's ``ReleaseUnusedMemory`` after each epoch before measuring, so
that what is left is what is held (a batch kept per epoch would still add up), not what
DALI's pools keep cached for reuse. Every line that reaches fd 2 is printed with its
time, beside the times the stage built, fed and read its pipelines: a line outside those
calls escaped the stage's filter.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from gpu_path_data import make_small_store
from test_gpu_dali import TRAIN

import loader
import loader.gpu.dali_stage as ds

T0 = time.monotonic()
EVENTS: list[tuple[float, str]] = []


def stamp(what: str) -> None:
    EVENTS.append((round(time.monotonic() - T0, 4), what))


def watch_stderr() -> None:
    """fd 2 becomes a pipe whose lines are stamped as they come."""
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def reader() -> None:
        with os.fdopen(read, "rb") as f:
            for line in f:
                text = line.decode("utf-8", "replace").rstrip()[:120]
                stamp("STDERR " + text)
                print("stderr:", text, flush=True)  # also as it comes, should the probe fail

    threading.Thread(target=reader, daemon=True).start()


def traced(cls, name: str) -> None:
    original = getattr(cls, name)

    def call(*args, **kwargs):
        stamp(f"enter {name}")
        try:
            return original(*args, **kwargs)
        finally:
            stamp(f"leave {name}")

    setattr(cls, name, call)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=150)
    ap.add_argument("--release", action="store_true")
    args = ap.parse_args()
    watch_stderr()
    for name in ("_built", "_feed", "_next_output"):
        traced(ds.DaliStage, name)
    store = make_small_store(Path(tempfile.mkdtemp()))
    dl = loader.DataLoader(store, batch_size=4, transform=TRAIN, device="cuda", decoder="dali",
                           with_indices=True, num_workers=2, shuffle=True, seed=5,
                           dtype=torch.float16)  # fmt: skip
    used = []
    for e in range(args.epochs):
        for _batch in dl:
            pass
        if e == 0:
            stamp("first epoch done")
        torch.cuda.synchronize()
        if args.release:
            from nvidia.dali.backend import ReleaseUnusedMemory

            ReleaseUnusedMemory()
        free, total = torch.cuda.mem_get_info()
        used.append(round((total - free) / (1 << 20), 1))
    way = dl.stats().get("way")
    dl.close()
    time.sleep(0.5)
    lines = [f"{t:9.4f} {w}" for t, w in EVENTS]
    near = sorted({j for i, x in enumerate(lines) if "STDERR" in x for j in range(i - 3, i + 4)})
    print("stderr lines with the stage's calls around them:")
    print(*(lines[j] for j in near if 0 <= j < len(lines)), sep="\n")
    changes = [(i, u) for i, u in enumerate(used) if i == 0 or u != used[i - 1]]
    print(f"release={args.release} epochs={args.epochs} used MiB at changes: {changes}")
    print(f"way kept: {way}")


if __name__ == "__main__":
    main()

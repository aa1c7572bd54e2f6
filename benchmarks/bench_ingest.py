"""Converter throughput against its two floors, side by side in one run.

1. a verified ``ingest build`` against plain ``cv2.imdecode`` of the same files in one
   process per core: the goal is at least 0.9x;
2. ``ingest build --no-verify`` against concatenating the same files into one file (the
   byte-copy floor): at least 0.5x.

On JPEGs of ImageNet's mean size (~110 KB), made once on all cores and reused. Each figure
is the best of ``--repeat`` rounds; a round times the four one after another, so that
all four see the same machine.

    python3 benchmarks/bench_ingest.py [--images 20000] [--workers N] [--shard-size 64MiB]

Runs with numpy, opencv, lmdb, msgpack, simplejpeg (and the converter's own needs):
never imports torch.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import shutil
import sys
import time
from pathlib import Path

# This checkout first (not an installed copy), then the shared benchmark helpers.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import cv2
import numpy as np
from common import REPO, cpu_machine, image_files, make_imagenet_sized, warm, write_result

from ingest.build import BuildOptions, build
from ingest.cores import usable_cores

GOALS = {"verified_vs_imdecode": 0.9, "no_verify_vs_concat": 0.5}


def concat(paths: list[Path], dst: Path) -> None:
    with open(dst, "wb") as out:
        for p in paths:
            with open(p, "rb") as f:
                out.write(f.read())
        out.flush()
        os.fsync(out.fileno())


def _decode(path: Path) -> int:
    with open(path, "rb") as f:
        img = cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_COLOR)
    return img.shape[0]


def imdecode_all(paths: list[Path], workers: int) -> None:
    cv2.setNumThreads(1)
    with mp.get_context("fork").Pool(workers) as pool:
        for _ in pool.imap(_decode, paths, chunksize=8):
            pass


def timed(fn, *args, repeat: int = 3, setup=None) -> float:
    """Best of ``repeat`` wall-clock runs, in seconds (``setup`` runs untimed before each)."""
    best = float("inf")
    for _ in range(repeat):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _size(text: str) -> int:
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(text[: -len(unit)]) * size
    return int(text)


def _args() -> argparse.Namespace:
    cores = usable_cores()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--workers", type=int, default=cores, help="of the builds (default: all cores)")
    ap.add_argument(
        "--shard-size", default="64MiB",
        help="of the builds (default 64MiB: 20,000 images make 33 shards; a real dataset "
        "makes hundreds at the converter's 512MiB, e.g. ImageNet 270)",
    )  # fmt: skip
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "ingest")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results",
                    help="folder of the JSON result")  # fmt: skip
    return ap.parse_args()


def _rounds(args, src: Path, paths: list[Path]) -> dict[str, float]:
    """Best seconds of each of the four, over ``args.repeat`` rounds."""
    out = args.workdir / "out.lmdb"
    shard_size = _size(args.shard_size)

    def builder(verify: bool):
        options = BuildOptions(shard_size=shard_size, verify=verify)
        return functools.partial(build, src, out, options, workers=args.workers, progress=False)

    cores = usable_cores()
    clean = functools.partial(shutil.rmtree, out, ignore_errors=True)
    runs = {
        "concat (byte-copy floor)": (functools.partial(concat, paths, args.workdir / "cat"), None),
        "ingest build --no-verify": (builder(False), clean),
        f"cv2.imdecode, {cores} processes": (functools.partial(imdecode_all, paths, cores), None),
        "ingest build (verified)": (builder(True), clean),
    }
    best = {name: float("inf") for name in runs}
    for _ in range(args.repeat):
        for name, (fn, setup) in runs.items():
            best[name] = min(best[name], timed(fn, repeat=1, setup=setup))
    clean()
    (args.workdir / "cat").unlink(missing_ok=True)
    return best


def main() -> None:
    args = _args()
    cores = usable_cores()
    t0 = time.perf_counter()
    src = make_imagenet_sized(args.workdir, args.images, cores)
    paths = image_files(src)
    total, n = warm(paths), len(paths)
    made = time.perf_counter() - t0
    t = _rounds(args, src, paths)
    names = list(t)
    ratios = {
        "verified_vs_imdecode": t[names[2]] / t[names[3]],
        "no_verify_vs_concat": t[names[0]] / t[names[1]],
    }
    print(f"{n} JPEGs, {total / n / 1e3:.1f} KB mean (made or found, and read, in {made:.0f} s); "
          f"{cores} cores, builds with --workers {args.workers} --shard-size {args.shard_size}; "
          f"best of {args.repeat}")  # fmt: skip
    for name, secs in t.items():
        print(f"  {name:<32} {n / secs:>9.0f} img/s  {total / secs / 1e6:>8.1f} MB/s")
    for key, ratio in ratios.items():
        verdict = "met" if ratio >= GOALS[key] else "NOT met"
        print(f"  {key:<32} {ratio:>9.2f}  (goal >= {GOALS[key]}: {verdict})")
    result = {
        "benchmark": "ingest", "images": n, "mean_bytes": total / n, "workers": args.workers,
        "shard_size": args.shard_size, "repeat": args.repeat,
        "img_per_s": {name: n / secs for name, secs in t.items()},
        "ratios": ratios, "goals": GOALS, "machine": cpu_machine(),
        "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    write_result(args.out, f"ingest-{cores}cpu.json", result)


if __name__ == "__main__":
    main()

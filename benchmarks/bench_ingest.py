"""Converter throughput against its two floors, side by side in one run.

1. ``ingest build --no-verify`` against concatenating the same files into one file
   (the byte-copy floor): the issue asks for at least 0.5x.
2. a verified ``ingest build`` against plain ``cv2.imdecode`` of the same files over all
   cores: at least 0.8x.

    python3 benchmarks/bench_ingest.py [--images 3000] [--workdir bench-data/ingest]
"""

from __future__ import annotations

import argparse
import functools
import json
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
from common import REPO, image_files, machine, make_dataset, warm

from ingest.build import BuildOptions, build


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


def run_build(src: Path, out: Path, verify: bool, workers: int) -> None:
    build(src, out, BuildOptions(verify=verify), workers=workers, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "ingest")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    workers = os.cpu_count() or 1
    per_class = max(1, args.images // 10)
    src = make_dataset(args.workdir, 10, per_class)
    paths = [p for p in image_files(src)]
    total = warm(paths)
    n = len(paths)
    out = args.workdir / "out.lmdb"
    t_cat = timed(concat, paths, args.workdir / "concat.bin", repeat=args.repeat)
    clean = functools.partial(shutil.rmtree, out, ignore_errors=True)
    t_pack = timed(run_build, src, out, False, workers, repeat=args.repeat, setup=clean)
    t_dec = timed(imdecode_all, paths, workers, repeat=args.repeat)
    t_build = timed(run_build, src, out, True, workers, repeat=args.repeat, setup=clean)
    rows = {
        "concat (byte-copy floor)": t_cat,
        "ingest build --no-verify": t_pack,
        f"cv2.imdecode, {workers} processes": t_dec,
        "ingest build (verified)": t_build,
    }
    print(f"{n} JPEGs, {total / n / 1e3:.1f} KB mean, {workers} cores, best of {args.repeat}")
    for name, t in rows.items():
        print(f"  {name:<32} {n / t:>9.0f} img/s  {total / t / 1e6:>8.1f} MB/s")
    pack_ratio, verify_ratio = t_cat / t_pack, t_dec / t_build
    print(f"no-verify pack / concat     = {pack_ratio:.2f}  (goal >= 0.5)")
    print(f"verified build / imdecode   = {verify_ratio:.2f}  (goal >= 0.8)")
    result = {
        "benchmark": "ingest",
        "images": n,
        "mean_bytes": total / n,
        "img_per_s": {name: n / t for name, t in rows.items()},
        "ratios": {"pack_vs_concat": pack_ratio, "verified_vs_imdecode": verify_ratio},
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
    }
    dst = REPO / "benchmarks" / "results" / f"ingest-{os.cpu_count()}cpu.json"
    dst.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {dst.relative_to(REPO)}")


if __name__ == "__main__":
    main()

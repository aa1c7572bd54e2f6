"""`ingest build --ray` (a local Ray instance over all cores) against the local build.

The Ray build makes two passes (ingest/build/ray.py says why): its cost per image should
be about that of a verified build plus that of a `--no-verify` one. This run measures the
three side by side, on the same images, with the page cache warm and Ray started once
(its start-up is not timed), and prints the rate the two-pass model predicts.

    python3 benchmarks/bench_ray.py [--images 2000] [--workdir bench-data/ingest]
"""

from __future__ import annotations

import argparse
import functools
import logging
import shutil
import sys
import time
from pathlib import Path

# This checkout first (not an installed copy), then the shared benchmark helpers.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from bench_ingest import timed
from common import REPO, image_files, machine, make_dataset, warm, write_result

from ingest.build import BuildOptions, build
from ingest.build.ray import build_ray, import_ray
from ingest.cores import usable_cores


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "ingest")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    ray, cpus = import_ray(), usable_cores()
    src = make_dataset(args.workdir, 10, max(1, args.images // 10))
    paths = image_files(src)
    total, n = warm(paths), len(paths)
    out = args.workdir / "ray-out.lmdb"
    clean = functools.partial(shutil.rmtree, out, ignore_errors=True)
    verified, no_verify = BuildOptions(), BuildOptions(verify=False)
    runs = {
        "ingest build (verified)": lambda: build(src, out, verified, progress=False),
        "ingest build --no-verify": lambda: build(src, out, no_verify, progress=False),
        "ingest build --ray (verified)": lambda: build_ray(src, out, verified, progress=False),
    }
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False,
             logging_level=logging.ERROR)  # fmt: skip
    try:
        rates = {name: n / timed(fn, repeat=args.repeat, setup=clean) for name, fn in runs.items()}
    finally:
        ray.shutdown()
    model = 1 / (1 / rates["ingest build (verified)"] + 1 / rates["ingest build --no-verify"])
    ratio = rates["ingest build --ray (verified)"] / model
    print(f"{n} JPEGs, {total / n / 1e3:.1f} KB mean, {cpus} cores, best of {args.repeat}")
    for name, rate in rates.items():
        print(f"  {name:<32} {rate:>9.0f} img/s")
    print(f"two-pass model: {model:.0f} img/s; --ray / model = {ratio:.2f}")
    result = {
        "benchmark": "ingest-ray", "images": n, "mean_bytes": total / n, "img_per_s": rates,
        "two_pass_model_img_per_s": model, "ray_vs_model": ratio,
        "machine": machine(), "date": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    write_result(REPO / "benchmarks" / "results", f"ingest-ray-{cpus}cpu.json", result)


if __name__ == "__main__":
    main()

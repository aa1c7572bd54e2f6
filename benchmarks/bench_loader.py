"""Loader throughput against torch's DataLoader and the CPU decode ceiling, in one run.

Same images, same augmentation (RandomResizedCrop 224 + flip + normalise), same batch size
and number of workers, page cache warm, one warm-up epoch before the timed ones:

1. torch DataLoader over torchvision ImageFolder (PIL) with the standard transforms;
2. ``loader.DataLoader(store, transform="train", device="cpu")``: the issue asks >= 2x (1);
3. bare ``cv2.imdecode`` of the same files in a process per core: (2) >= 0.7x (3).

Each pipeline runs in a process of its own and their epochs take turns (in rotating
order), so that a change in machine speed during the run touches all three alike; img/s is
the median over the timed epochs, a ratio the median of the per-round ratios. Also the
memory of each loader after every epoch (main process + workers, from /proc): resident
memory must not grow from epoch to epoch, and a worker's private memory (what an extra
worker costs beyond the shared batch buffers) must stay a few MB. Writes
benchmarks/results/loader-<cpus>cpu.json.

    python3 benchmarks/bench_loader.py [--images 2560] [--batch-size 128] [--workers N]
    (16-core GPU machine: --images 10240 --batch-size 256 --workers 16)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

# This checkout first (not an installed copy), then the shared benchmark helpers.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import cv2
import numpy as np
from common import REPO, image_files, machine, make_store, warm, write_result

from ingest.cores import usable_cores

MiB = 1 << 20


def proc_memory(pid: int) -> dict[str, float]:
    """Resident memory of ``pid`` in MiB: VmRSS and its parts, PSS and private dirty pages."""
    out: dict[str, float] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) / 1024
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            rollup = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.strip().endswith("kB")}
        out["Pss"] = rollup["Pss"] / 1024
        out["PrivateDirty"] = rollup["Private_Dirty"] / 1024  # what this process alone costs
    except (OSError, KeyError):
        pass
    return {k: round(v, 1) for k, v in out.items()}


def children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return sorted(set(pids))


def memory_snapshot() -> dict:
    """Memory of this process and its workers. ``total`` counts what the loader owns: the
    main process's anonymous and shared memory (the batch ring once) plus each worker's
    private dirty pages; file-backed pages (libraries, the store's page cache) are left out."""
    workers = [proc_memory(p) for p in children()]
    main = proc_memory(os.getpid())
    total = main["RssAnon"] + main["RssShmem"] + sum(w.get("PrivateDirty", 0) for w in workers)
    return {
        "main": main,
        "workers": workers,
        "total": round(total, 1),
        "worker_private_max": max((w.get("PrivateDirty", 0) for w in workers), default=0),
    }


def torch_loader(src: Path, args):
    import torch.utils.data
    import torchvision.datasets
    import torchvision.transforms as T

    tf = T.Compose(
        [
            T.RandomResizedCrop(224, interpolation=T.InterpolationMode(args.interpolation)),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        ]
    )
    ds = torchvision.datasets.ImageFolder(str(src), transform=tf)
    return torch.utils.data.DataLoader(
        ds,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
    )


def our_loader(store: Path, args):
    import loader

    return loader.DataLoader(
        store,
        batch_size=args.batch_size,
        shuffle=True,
        num_workers=args.workers,
        persistent_workers=True,
        transform=loader.Transform(
            "train", antialias=not args.no_antialias, interpolation=args.interpolation
        ),
        device="cpu",
    )


def _decode(path: Path) -> int:
    with open(path, "rb") as f:
        img = cv2.imdecode(np.frombuffer(f.read(), np.uint8), cv2.IMREAD_COLOR)
    return img.shape[0]


class Imdecode:
    """Bare cv2.imdecode of the files in a process per core; one pass is an "epoch"."""

    def __init__(self, paths: list[Path]) -> None:
        cv2.setNumThreads(1)
        self.paths = paths
        self.pool = mp.get_context("fork").Pool(usable_cores())

    def __iter__(self):
        for _ in self.pool.imap_unordered(_decode, self.paths, chunksize=8):
            yield (None,)  # one image


def _serve(name: str, conn, data, args) -> None:
    """In a process of its own: build pipeline ``name``, run an epoch per request, report."""
    pipeline = {"torch": torch_loader, "loader": our_loader, "imdecode": Imdecode}[name]
    it = pipeline(data, args) if name != "imdecode" else Imdecode(data)
    while conn.recv():
        t0, n = time.perf_counter(), 0
        for batch in it:
            n += len(batch[0]) if batch[0] is not None else 1
        dt = time.perf_counter() - t0
        conn.send({"images": n, "seconds": dt, "memory": memory_snapshot()})
    conn.close()


def interleaved(pipelines: dict, args) -> dict:
    """Epochs of every pipeline in turn (rotating the order), each in its own process, so
    that a drift in machine speed touches all of them alike; round 0 is the warm-up."""
    ctx = mp.get_context("fork")
    procs, conns = {}, {}
    for name, data in pipelines.items():
        here, there = ctx.Pipe()
        procs[name] = ctx.Process(target=_serve, args=(name, there, data, args))
        procs[name].start()
        conns[name] = here
    rounds = {name: [] for name in pipelines}
    names = list(pipelines)
    for r in range(args.epochs + 1):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            conns[name].send(True)
            rounds[name].append(conns[name].recv())
            e = rounds[name][-1]
            print(
                f"  round {r}{' (warm-up)' if not r else ''} {name:>9}: "
                f"{e['images'] / e['seconds']:7.1f} img/s, memory {e['memory']['total']:.0f} MiB",
                flush=True,
            )
    for name in names:
        conns[name].send(False)
        procs[name].join()
    return {name: summarise(epochs) for name, epochs in rounds.items()}


def summarise(epochs: list[dict]) -> dict:
    """img/s: the median of the timed epochs' rates (robust to a passing load spike)."""
    rates = [e["images"] / e["seconds"] for e in epochs[1:]]
    return {"img_per_s": float(np.median(rates)), "rates": rates, "epochs": epochs}


def prepare(args) -> tuple[Path, Path, list[Path]]:
    src, store = make_store(args.workdir, args.images, args.classes)
    paths = image_files(src)
    warm(paths)
    warm([p for p in store.rglob("*") if p.is_file()])
    return src, store, paths


def torchvision_version() -> str:
    import torchvision

    return torchvision.__version__


def summary(results: dict) -> dict:
    """Ratios per round (the pipelines ran one after the other, so a round's ratio sees the
    machine at about one speed), then their median; memory of our loader per epoch."""
    rates = {name: r["rates"] for name, r in results.items()}

    def ratio(a: str, b: str) -> float:
        return round(float(np.median([x / y for x, y in zip(rates[a], rates[b], strict=True)])), 2)

    memory = [e["memory"]["total"] for e in results["loader"]["epochs"]]
    return {
        "loader_vs_torch": ratio("loader", "torch"),
        "loader_vs_imdecode": ratio("loader", "imdecode"),
        "loader_memory_mib_per_epoch": memory,
        "loader_memory_growth_mib": round(memory[-1] - memory[1], 1),
        "loader_worker_private_mib": max(
            e["memory"]["worker_private_max"] for e in results["loader"]["epochs"]
        ),
        "torch_memory_mib_per_epoch": [e["memory"]["total"] for e in results["torch"]["epochs"]],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2560)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=usable_cores())
    p.add_argument("--epochs", type=int, default=4, help="timed epochs, after one warm-up")
    p.add_argument("--no-antialias", action="store_true", help="plain bilinear shrink")
    p.add_argument("--interpolation", choices=("bilinear", "bicubic"), default="bilinear",
                   help="the resize filter, of both loaders")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "loader")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args()
    src, store, paths = prepare(args)
    print(
        f"{len(paths)} images, {sum(f.stat().st_size for f in paths) / len(paths) / 1024:.0f} "
        f"KiB each; batch {args.batch_size}, {args.workers} workers",
        flush=True,
    )
    results = interleaved({"torch": src, "loader": store, "imdecode": paths}, args)
    ratios = summary(results)
    for name, r in results.items():
        print(f"{name:>9}: {r['img_per_s']:8.1f} img/s")
    print(json.dumps(ratios, indent=1))
    report = {
        "machine": {**machine(), "torchvision": torchvision_version()},
        "args": {k: str(v) for k, v in vars(args).items()},
        "images": len(paths),
        "results": results,
        "summary": ratios,
    }
    write_result(args.out, f"loader-{usable_cores()}cpu.json", report)


if __name__ == "__main__":
    main()

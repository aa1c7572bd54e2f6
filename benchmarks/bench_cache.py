"""What cache="shm" buys when the store is not in the page cache, and what it costs.

Each run is a fresh process reading two epochs of a store, the store's pages evicted from
the page cache (``posix_fadvise(POSIX_FADV_DONTNEED)`` on every shard file, after every
reader let go of it) before each epoch, so that both epochs read from the disk unless the
cache serves them. Runs with ``cache=None`` ("original") and ``cache="shm"`` alternate, in
rotating order, for ``--rounds`` rounds; the shm cache is cleared before each shm run, so
its first epoch includes the copy. Two workloads:

- ``raw``: one process reads every record (``Store.raw``) in a shuffled order: the I/O alone;
- ``loader``: ``loader.DataLoader(transform="train", device="cpu")`` with ``--workers``
  workers: the whole CPU pipeline (decode included).

The figure that matters is the second epoch with and without the cache; the first epoch
with the cache against the first without is the copy's cost. Also recorded: how much of the
store was still resident after each eviction (mincore), to show that it worked. Writes
benchmarks/results/cache-<cpus>cpu.json.

    python3 benchmarks/bench_cache.py [--images 2560] [--shard-size 32MiB] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

# This checkout first (not an installed copy), then the shared benchmark helpers.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import numpy as np
from common import REPO, machine, make_store, write_result

from ingest.cli import parse_size
from ingest.cores import usable_cores
from ingest.format import MANIFEST, read_manifest
from ingest.format import cachedir as cd

MiB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


def shard_files(store: Path) -> list[Path]:
    return [store / s["name"] / "data.mdb" for s in read_manifest(store)["shards"]]


def evict(store: Path) -> float:
    """Drop the store's shard files from the page cache; return the fraction still resident."""
    for path in shard_files(store):
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return resident(store)


def resident(store: Path) -> float:
    """Fraction of the store's shard pages in the page cache (mincore)."""
    total = present = 0
    for path in shard_files(store):
        size = path.stat().st_size
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
            head = ctypes.c_char.from_buffer(m)  # a private mapping: writable for ctypes
            rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(head)), ctypes.c_size_t(size), vec)
            del head
        if rc != 0:
            return float("nan")
        present += sum(v & 1 for v in vec)
        total += pages
    return round(present / max(total, 1), 4)


class _Reader:
    def release(self) -> None:
        if self.store.cache is not None:
            self.store.cache.release()  # a forked benchmark process skips exit handlers


class RawReader(_Reader):
    """Every record of the store (``Store.raw``) in a shuffled order, in this process."""

    def __init__(self, store: Path, cache: dict, args) -> None:
        from loader.dataset import LMDBDataset

        self.ds = LMDBDataset(store, **cache)
        self.store = self.ds.store

    def epoch(self, epoch: int) -> int:
        order = np.random.default_rng(epoch).permutation(len(self.ds)).tolist()
        n = sum(len(self.ds.store.raw(i)) for i in order)
        self.ds.store.close()  # let go of the shard maps, so that eviction can drop them
        gc.collect()
        return n

    def stats(self):
        return self.ds.cache_stats()


class LoaderReader(_Reader):
    """``loader.DataLoader(transform="train", device="cpu")`` with workers that stop after
    each epoch (so that their shard maps go with them)."""

    def __init__(self, store: Path, cache: dict, args) -> None:
        import loader

        self.dl = loader.DataLoader(store, batch_size=args.batch_size, shuffle=True,
                                    num_workers=args.workers, transform="train",
                                    device="cpu", **cache)  # fmt: skip
        self.store = self.dl.store

    def epoch(self, epoch: int) -> int:
        return sum(len(batch[1]) for batch in self.dl)

    def stats(self):
        return self.dl.cache_stats()


def run(conn, store: Path, mode: str, workload: str, args) -> None:
    """In a fresh process: clear the cache (shm), then two epochs, each after an eviction."""
    ident = cd.store_id((store / MANIFEST).read_bytes())
    cd.clear(args.cache_root, ident, force=True)
    cache = {"cache": "shm", "cache_root": args.cache_root} if mode == "shm" else {}
    reader = {"raw": RawReader, "loader": LoaderReader}[workload](store, cache, args)
    out = {}
    for epoch in (1, 2):
        left = evict(store)
        t0 = time.perf_counter()
        n = reader.epoch(epoch)
        dt = time.perf_counter() - t0
        out[f"epoch{epoch}"] = {"seconds": round(dt, 3), "units": n, "resident_before": left,
                                "cache_stats": reader.stats()}  # fmt: skip
    reader.release()
    conn.send(out)


def one(store: Path, mode: str, workload: str, args) -> dict:
    ctx = mp.get_context("fork")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=run, args=(there, store, mode, workload, args))
    proc.start()
    out = here.recv()
    proc.join()
    return out


def rounds(store: Path, args) -> dict:
    """``--rounds`` rounds; in each, every (workload, mode) run once, the modes rotating."""
    runs = {f"{w}/{m}": [] for w in ("raw", "loader") for m in ("original", "shm")}
    for r in range(args.rounds):
        for workload in ("raw", "loader"):
            modes = ["original", "shm"][r % 2 :] + ["original", "shm"][: r % 2]
            for mode in modes:
                out = one(store, mode, workload, args)
                runs[f"{workload}/{mode}"].append(out)
                e1, e2 = out["epoch1"], out["epoch2"]
                print(
                    f"  round {r} {workload:>6}/{mode:<8}: first epoch {e1['seconds']:6.2f} s, "
                    f"second {e2['seconds']:6.2f} s (resident before: "
                    f"{e1['resident_before']:.0%}, {e2['resident_before']:.0%})",
                    flush=True,
                )
    return runs


def summary(runs: dict) -> dict:
    """Medians over rounds of the per-round ratios (both modes ran in the same round)."""

    def med(workload: str, epoch: str, mode: str) -> float:
        return float(np.median([r[epoch]["seconds"] for r in runs[f"{workload}/{mode}"]]))

    def ratio(workload: str, epoch: str, num: str, den: str) -> float:
        pairs = zip(runs[f"{workload}/{num}"], runs[f"{workload}/{den}"], strict=True)
        return round(float(np.median([a[epoch]["seconds"] / b[epoch]["seconds"]
                                      for a, b in pairs])), 2)  # fmt: skip

    out = {}
    for w in ("raw", "loader"):
        out[w] = {
            "second_epoch_s": {
                "original": med(w, "epoch2", "original"),
                "shm": med(w, "epoch2", "shm"),
            },
            "first_epoch_s": {
                "original": med(w, "epoch1", "original"),
                "shm": med(w, "epoch1", "shm"),
            },
            # time without / time with the cache
            "second_epoch_speedup_with_shm": ratio(w, "epoch2", "original", "shm"),
            # time with / time without: what the copy adds to the first epoch
            "first_epoch_time_ratio_with_shm": ratio(w, "epoch1", "shm", "original"),
        }
    return out


def prepare(args) -> Path:
    return make_store(args.workdir, args.images, args.classes, args.shard_size)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2560)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--shard-size", type=parse_size, default=parse_size("32MiB"))
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=usable_cores())
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cache-root", default=cd.DEFAULT_ROOT)
    p.add_argument("--note", default="", help="free text stored in the JSON (machine load...)")
    p.add_argument("--workdir", type=Path, default=REPO / "bench-data" / "cache")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = p.parse_args()
    store = prepare(args)
    files = shard_files(store)
    size = sum(f.stat().st_size for f in files)
    print(
        f"{read_manifest(store)['num_samples']} images in {len(files)} shards, "
        f"{size / MiB:.0f} MiB; batch {args.batch_size}, {args.workers} workers",
        flush=True,
    )
    load_before = os.getloadavg()
    runs = rounds(store, args)
    result = summary(runs)
    print(json.dumps(result, indent=1))
    cd.clear(args.cache_root, cd.store_id((store / MANIFEST).read_bytes()), force=True)
    report = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "store": {
            "images": read_manifest(store)["num_samples"],
            "shards": len(files),
            "bytes": size,
        },
        "note": args.note,
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "runs": runs,
        "summary": result,
    }
    write_result(args.out, f"cache-{usable_cores()}cpu.json", report)


if __name__ == "__main__":
    main()

"""Where ``decoder="dali"`` (``loader.dali_stage``) spends its time, on the GPU machine.

For each setting (DALI's CPU threads, the hardware engines' share of the JPEGs, and
whether DALI copies the JPEGs when fed or reads them in place):

1. **loader**: ``loader.DataLoader(decoder="dali")`` with 16 workers, a timed epoch after
   a warm-up one: img/s, and per batch the prefetch thread's time feeding DALI, waiting
   for its output and waiting for the workers, and its CPU time;
2. **alone**: the same stage fed batches held in RAM as fast as it returns them (no
   workers, no loader), ``depth`` batches in it at once: img/s, feeding and waiting ms.

    python3 benchmarks/dali_stage_probe.py STORE [--settings 8:1.0:copy,16:0.9:copy]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np
import torch

import loader
import loader.dali_stage as dali_stage
from ingest import format as fmt
from loader.augment import Transform, plan_crops
from loader.augment_gpu import cut
from loader.store import Store


def ram_batches(store: Store, batch: int, count: int, seed: int = 0) -> list:
    """``count`` batches of baseline JPEGs as (numpy slices of one buffer, crop rows)."""
    index = store.index
    jpeg = (index["format"] == fmt.FORMAT_CODES["jpeg"]) & (
        index["flags"] & fmt.FLAG_PROGRESSIVE == 0
    )
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(np.flatnonzero(jpeg))[: batch * count]
    out = []
    for k in range(0, len(chosen) - batch + 1, batch):
        idx = chosen[k : k + batch]
        blobs = [store.image(int(i))[0] for i in idx]
        data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        lengths = [len(b) for b in blobs]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        crops = plan_crops(Transform("train", 224), index["height"][idx], index["width"][idx], rng)
        out.append((cut(data, starts, lengths), crops))
    return out


def run_loader(store: str, workers: int, threads: int) -> tuple[loader.DataLoader, dict]:
    dl = loader.DataLoader(
        store, batch_size=256, shuffle=True, num_workers=workers, persistent_workers=True,
        transform="train", dtype="float16", channels_last=True, device="cuda",
        decoder="dali", drop_last=True,
    )  # fmt: skip
    dl._gpu_stage.threads = threads  # before its pipeline is built, on the first batch
    for _ in dl:  # warm-up epoch: the pipeline, the workers, the allocator
        pass
    torch.cuda.synchronize()
    before = dict(dl.stats())
    t0 = time.perf_counter()
    n = 0
    for images, _ in dl:
        n += len(images)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    after = dl.stats()
    batches = max(1, round(after["batches"] - before["batches"]))
    per_batch = {
        key: round(1000 * (after.get(key, 0) - before.get(key, 0)) / batches, 2)
        for key in ("dali_feed_s", "gpu_decode_s", "stage_wait_s", "prefetch_cpu_s")
    }
    return dl, {"img_s": round(n / seconds), "ms_per_batch": per_batch}


def run_alone(stage, work: list, rounds: int = 3) -> dict:
    """The stage fed ``work`` from RAM ``rounds`` times, ``stage.depth`` batches ahead."""
    size = (len(work[0][0]), 3, 224, 224)
    target = torch.empty(size, dtype=torch.float16, device="cuda").to(
        memory_format=torch.channels_last
    )
    feed_s = wait_s = 0.0
    pending: collections.deque = collections.deque()

    def take() -> None:
        nonlocal wait_s
        t = time.perf_counter()
        out = stage._output_of(pending.popleft())
        wait_s += time.perf_counter() - t
        stage._copy_out(out, size[0], into=target)

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for encoded, crops in work * rounds:
        if len(pending) == stage.depth:
            take()
        t = time.perf_counter()
        pending.append(stage._feed(encoded, stage._arguments(crops)))
        feed_s += time.perf_counter() - t
    while pending:
        take()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    batches = len(work) * rounds
    return {
        "img_s": round(batches * size[0] / seconds),
        "feed_ms": round(1000 * feed_s / batches, 2),
        "wait_ms": round(1000 * wait_s / batches, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--settings", default="8:1.0:copy,16:1.0:copy,8:0.9:copy,8:1.0:nocopy")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--out", default="dali-stage-probe.json")
    a = ap.parse_args()
    work = ram_batches(Store(a.store), 256, a.batches)
    results = []
    for setting in a.settings.split(","):
        threads, load, copy = setting.split(":")
        dali_stage.HW_DECODER_LOAD, dali_stage.NO_COPY = float(load), copy == "nocopy"
        dl, in_loader = run_loader(a.store, a.workers, int(threads))
        alone = run_alone(dl._gpu_stage, work)
        results.append({"setting": setting, "loader": in_loader, "alone": alone})
        print(f"{setting:16s} loader {in_loader}   alone {alone}", flush=True)
        del dl
    Path(a.out).write_text(json.dumps({"store": a.store, "results": results}, indent=1))


if __name__ == "__main__":
    main()

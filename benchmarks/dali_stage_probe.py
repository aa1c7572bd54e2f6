"""Where ``decoder="dali"`` (``loader.gpu.dali_stage``) spends its time, on the GPU machine.

For each setting (DALI's CPU threads, the hardware engines' share of the JPEGs, and
whether DALI copies the JPEGs when fed or reads them in place):

1. **loader**: ``loader.DataLoader(decoder="dali")`` with 16 workers, a timed epoch after
   a warm-up one: img/s, and per batch the prefetch thread's time feeding DALI, waiting
   for its output and waiting for the workers, and its CPU time;
2. **alone**: the same stage fed batches held in RAM as fast as it returns them (no
   workers, no loader), ``depth`` batches in it at once: img/s, feeding and waiting ms.

With ``--graphs``, DALI pipelines of a few shapes instead, fed the same batches from RAM
the same way (``--threads``): the stage's own; without its resize ROI; DALI's own
``image_random_crop`` (as the benchmark's DALI peers: DALI draws the windows and flips),
which tells whether a slower stage comes from its operators or from its feeding.

    python3 benchmarks/dali_stage_probe.py STORE [--settings 8:1.0:copy,16:0.9:copy]
    python3 benchmarks/dali_stage_probe.py STORE --graphs slice-roi,slice,random-crop
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np
import torch
from gpu_decoders import planned

import loader
import loader.gpu.dali_stage as dali_stage
from loader.gpu.augment import cut
from loader.gpu.dali_decode import copy_into
from loader.gpu.dali_stage import ENGINES, _Ticket
from loader.store import Store


def ram_batches(store: Store, batch: int, count: int, seed: int = 0) -> list:
    """``gpu_decoders.planned``'s batches as (numpy slices of one buffer, crop rows), as
    the stage gets them from a ring slot."""
    out = []
    for blobs, crops in planned(store, batch, count, seed):
        data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
        lengths = [len(b) for b in blobs]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
        out.append((cut(data, starts, lengths), crops))
    return out


def rates(batches: int, images: int, seconds: float, feed_s: float, wait_s: float) -> dict:
    """img/s, and the ms a batch spent feeding the pipeline and waiting for its output."""
    return {
        "img_s": round(images / seconds),
        "feed_ms": round(1000 * feed_s / batches, 2),
        "wait_ms": round(1000 * wait_s / batches, 2),
    }


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


def fed_ahead(items, depth: int, feed, take) -> tuple[float, float]:
    """Feed each of ``items`` (``feed(item)``), ``depth`` batches ahead of taking an output
    (``take()``), then take the rest; (seconds in all, seconds feeding), the GPU idle at
    both ends."""
    torch.cuda.synchronize()
    t0, feed_s, pending = time.perf_counter(), 0.0, 0
    for item in items:
        if pending == depth:
            take()
            pending -= 1
        t = time.perf_counter()
        feed(item)
        feed_s += time.perf_counter() - t
        pending += 1
    for _ in range(pending):
        take()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, feed_s


def run_alone(stage, work: list, rounds: int = 3) -> dict:
    """The stage fed ``work`` from RAM ``rounds`` times, ``stage.depth`` batches ahead, on
    the hardware engines' pipeline (no trials: nothing is handed to a training loop)."""
    size = (len(work[0][0]), 3, 224, 224)
    target = torch.empty(size, dtype=torch.float16, device="cuda").to(
        memory_format=torch.channels_last
    )
    wait_s = 0.0
    pending: collections.deque = collections.deque()

    def feed(item) -> None:
        encoded, crops = item
        ticket = _Ticket(encoded, stage._arguments(crops), ENGINES)
        stage._feed(ticket)
        pending.append(ticket)

    def take() -> None:
        nonlocal wait_s
        t = time.perf_counter()
        out = stage._output_of(pending.popleft())
        wait_s += time.perf_counter() - t
        stage._copy_out(out, size[0], into=target)

    fed_ahead(work[:6], stage.depth, feed, take)  # warm-up: the pipeline is built first
    wait_s = 0.0
    seconds, feed_s = fed_ahead(work * rounds, stage.depth, feed, take)
    batches = len(work) * rounds
    return rates(batches, batches * size[0], seconds, feed_s, wait_s)


def build_graph(kind: str, threads: int, depth: int = 3, hw_load: float | None = None):
    """A DALI pipeline of shape ``kind``, its inputs fed by name (see the module doc)."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(
        batch_size=256, num_threads=threads, device_id=0, prefetch_queue_depth=depth,
        exec_async=True, exec_pipelined=True, seed=0,
    )  # fmt: skip
    def graph():
        def given(name, dtype, ndim=1, **kwargs):
            return fn.external_source(name=name, dtype=dtype, ndim=ndim, **kwargs)

        jpegs = given("jpegs", types.UINT8, no_copy=True)
        if kind == "random-crop":
            images = fn.decoders.image_random_crop(jpegs, device="mixed", output_type=types.RGB)
            images = fn.resize(images, resize_x=224, resize_y=224)
            mirror = fn.random.coin_flip()
        else:
            images = fn.decoders.image_slice(
                jpegs, given("anchor", types.FLOAT), given("shape", types.FLOAT),
                device="mixed", output_type=types.RGB, axis_names="WH",
                normalized_anchor=False, normalized_shape=False,
                **({} if hw_load is None else {"hw_decoder_load": hw_load}),
            )  # fmt: skip
            roi = {}
            if kind == "slice-roi":
                roi = {"roi_start": given("roi_start", types.FLOAT),
                       "roi_end": given("roi_end", types.FLOAT), "roi_relative": False}  # fmt: skip
            images = fn.resize(images, resize_x=224, resize_y=224, **roi)
            mirror = given("flip", types.INT32, ndim=0)
        return fn.crop_mirror_normalize(
            images, dtype=types.FLOAT16, output_layout="HWC", mean=[124.0, 116.0, 104.0],
            std=[58.0, 57.0, 57.0], mirror=mirror,
        )  # fmt: skip

    pipe = graph()
    pipe.build()
    return pipe


def run_graph(name: str, threads: int, work: list, stage_arguments, rounds: int = 3) -> dict:
    """img/s of pipeline ``name`` fed ``work`` from RAM, 3 batches ahead, as ``run_alone``.
    ``name`` is a shape with modifiers: "+hw1" (every JPEG to the hardware engines),
    "+copy" (each output copied into a torch tensor, as the stage does), "+prio" (the
    outputs bound to a high-priority stream, as the stage's side stream)."""
    kind, *mods = name.split("+")
    depth = 3
    pipe = build_graph(kind, threads, depth, hw_load=1.0 if "hw1" in mods else None)
    names = {"slice-roi": None, "slice": ("anchor", "shape", "flip"), "random-crop": ()}[kind]
    fed = []
    for encoded, crops in work:
        args = stage_arguments(crops)
        fed.append((encoded, {k: v for k, v in args.items() if names is None or k in names}))
    stream = torch.cuda.Stream(priority=-1 if "prio" in mods else 0)
    target = torch.empty((256, 224, 224, 3), dtype=torch.float16, device="cuda")
    wait_s, count = 0.0, 0

    def feed(item) -> None:
        nonlocal count
        encoded, args = item
        pipe.feed_input("jpegs", encoded)
        for name, value in args.items():
            pipe.feed_input(name, value)
        count += 1
        if count >= depth:  # the first run starts `depth` iterations
            pipe.schedule_run()

    def take() -> None:
        nonlocal wait_s
        t = time.perf_counter()
        (out,) = pipe.outputs(cuda_stream=stream)
        wait_s += time.perf_counter() - t
        if "copy" in mods:
            copy_into(target, out, stream)
        del out

    seconds, feed_s = fed_ahead(fed * rounds, depth, feed, take)
    batches = len(fed) * rounds
    return rates(batches, batches * 256, seconds, feed_s, wait_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--settings", default="8:1.0:copy,16:1.0:copy,8:0.9:copy,8:1.0:nocopy")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--graphs", default="")
    ap.add_argument("--alone", default="")  # e.g. "workers,noworkers,noworkers+nofilter"
    ap.add_argument("--threads", default="16")
    ap.add_argument("--out", default="dali-stage-probe.json")
    a = ap.parse_args()
    work = ram_batches(Store(a.store), 256, a.batches)
    results = []
    if a.alone:  # the stage alone, its loader with and without workers, stderr captured or not
        import contextlib

        for variant in a.alone.split(","):
            workers = 0 if "noworkers" in variant else a.workers
            dl = loader.DataLoader(
                a.store, 256, transform="train", device="cuda", decoder="dali",
                dtype="float16", channels_last=True, num_workers=workers,
            )  # fmt: skip
            if "nofilter" in variant:
                dali_stage.filtered = lambda _noise: contextlib.nullcontext()
            r = run_alone(dl._gpu_stage, work)
            results.append({"alone": variant, **r})
            print(f"{variant:20s} {r}", flush=True)
            del dl
        Path(a.out).write_text(json.dumps({"store": a.store, "results": results}, indent=1))
        return
    if a.graphs:
        dl = loader.DataLoader(a.store, 256, transform="train", device="cuda", decoder="dali")
        for threads in a.threads.split(","):
            for kind in a.graphs.split(","):
                r = run_graph(kind, int(threads), work, dl._gpu_stage._arguments)
                results.append({"graph": kind, "threads": int(threads), **r})
                print(f"{kind:12s} threads {threads:3s} {r}", flush=True)
        Path(a.out).write_text(json.dumps({"store": a.store, "results": results}, indent=1))
        return
    for setting in a.settings.split(","):
        threads, load, copy = setting.split(":")
        dali_stage._HW_LOAD = {**dali_stage._HW_LOAD, dali_stage.ENGINES: float(load)}
        dali_stage.NO_COPY = copy == "nocopy"
        dl, in_loader = run_loader(a.store, a.workers, int(threads))
        alone = run_alone(dl._gpu_stage, work)
        results.append({"setting": setting, "loader": in_loader, "alone": alone})
        print(f"{setting:16s} loader {in_loader}   alone {alone}", flush=True)
        del dl
    Path(a.out).write_text(json.dumps({"store": a.store, "results": results}, indent=1))


if __name__ == "__main__":
    main()

"""DDP ResNet-50 on every GPU of one host, fed by ``loader.DataLoader`` (``torchrun``).

Each rank trains on its own GPU with its share of the cores as workers: first on synthetic
data on the GPU (the ceiling), then the loader alone (after an untimed epoch, and the DALI
stage's first trial of its two ways: its throughput on this rank), then fed by the loader
(``cache="shm"``: one copy of the store's bytes in RAM for all ranks). Rank 0 prints one
JSON line with every rank's figures; run it with ``--nproc_per_node=1`` and ``2`` on the
same machine to compare per-GPU figures.

The model trains as imfeed-bench's training check does (bf16 autocast, channels_last, SGD,
``cudnn.benchmark``); the synthetic batch is in the loader's dtype (bfloat16), so that both
phases feed the model the same tensors. ``dry_share`` (and ``ceiling_dry_share``): the
share of the timed steps whose batch was asked for with the GPU already idle (the host, not
the GPU, set the pace), ``starved_share`` the share whose batch was handed to a stream
that had run dry by then (while the step waited in ``next()``), ``epoch_starts`` the same
for the steps whose batch was an epoch's first (and their waits); ``wait_share``: the share
of the timed steps spent in ``next()`` on the loader; ``step_ms`` and ``wait_ms``: the
host's time per timed step and per wait (median, 90th percentile, largest); ``beside``:
``dl.stats()`` while fed to the model (per image; the hand-offs to a training stream that
had run dry, and those with the batch's GPU work still running, and the epochs begun with
batches made during the one before, or those dropped; untimed steps included);
``cpu_mhz``: this rank's cores' clock (/proc/cpuinfo, the median of samples every 0.25 s)
in each phase, where a figure measured on half of the machine runs at a higher one.

Flags to tell what costs what: ``--plain`` (one rank only) trains without the DDP wrapper,
``--no-cudnn-benchmark`` with cuDNN's default kernels, ``--cpu-share`` sets the loader's,
``--dali-way`` keeps the DALI stage to one way (no trials), ``--cuda-first`` makes its
first trial start with CUDA (with one window each way in a row, as the trials were, the
way tried first was kept under DDP), ``--train-priority N`` trains on a stream of priority -N,
``--switch-interval MS`` sets how long a Python thread may hold the GIL while another waits.

    torchrun --nproc_per_node=2 benchmarks/ddp_two_gpus.py STORE [--steps 150] [--warmup 100]
        [--cache shm] [--workers N] [--cpu-share X] [--plain] [--no-cudnn-benchmark]
        [--dali-way engines|cuda] [--cuda-first] [--train-priority N] [--switch-interval MS]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from itertools import chain, repeat
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np
import torch
import torch.distributed as dist
import torchvision

import loader
from loader.bench.machine import CoreClock
from loader.bench.train import SETTLE_STEPS, settling
from loader.gpu.tuning.picker import WayPicker


def timed_steps(step, batches, steps: int, warmup: int, device, dl=None) -> dict:
    """``steps`` steps after ``warmup`` (and more while ``dl`` on any rank tries its ways,
    ``loader.gpu.tuning.picker``: at most ``SETTLE_STEPS``), all ranks in step: their img/s, the
    share
    of their time spent waiting in ``next()``, and the host's time per step and per wait
    (ms: median, 90th percentile, largest): a few long waits or many short ones. With
    ``dl`` (``batches``: its epochs back to back), also the steps whose batch was an
    epoch's first: their waits (ms), those handed to a stream that had run dry, and the
    share of the time they waited."""
    it, taken = iter(batches), 0
    for _ in range(warmup):
        step(*next(it))
        taken += 1
    for _ in range(SETTLE_STEPS):
        if not anyone(settling(dl), device):
            break
        step(*next(it))
        taken += 1
    sync(device)
    before = starved(dl)
    t0, n, waits, ends, dry = time.perf_counter(), 0, [], [], 0
    starts, starts_starved = [], 0  # the epochs' first batches: waits, and run dry
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    for _ in range(steps):
        dry += stream is not None and stream.query()  # the GPU already ran out of steps
        first = dl is not None and taken % len(dl) == 0
        starved_then = starved(dl) if first else 0
        asked = time.perf_counter()
        x, y = next(it)
        waits.append(time.perf_counter() - asked)
        if first:
            starts.append(waits[-1])
            starts_starved += starved(dl) - starved_then
        taken += 1
        step(x, y)
        n += len(x)
        ends.append(time.perf_counter())
    sync(device)
    seconds = time.perf_counter() - t0
    return {
        "img_s": n / seconds,
        "wait_share": sum(waits) / seconds,
        "dry_share": dry / steps,
        # Of the timed steps' hand-offs, those to a stream that had run dry meanwhile.
        "starved_share": (starved(dl) - before) / steps,
        "step_ms": spread(np.diff([t0, *ends])),
        "wait_ms": spread(waits),
        "epoch_starts": {
            "steps": len(starts),
            "wait_ms": [round(w * 1e3, 2) for w in starts],
            "starved": starts_starved,
            "wait_share": round(sum(starts) / seconds, 4),
        },
    }


def starved(dl) -> int:
    """The hand-offs ``dl`` made to a training stream that had run dry (0 without one).
    Read without ``dl.stats()``, which waits for the loader's GPU work to time it: the
    training loop's host must not be held up at the steps measured."""
    return int(dl._stats.total("starved_handoffs")) if dl is not None else 0


def spread(seconds) -> list[float]:
    """Median, 90th percentile and largest of ``seconds``, in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    return [round(float(v), 2) for v in (np.median(ms), np.percentile(ms, 90), ms.max())]


def anyone(flag: bool, device) -> bool:
    """Whether ``flag`` holds on any rank (every rank asks at once)."""
    t = torch.tensor([int(flag)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def my_share_of_cores(world: int) -> int:
    """This rank's cores (its affinity: all of them, or those ``torchrun --numa-binding``
    gave it) divided among the ranks of this host that may run on them too."""
    mine = os.sched_getaffinity(0)
    everyone = [None] * world
    dist.all_gather_object(everyone, (socket.gethostname(), sorted(mine)))
    here = socket.gethostname()
    sharing = sum(1 for host, cores in everyone if host == here and mine & set(cores))
    return max(1, len(mine) // sharing)


def phase(before: dict, after: dict, images: int) -> dict:
    """What ``dl.stats()`` counted between ``before`` and ``after`` (``images`` served):
    each time in microseconds an image, and the DALI stage's way and paces at the end."""
    out = {
        k[:-2] + "_us_per_image": round((v - before.get(k, 0.0)) / images * 1e6, 1)
        for k, v in after.items()
        if k.endswith("_s") and isinstance(v, float)
    }
    keys = ("way", "way_trials", "way_trial_causes", "way_paces_ms", "way_drifts_ms")
    out.update({k: after[k] for k in keys if k in after})
    return out


def make_step(device, rank: int, plain: bool = False):
    """One training step of ResNet-50 (DDP unless ``plain``) on a batch."""
    model = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    ddp = model
    if not plain:
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[rank] if device.type == "cuda" else None
        )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(ddp(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=150)
    # Untimed steps (more while the DALI stage tries its two ways: loader.gpu.tuning.picker).
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--cache", default="shm")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--workers", type=int, default=0, help="per rank (default: its cores)")
    # The loader alone is timed over whole epochs, this many images in all (split over ranks).
    ap.add_argument("--loader-images", type=int, default=60000)
    ap.add_argument("--cpu-share", default="0", help="the loader's cpu_share (a fraction, auto)")
    ap.add_argument("--plain", action="store_true", help="one rank: no DDP wrapper")
    ap.add_argument("--dali-way", choices=("engines", "cuda"), help="no trials: this way only")
    ap.add_argument(
        "--cuda-first", action="store_true", help="the first trial tries the CUDA way first"
    )
    ap.add_argument(
        "--train-priority",
        type=int,
        default=0,
        help="N: train on a stream of priority -N (higher than the loader's)",
    )
    ap.add_argument("--no-cudnn-benchmark", action="store_true")
    ap.add_argument(
        "--switch-interval",
        type=float,
        help="MS: Python's thread switch interval (sys.setswitchinterval; default 5 ms)",
    )
    a = ap.parse_args()
    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval / 1e3)
    torch.backends.cudnn.benchmark = not a.no_cudnn_benchmark
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if a.plain and world > 1:
        ap.error("--plain trains without DDP: one rank only (--nproc_per_node=1)")
    if a.train_priority and cuda:
        torch.cuda.set_stream(torch.cuda.Stream(device, priority=-a.train_priority))
    workers = a.workers or my_share_of_cores(world)
    step = make_step(device, rank, a.plain)
    b, size = a.batch_size, a.size
    x = torch.randn(b, 3, size, size, device=device, dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (b,), device=device)
    cores = sorted(os.sched_getaffinity(0))
    with CoreClock(cores) as clock:  # each phase's core clock: all busy, it runs lower
        synthetic = timed_steps(step, iter(lambda: (x, y), None), a.steps, a.warmup, device)
    clocks = {"ceiling": clock.mhz}
    ceiling = synthetic["img_s"]
    dl = loader.DataLoader(
        a.store, batch_size=b, shuffle=True, drop_last=True, num_workers=workers,
        transform=loader.Transform("train", size), device=device, dtype=torch.bfloat16,
        channels_last=True, persistent_workers=True, cache=a.cache or None,
        cpu_share=a.cpu_share if a.cpu_share == "auto" else float(a.cpu_share),
    )  # fmt: skip
    if a.dali_way and getattr(dl._gpu_stage, "picker", None) is not None:
        dl._gpu_stage.fix_way(a.dali_way)  # every batch that way: no trials
    elif a.cuda_first and getattr(dl._gpu_stage, "picker", None) is not None:
        dl._gpu_stage.routing.picker = WayPicker(tuple(reversed(dl._gpu_stage.picker.ways)))
    # Untimed epochs: the first starts the workers and fills the cache; more until the DALI
    # stage's first trial of its two ways is over, as in imfeed-bench: its batches the
    # slower way would weigh twice as much per image with two ranks, whose epochs are half
    # as long (loader.gpu.tuning.picker).
    warm_epochs = 0
    while warm_epochs == 0 or settling(dl):
        for _ in dl:
            pass
        warm_epochs += 1
    sync(device)
    before, epochs = dl.stats(), 0
    t0, n = time.perf_counter(), 0
    with CoreClock(cores) as clock:
        while n < a.loader_images // world or epochs < 2:  # then the loader alone (this rank)
            for images, _ in dl:
                n += len(images)
            epochs += 1
        sync(device)
    loader_rate = n / (time.perf_counter() - t0)
    clocks["alone"] = clock.mhz
    alone = phase(before, dl.stats(), n)
    before = dl.stats()  # then fed to the model (the untimed steps counted in ``beside``)
    with CoreClock(cores) as clock:
        fed = timed_steps(step, chain.from_iterable(repeat(dl)), a.steps, a.warmup, device, dl)
    clocks["fed"] = clock.mhz
    after = dl.stats()
    beside = phase(before, after, after["samples"] - before["samples"])
    picker = getattr(dl._gpu_stage, "picker", None)
    for key in ("starved_handoffs", "pending_handoffs", "epochs_carried", "carries_dropped"):
        beside[key] = after.get(key, 0) - before.get(key, 0)
    mine = {
        "rank": rank, "workers": workers, "ceiling_img_s": round(ceiling, 1),
        "loader_img_s": round(loader_rate, 1), "fed_img_s": round(fed["img_s"], 1),
        "share": round(fed["img_s"] / ceiling, 3), "wait_share": round(fed["wait_share"], 4),
        "dry_share": round(fed["dry_share"], 3),
        "starved_share": round(fed["starved_share"], 3),
        "epoch_starts": fed["epoch_starts"],
        "ceiling_dry_share": round(synthetic["dry_share"], 3),
        "ceiling_step_ms": synthetic["step_ms"],
        "step_ms": fed["step_ms"], "wait_ms": fed["wait_ms"],
        "ddp": not a.plain, "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "dali_way_fixed": a.dali_way, "cuda_first": a.cuda_first,
        "train_priority": a.train_priority,
        "switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),
        "epoch_images": n // epochs, "loader_epochs": epochs,
        "warm_epochs": warm_epochs,
        "alone": alone, "beside": beside,
        "cores": cores, "cpu_mhz": clocks, "stats": dl.stats(),
        # The DALI stage's last trials, oldest first (loader.gpu.tuning.picker).
        "trials": [trial.report() for trial in getattr(picker, "history", ())],
    }  # fmt: skip
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
        print(json.dumps({"world_size": world, "gpu": gpu, "ranks": everyone}), flush=True)
    dl.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

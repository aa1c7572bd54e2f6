"""Where a timm-style training step's time goes with our loader (CUDA only).

python3 benchmarks/timm_step_probe.py STORE [alone] [train] (FEEDS, STEPS, WARM)

``alone``: the loader with timm's recipe (``rand-m9-mstd0.5-inc1``, re_prob 0.25, random
interpolation) by itself: img/s, a cProfile of the GPU stage's thread, then 10 batches under
torch's profiler (kernels by name, GPU busy time by stream). ``train``: ResNet-50 in a loop
written as timm's (fp16 autocast, GradScaler, timm's Mixup and SoftTargetCrossEntropy,
``loss.item()`` each step), STEPS steps after WARM, per feed: ``synthetic`` (one batch on
the GPU), ``busy`` (the same beside N processes that spin on the CPU, ``wN``, 16 unless
given: the cores' contention alone), ``ghost`` (the same beside a thread that makes ``oN``
small CUDA ops and spins ``pN`` ms in the interpreter a step), ``recipe`` (timm's recipe),
``crop`` (RandomResizedCrop + flip only), ``dali`` (DALI's own pipeline on the store's image
folder, the crop only), each with options joined by "-": ``nvjpeg``, ``cpu`` or ``dali``
(decoder), ``wN`` (N workers), ``cN`` (N nvJPEG decode threads), ``niceN`` (worker_nice, or
the spinners' niceness), ``switch`` (a 0.2 ms GIL switch interval), ``nosync`` (no
``loss.item()``), ``unfused`` (the batch normalised and erased by torch ops, not
``loader.gpu.normalise``'s one launch), ``compile`` or ``graphs`` (the model under
``torch.compile``, its default mode or "reduce-overhead": fewer launches a step; WARM must
cover the compile), ``prof`` (then 6 steps under torch's profiler: the GPU's busy time
against the span). Prints img/s, the main thread's CPU share, the cores' clock at the end,
the loader's thread CPU and the step's parts.
docs/design/augmentations.md cites its output.
"""

from __future__ import annotations

import collections
import cProfile
import io
import itertools
import json
import os
import pstats
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import timm
import timm.loss
import torch
from timm.data import Mixup, create_transform

import loader
from loader.gpu import prefetch
from loader.gpu.nvjpeg import NvjpegDecoder
from loader.gpu.steps import BatchSteps

BATCH = 256
NVJPEG_CALLS = NvjpegDecoder.concurrent_calls  # the loader's own, before an option's
RECIPES = {
    "recipe": {"auto_augment": "rand-m9-mstd0.5-inc1", "re_prob": 0.25},
    "crop": {"color_jitter": None},
}
STAGE = cProfile.Profile()  # the GPU stage thread's calls (one profiler: Python 3.12 allows one)
_produce_one = prefetch.GpuEpochIterator._produce_one


def _profiled(self):
    STAGE.enable()
    try:
        return _produce_one(self)
    finally:
        STAGE.disable()


def make(store: str, recipe: str, **kw) -> loader.DataLoader:
    tf = create_transform(224, is_training=True, interpolation="random", **RECIPES[recipe])
    kw = {"num_workers": 16, **kw}
    dataset = loader.LMDBDataset(store, transform=tf)
    return loader.DataLoader(
        dataset, batch_size=BATCH, shuffle=True, drop_last=True, pin_memory=True, **kw
    )


def kernels(prof, tag: str) -> None:
    """The profile's CUDA kernels by name: count and time."""
    total, count = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:70]] += e.device_time_total
            count[e.name[:70]] += 1
    print(f"[{tag}] kernels {sum(count.values())} total {sum(total.values()) / 1e3:.1f} ms")
    for name, us in total.most_common(30):
        print(f"   {us / 1e3:8.2f} ms {count[name]:5d}x {name}")


def streams(prof, tag: str) -> None:
    """The trace's span, the GPU's busy time (kernels' union) and each stream's share; then
    the CUDA runtime and driver calls that took the most time, by thread (a cudaFree or
    cudaHostAlloc in the loader's threads waits for the whole device, training included)."""
    path = "/tmp/timm_step_probe_trace.json"
    prof.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)["traceEvents"]
    events = [e for e in trace if e.get("cat") == "kernel"]
    took, count = collections.Counter(), collections.Counter()
    for e in trace:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            took[e.get("tid"), e["name"]] += e.get("dur", 0)
            count[e.get("tid"), e["name"]] += 1
    for (tid, name), us in took.most_common(15):
        print(f"   thread {tid}: {us / 1e3:8.2f} ms {count[tid, name]:5d}x {name}")
    by, spans = collections.Counter(), sorted((e["ts"], e["ts"] + e["dur"]) for e in events)
    for e in events:
        by[e["args"].get("stream")] += e["dur"]
    busy, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            busy, end = busy + b - max(a, end), b
    span = (end - spans[0][0]) / 1e3 if spans else 0.0
    parts = ", ".join(f"{k}: {v / 1e3:.1f}" for k, v in by.most_common())
    print(f"[{tag}] span {span:.1f} ms busy {busy / 1e3:.1f} ms by stream (ms): {{ {parts} }}")


def alone(store: str, batches: int = 40) -> None:
    prefetch.GpuEpochIterator._produce_one = _profiled
    dl = make(store, "recipe")
    it = iter(dl)
    for _ in range(8):
        next(it)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(batches):
        next(it)
    torch.cuda.synchronize()
    print(f"alone recipe: {batches * BATCH / (time.perf_counter() - t):.0f} img/s")
    out = io.StringIO()
    STAGE.create_stats()
    stats = pstats.Stats(STAGE, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumtime").print_stats(45)
    print(out.getvalue())
    prefetch.GpuEpochIterator._produce_one = _produce_one
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            next(it)
        torch.cuda.synchronize()
    kernels(prof, "alone recipe, 10 batches")
    streams(prof, "alone recipe")
    s = dl.stats()
    print("stats", {k: s.get(k) for k in ("prefetch_cpu_s", "batches", "way", "decoder")})


def _options(feed: str) -> dict:
    """The feed's options after its name: {"nvjpeg": True, "w": 4, "nice": 19, ...}."""
    out = {}
    for o in feed.split("-")[1:]:
        name, number = o.rstrip("0123456789"), o[len(o.rstrip("0123456789")) :]
        flag = name in FLAGS and not number
        if not (flag or (name in ("w", "nice", "c", "o", "p") and number)):
            raise SystemExit(f"unknown option {o!r} in feed {feed!r}: see the module docstring")
        out[name] = int(number) if number else True
    return out


FLAGS = ("nvjpeg", "cpu", "dali", "switch", "nosync", "prof", "compile", "graphs", "unfused")
CORES = sorted(os.sched_getaffinity(0))


_SPIN = """import os, sys
os.nice(int(sys.argv[1]))
parent, x = os.getppid(), 0
while True:  # until killed, or the probe is gone
    x += 1
    if x % 10_000_000 == 0 and os.getppid() != parent:
        break
"""


def _spinners(n: int, nice: int) -> list:
    return [subprocess.Popen([sys.executable, "-c", _SPIN, str(nice)]) for _ in range(n)]


def _feed(store: str, feed: str):
    """(batches, the loader, or the spinner processes beside synthetic data) of ``feed``."""
    opts = _options(feed)
    if "switch" in opts:
        sys.setswitchinterval(0.0002)
    BatchSteps.fused = False if "unfused" in opts else None
    if feed.startswith(("synthetic", "busy", "ghost")):
        x = torch.randn(BATCH, 3, 224, 224, device="cuda")
        y = torch.randint(0, 10, (BATCH,), device="cuda")
        batches = ((x.clone(), y) for _ in itertools.count())
        if feed.startswith("ghost"):  # beside a thread that acts a stage's part
            return _beside_ghost(batches, opts.get("o", 0), opts.get("p", 0)), []
        spin = []
        if feed.startswith("busy"):
            spin = _spinners(opts.get("w", 16), opts.get("nice", 0))
        return batches, spin
    if feed.startswith("dali"):  # DALI's own pipeline from the image folder, the crop only
        return _dali(store), []
    recipe = feed.split("-")[0]
    if recipe not in RECIPES:
        raise SystemExit(f"unknown feed {feed!r}: see the module docstring")
    kw = {"worker_nice": opts.get("nice", 0)}
    for decoder in ("nvjpeg", "cpu", "dali"):
        if decoder in opts:
            kw["decoder"] = decoder
    if "w" in opts:
        kw["num_workers"] = opts["w"]
    NvjpegDecoder.concurrent_calls = opts.get("c", NVJPEG_CALLS)  # its decode threads
    dl = make(store, recipe, **kw)
    return itertools.chain.from_iterable(itertools.repeat(dl)), dl  # epoch after epoch


def _beside_ghost(batches, ops: int, python_ms: int):
    """``batches``; for each, a thread makes ``ops`` small CUDA ops on a stream of its own
    (each lets the GIL go and takes it back) and spins ``python_ms`` in the interpreter
    (holding it): what a stage's launches and host Python alone cost the training thread."""
    turn, stop = threading.Semaphore(0), threading.Event()

    def work() -> None:
        a = torch.zeros(1024, device="cuda")
        with torch.cuda.stream(torch.cuda.Stream()):
            while turn.acquire() and not stop.is_set():
                for _ in range(ops):
                    a.add_(1.0)
                end = time.perf_counter() + python_ms / 1e3
                while time.perf_counter() < end:
                    pass

    threading.Thread(target=work, daemon=True).start()
    try:
        for batch in batches:
            turn.release()
            yield batch
    finally:
        stop.set()
        turn.release()


def _dali(store: str):
    """Batches of DALI's file reader + image_random_crop + flip + normalise (imfeed-bench's
    "dali-crop"), on the store's image folder, epoch after epoch."""
    from loader.bench.dali import DaliPipeline
    from loader.bench.settings import Settings

    folder = str(Path(store).parent / Path(store).name.replace("store-", "images-"))
    s = Settings(folder=folder, store=None, batch_size=BATCH, workers=16, dtype="float16",
                 channels_last=True, eval=False, device="cuda")  # fmt: skip
    pipe = DaliPipeline("crop", s)
    while True:
        yield from pipe.epoch()


def train(store: str, feed: str, model_name: str = "resnet50", steps: int = 40, warm: int = 12):
    model = timm.create_model(model_name).cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    opts = _options(feed)
    if "compile" in opts or "graphs" in opts:
        model = torch.compile(model, mode="reduce-overhead" if "graphs" in opts else None)
    scaler = torch.amp.GradScaler()
    mix = Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
    loss_fn = timm.loss.SoftTargetCrossEntropy()
    src, dl = _feed(store, feed)
    parts, sync = collections.Counter(), "nosync" not in opts

    def step() -> None:
        t0 = time.perf_counter()
        x, y = next(src)
        t_in = time.perf_counter()
        parts["next"] += t_in - t0
        x, y = mix(x.cuda(non_blocking=True), y.cuda(non_blocking=True))
        with torch.autocast("cuda", dtype=torch.float16):
            loss = loss_fn(model(x.contiguous(memory_format=torch.channels_last)), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        parts["to-backward"] += time.perf_counter() - t_in  # the batch in hand
        scaler.step(opt)
        scaler.update()
        t1 = time.perf_counter()
        parts["launch"] += t1 - t0
        if sync:
            loss.item()
        parts["item"] += time.perf_counter() - t1

    try:
        for _ in range(warm):
            step()
        parts.clear()
        torch.cuda.synchronize()
        s0 = dl.stats() if isinstance(dl, loader.DataLoader) else {}  # after the compiles
        cpu0, t = time.thread_time(), time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt, cpu = time.perf_counter() - t, time.thread_time() - cpu0
        mhz = _clock()
        each = ", ".join(f"{k} {1e3 * v / steps:.1f}" for k, v in parts.items())
        line = f"train {model_name} {feed}: {steps * BATCH / dt:.0f} img/s"
        line += f" main-thread cpu {cpu / dt:.2f} clock now {mhz}"
        if isinstance(dl, loader.DataLoader):
            s = dl.stats()
            line += f" (all batches: prefetch_cpu_s={s.get('prefetch_cpu_s') or 0:.2f}"
            line += f" batches={s.get('batches')})"
            # the stage's thread a batch over the measured steps: its wall, waits, CPU
            n = (s.get("batches") or 0) - (s0.get("batches") or 0) or 1
            line += " stage ms/batch: " + ", ".join(
                f"{k[:-2]} {1e3 * ((s.get(k) or 0) - (s0.get(k) or 0)) / n:.1f}"
                for k in ("stage_busy_s", "stage_wait_s", "stage_held_s", "prefetch_cpu_s",
                          "decode_threads_cpu_s")
            )  # fmt: skip
        print(f"{line} per step ms: {each}")
        if "prof" in opts:  # the GPU's busy time against the span: idle while the host lags
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(6):
                    step()
                torch.cuda.synchronize()
            streams(prof, f"train {feed}, 6 steps")
    finally:
        sys.setswitchinterval(0.005)
        if hasattr(src, "close"):
            src.close()  # a ghost's thread ends
        if isinstance(dl, loader.DataLoader):
            dl.close()  # its workers do not sit beside the next feed's run
        else:
            for p in dl:
                p.kill()
                p.wait()


def _clock() -> str:
    """The cores' clock as /proc/cpuinfo tells it at this moment (a snapshot; on many virtual
    machines the nominal clock): the mean over this process's cores, and the training
    thread's core."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = [float(v.split(":")[1]) for v in f if v.startswith("cpu MHz")]
    except OSError:
        return "?"
    ours = [mhz[c] for c in CORES if c < len(mhz)]
    own = CORES[0]
    return f"{sum(ours) / len(ours):.0f} MHz (core {own} {mhz[own]:.0f})" if ours else "?"


def main() -> None:
    store, which = sys.argv[1], sys.argv[2:] or ["alone", "train"]
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    if "alone" in which:
        alone(store)
    if "train" in which:
        for feed in os.environ.get("FEEDS", "synthetic recipe crop").split():
            steps, warm = int(os.environ.get("STEPS", 40)), int(os.environ.get("WARM", 12))
            train(store, feed, steps=steps, warm=warm)


if __name__ == "__main__":
    main()

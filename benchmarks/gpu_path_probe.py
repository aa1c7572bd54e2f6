"""Where does the GPU path lose against its decoder alone? One store, one process.

1. **Bare**: the decoder (``--decoder``: torchvision's batched nvjpeg by default; DALI
   decodes the sampler's windows) on batches of the store's baseline JPEGs held in RAM
   (as ``gpu_decoders.py``), then the same bytes as slices of one buffer (as the loader's
   ring slot hands them over), then decode followed by our augmentation kernels (GPU
   milliseconds per batch of each, from CUDA events), then called from as many threads
   as the decoder takes, back to back, as the loader calls it; and the CPU time of one
   augmentation call for 64, 256 and 1024 images (``augment_host_ms``: what is per call
   and what is per image of the interpreter time it takes).
2. **Loader**: ``loader.DataLoader(decoder=...)`` alone for several epochs (persistent
   workers), for each ``--cpu-share``, with per-epoch img/s, the GPU's share of the
   decoding, ``dl.stats()`` per image and a sampling profiler: a thread reads every
   thread's Python stack every millisecond and counts where the prefetch thread, the
   decode thread and the main thread are (the innermost frame of this repository, and the
   innermost frame of all). A thread inside a C call that has released the GIL shows at
   the Python line that made the call. With ``--cprofile``, also the CPU the prefetch
   thread and the decode threads spend per batch, by function (cProfile, after the first
   epoch): what they take from the training loop's interpreter.

    python3 benchmarks/gpu_path_probe.py STORE [--epochs 4] [--workers 16] [--out probe.json]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import pstats
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]

import numpy as np
import torch
from gil_copies import busy_python_thread
from gpu_decoders import sync

import loader
from loader.augment import Transform
from loader.bench.machine import Sampling
from loader.decode import get_decoder
from loader.gpu import augment as augment_gpu
from loader.gpu import prefetch
from loader.gpu import stage as gpu_stage
from loader.gpu.augment import GpuAugment
from loader.store import Store


class StackSampler(Sampling):
    """Counts, per thread name, where each sampled thread's Python stack is."""

    name = "probe-sampler"

    def __init__(self, period_s: float = 0.001) -> None:
        super().__init__(period_s)
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples: collections.Counter = collections.Counter()

    def sample(self) -> None:
        me = threading.get_ident()
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            name = names.get(ident, str(ident))
            self.samples[name] += 1
            self.counts[name][_site(frame)] += 1

    def report(self, top: int = 8) -> dict:
        out = {}
        for name, counter in self.counts.items():
            total = self.samples[name]
            out[name] = [(site, round(n / total, 3)) for site, n in counter.most_common(top)]
        return out


def _site(frame) -> str:
    """'innermost frame of ours <- innermost frame' of a stack."""
    inner = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}:{frame.f_lineno}"
    f = frame
    while f is not None and not _ours(f.f_code.co_filename):
        f = f.f_back
    if f is None or f is frame:
        return inner
    return f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}:{f.f_lineno} <- {inner}"


def _ours(filename: str) -> bool:
    return filename.startswith(str(ROOT / "loader")) or filename.startswith(str(ROOT / "ingest"))


def bare(store: Store, device: torch.device, decoder: str, count: int) -> dict:
    """Decoder alone, decoder on slot-like slices, and decoder + augmentation."""
    from gpu_decoders import batches, from_threads, rate

    work = batches(store, 256, count)
    dec = get_decoder(decoder, device=device)
    windowed = bool(getattr(dec, "crop_windows", False))  # DALI: decodes the windows only

    def decode(data, windows):
        return dec.decode_batch(data, windows) if windowed else dec.decode_batch(data)

    spec = Transform("train", 224)
    augment = GpuAugment(spec.size, spec.mean, spec.std, spec.antialias)

    def timed(items, fn) -> int:
        return round(rate(fn, items, device))

    def as_slices(data):
        flat = torch.cat(data)
        ends = np.cumsum([len(d) for d in data])
        return [flat[e - len(d) : e] for e, d in zip(ends, data, strict=True)]

    sliced = [(as_slices(d), w) for d, w in work]
    gpu_ms = collections.defaultdict(list)

    def decode_augment(data, windows):
        e0 = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
        if e0 is not None:
            e0.record()
        images = decode(data, windows)
        crops = _crops(store, len(images), windows)
        if windowed:
            crops[:, :2] = 0  # each decoded image is its window
        out = torch.empty((len(images), 3, 224, 224), dtype=torch.float16, device=device)
        out = out.contiguous(memory_format=torch.channels_last)
        if e0 is not None:
            e1 = torch.cuda.Event(enable_timing=True)
            e1.record()
        augment(images, crops, np.arange(len(images)), out)
        if e0 is not None:
            e2 = torch.cuda.Event(enable_timing=True)
            e2.record()
            e2.synchronize()
            gpu_ms["decode"].append(e0.elapsed_time(e1))
            gpu_ms["augment"].append(e1.elapsed_time(e2))

    rates = {"decode": timed(work, decode)}
    rates["decode_again"] = [timed(work, decode) for _ in range(3)]
    rates["decode_slices"] = timed(sliced, decode)
    rates["decode_augment"] = timed(work, decode_augment)
    # As the loader calls it: as many threads as the decoder takes, calls back to back.
    threads = int(getattr(dec, "concurrent_calls", 1))
    from_threads(decode, work[:threads], threads)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    n = from_threads(decode, work, threads)
    sync(device)
    rates[f"decode_{threads}_threads"] = round(n / (time.perf_counter() - t0))
    ms = {k: round(float(np.median(v)), 2) for k, v in gpu_ms.items()}
    host = augment_host_ms(augment, decode(*work[0]), work[0][1], store, device, windowed)
    return {"img_per_s": rates, "median_ms_per_batch": ms, "augment_host_ms": host}


def augment_host_ms(augment, images, windows, store, device, windowed, calls: int = 20) -> dict:
    """CPU ms of one augmentation call (the interpreter time it takes from the training
    loop) for 64, 256 and 1024 images: what is per call and what is per image."""
    out_ms = {}
    for n in (64, 256, 1024):
        some = [images[k % len(images)] for k in range(n)]
        crops = _crops(store, len(images), windows)[np.arange(n) % len(images)]
        if windowed:
            crops[:, :2] = 0
        out = torch.empty((n, 3, 224, 224), dtype=torch.float16, device=device)
        out = out.contiguous(memory_format=torch.channels_last)
        augment(some, crops, np.arange(n), out)  # warm-up (kernel compile, caches)
        sync(device)
        t0 = time.thread_time()
        for _ in range(calls):
            augment(some, crops, np.arange(n), out)
        out_ms[n] = round((time.thread_time() - t0) / calls * 1e3, 3)
        sync(device)
    return out_ms


def _crops(store: Store, n: int, windows: np.ndarray) -> np.ndarray:
    """Full crop rows for ``windows`` (y, x, h, w): resized straight to 224 x 224."""
    crops = np.zeros((n, 9), dtype=np.int32)
    crops[:, :4] = windows[:n]
    crops[:, 4:6] = 224
    return crops


class ThreadProfiles:
    """cProfile of the prefetch thread's batches (``GpuEpochIterator._produce_one``) and of
    the decode threads' calls (``GpuStage._decode``): one profiler per thread, merged."""

    TARGETS = (("prefetch", prefetch.GpuEpochIterator, "_produce_one"),
               ("decode", gpu_stage.GpuStage, "_decode"))  # fmt: skip

    def __init__(self) -> None:
        self.on = False
        self.profiles: dict[str, list] = {name: [] for name, _, _ in self.TARGETS}
        self._local = threading.local()
        self._real: dict = {}

    def __enter__(self) -> ThreadProfiles:
        for name, cls, attr in self.TARGETS:
            real = self._real[name] = getattr(cls, attr)
            setattr(cls, attr, self._wrap(name, real))
        return self

    def __exit__(self, *exc) -> None:
        for name, cls, attr in self.TARGETS:
            setattr(cls, attr, self._real[name])

    def _wrap(self, name: str, real):
        def profiled(*args, **kwargs):
            if not self.on:
                return real(*args, **kwargs)
            prof = getattr(self._local, name, None)
            if prof is None:
                prof = cProfile.Profile(time.thread_time)  # CPU, not waits
                setattr(self._local, name, prof)
                self.profiles[name].append(prof)
            prof.enable()
            try:
                return real(*args, **kwargs)
            finally:
                prof.disable()

        return profiled

    def report(self, batches: int, top: int = 15) -> dict:
        """{thread group: [(function, ms of its own CPU per batch, calls per batch)]}."""
        out = {}
        for name, profs in self.profiles.items():
            if not profs or not batches:
                continue
            stats = pstats.Stats(*profs)
            rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
            out[name] = [
                (f"{Path(file).name}:{line}({func})", round(tt / batches * 1e3, 3),
                 round(nc / batches, 1))
                for (file, line, func), (_, nc, tt, _, _) in rows
            ]  # fmt: skip
        return out


def loader_epochs(store_path: str, a, cpu_share) -> dict:
    if a.gather_chunk:  # samples per worker task (fewer tasks: fewer pipe messages a batch)
        prefetch._MIN_GATHER_CHUNK = a.gather_chunk
    dl = loader.DataLoader(
        store_path,
        batch_size=256,
        shuffle=True,
        num_workers=a.workers,
        persistent_workers=True,
        transform="train",
        dtype="float16",
        channels_last=True,
        device=a.device,
        decoder=a.decoder,
        drop_last=True,
        prefetch_factor=a.prefetch,
        cpu_share=cpu_share,
        worker_nice=a.worker_nice,
    )
    epochs, sampler, profiles = [], StackSampler(), ThreadProfiles()
    busy = busy_python_thread() if a.busy_thread else contextlib.nullcontext()
    try:
        with profiles, busy:
            for epoch in range(a.epochs):
                profiles.on = a.cprofile and epoch >= first_timed(a)
                epochs.append(one_epoch(dl, epoch, a, sampler))
    finally:
        sampler.__exit__()
        dl.close()
    timed = epochs[first_timed(a) :]
    batches = sum(e["batches"] for e in timed) if a.cprofile else 0
    return {"epochs": epochs, "stacks": sampler.report(), "cpu_per_batch": profiles.report(batches)}


def first_timed(a) -> int:
    """The first epoch the profilers look at: the first one warms up (unless it is all)."""
    return min(1, a.epochs - 1)


def one_epoch(dl, epoch: int, a, sampler) -> dict:
    """One epoch of ``dl``: img/s, the GPU's share of the decoding, stage times per image."""
    before = dl.stats()
    t0, n = time.perf_counter(), 0
    if epoch == first_timed(a):
        sampler.__enter__()
    for k, (images, _) in enumerate(dl, 1):
        n += len(images)
        if k == a.epoch_batches:  # a short epoch (beside a busy thread a whole one is slow)
            break
    if images.is_cuda:
        torch.cuda.synchronize(images.device)
    seconds = time.perf_counter() - t0
    after = dl.stats()
    per = {
        k.removesuffix("_s"): round((after[k] - before.get(k, 0.0)) / n * 1e6, 1)
        for k in after
        if k.endswith("_s") and isinstance(after[k], float)
    }
    gpu, cpu = (after.get(k, 0) - before.get(k, 0) for k in ("gpu_decoded", "cpu_decoded"))
    share = round(gpu / max(gpu + cpu, 1), 3)
    print(f"epoch {epoch}: {n / seconds:,.0f} img/s gpu_share {share} {per}", flush=True)
    batches = round(after.get("batches", 0) - before.get("batches", 0))
    return {"img_per_s": round(n / seconds), "gpu_share": share, "us_per_image": per,
            "batches": batches}  # fmt: skip


_GATHERS = {  # the alternatives to the loader's own gather (memoryview copies, GIL kept)
    "numpy": lambda rows, target: np.take(rows.array, rows.rows, axis=0, out=target),
    "torch": lambda rows, target: torch.index_select(
        torch.from_numpy(rows.array), 0, torch.from_numpy(rows.rows.astype(np.int64)),
        out=torch.from_numpy(target),
    ),
}  # fmt: skip


@contextlib.contextmanager
def gathering(how: str):
    """The workers' rows gathered the loader's way (``how`` empty) or, for comparison, by
    numpy's ``np.take`` or torch's ``index_select`` (both let the GIL go)."""
    if not how:
        yield
        return
    if how not in _GATHERS:
        known = ", ".join(f"SHARE/{name}" for name in _GATHERS)
        raise SystemExit(f"--cpu-share: unknown gather {how!r}; use SHARE or {known}")
    real = augment_gpu.gather
    augment_gpu.gather = _GATHERS[how]
    try:
        yield
    finally:
        augment_gpu.gather = real


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--batches", type=int, default=30, help="batches of the bare part")
    ap.add_argument(
        "--epoch-batches", type=int, default=0,
        help="end each loader epoch after this many batches (0: whole epochs)",
    )  # fmt: skip
    ap.add_argument("--decoder", default="nvjpeg")
    ap.add_argument(
        "--cpu-share", default="0",
        help="comma-separated values, one run each; SHARE/numpy or SHARE/torch gathers the "
        "workers' rows with np.take or index_select instead of the loader's way",
    )  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--worker-nice", type=int, default=0, help="the loader's worker_nice")
    ap.add_argument(
        "--busy-thread", action="store_true",
        help="run a pure Python loop beside the loader (a training loop's hold on the GIL)",
    )  # fmt: skip
    ap.add_argument(
        "--gather-chunk", type=int, default=0,
        help="samples per worker task (default: the loader's; larger: fewer pipe messages)",
    )  # fmt: skip
    ap.add_argument(
        "--cprofile", action="store_true",
        help="also profile the prefetch and decode threads' CPU per batch, by function",
    )  # fmt: skip
    ap.add_argument("--out", default="gpu-path-probe.json")
    a = ap.parse_args()
    if a.decoder in ("tvcpu", "dalicpu"):  # a dry run without CUDA (the tests' stand-ins)
        from gpu_path_data import STAND_INS

        import loader.decode as registry

        registry._BACKENDS.update(STAND_INS)
    result = {"settings": vars(a)}
    result["bare"] = bare(Store(a.store), torch.device(a.device), a.decoder, a.batches)
    print("bare:", result["bare"], flush=True)
    for entry in a.cpu_share.split(","):
        share, _, how = entry.partition("/")
        print(f"== loader, cpu_share={entry}", flush=True)
        with gathering(how):
            run = loader_epochs(a.store, a, share if share == "auto" else float(share))
        result[f"loader cpu_share={entry}"] = run
        for name, sites in run["stacks"].items():
            print(f"-- {name}")
            for site, count in sites[:4]:
                print(f"  {count:6.1%}  {site}")
        for name, rows in run["cpu_per_batch"].items():
            print(f"-- CPU per batch, {name} thread(s): ms, calls")
            for function, ms, calls in rows:
                print(f"  {ms:8.3f} {calls:7.1f}  {function}")
    Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Why does a model train slower when fed by the GPU path than the wait for data explains?

Runs ResNet-50 or -18 (bf16 autocast, channels_last, SGD, batch 256) for a fixed number of
steps in one process, under each condition below, and prints img/s, the share of step time
the loop waited in ``next()`` and NVML's GPU utilisation:

- ``synthetic``: one batch already on the GPU (the ceiling);
- ``synthetic+gil``: the same with a Python thread doing small numpy work without pause
  (how much a busy Python thread beside the loop costs it);
- ``synthetic+decode``: the same with a thread calling torchvision's batched nvjpeg decode
  on 256 JPEGs in a loop (the GPU decoder's own cost);
- ``decode``: that decode thread alone, no training (its rate by itself);
- ``synthetic+nvimgcodec`` / ``synthetic+nvimgcodec-hi``: the same with nvImageCodec's
  batched decode (where installed) on a normal- / high-priority stream of ours: whether a
  decoder that takes our stream keeps its speed beside training, where torchvision's runs
  on a normal-priority stream of its own; ``nvimgcodec``: alone;
- ``fed``: fed by ``loader.DataLoader(decoder="nvjpeg", cpu_share=0)``, with the prefetch
  thread's CPU time per batch from ``dl.stats()``; ``fed-0.3``: the workers decode 30%;
- ``fed+switch``: ``fed`` with ``sys.setswitchinterval(2e-4)`` (GIL hand-offs 25x sooner);
- ``dali:SETTING`` (``--dali`` lists them, comma-separated): fed by
  ``loader.DataLoader(decoder="dali")`` (the whole GPU stage in one DALI pipeline, float16
  out), the stage changed by SETTING's ``+``-joined words: ``base`` (as shipped),
  ``prime1`` (a new pipeline primed with one-sample batches, as its first version),
  ``roi`` (the resize always given a region of interest, as its first version),
  ``engines`` / ``cuda`` (every batch on that pipeline: no trials), ``hwX`` (every batch
  on the engines' pipeline, built with ``hw_decoder_load`` X), ``tN`` (N DALI threads),
  ``dN`` (N batches in the GPU stage), ``pfN`` (``prefetch_factor`` N), ``shareX``
  (``cpu_share`` X), ``prioN`` (the side stream at priority -N), ``copy`` (JPEGs copied
  when fed), ``prealloc`` (the engines' buffers sized for the store's largest image),
  ``pad`` (64 MB of device and 32 MB of host padding passed to the engines' decoder),
  ``mean`` / ``median`` (the picker's trials decided by the plain mean or the median of
  their gaps, where it uses ``loader.gpu.tuning.picker.steady_mean``), ``wN`` (trial windows of N),
  ``prof`` (the prefetch thread's calls profiled, printed by their own time), ``auto``
  (``cpu_share="auto"``), ``cpu`` (with ``engines`` / ``cuda``: that way with the
  workers' share), ``shrink`` (a loop's wait shrinks an auto share however long the
  prefetch thread holds finished batches: the rule before 2026-12-02).
  Each reports the share of batches DALI decoded the CUDA way, of hand-offs to an idle
  training stream, and the way kept after its trials.

    python3 benchmarks/diagnose_training.py STORE [--model resnet18] [--steps 40]
        [--warmup 8] [--workers 16] [--only synthetic,...] [--dali base,prime1,...]
        [--train-priority N]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import itertools
import json
import pstats
import statistics
import sys
import threading
import time
from itertools import chain, repeat
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torchvision

import loader
from ingest.cstderr import filtered
from loader.gpu.dali_decode import _LIBRARY_LINES
from loader.gpu.tuning.picker import WayPicker
from loader.store import Store
from loader.telemetry.proctree import tree_cpu_seconds

CONDITIONS = ("synthetic", "synthetic+gil", "decode", "synthetic+decode", "nvimgcodec",
              "synthetic+nvimgcodec", "synthetic+nvimgcodec-hi", "fed", "fed-0.3",
              "fed+switch")  # fmt: skip


def step_fn(name: str = "resnet50"):
    model = getattr(torchvision.models, name)().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def dali_fed(store: str, workers: int, setting: str):
    """A DataLoader with ``decoder="dali"`` whose stage is changed as ``setting`` says (see
    the module docstring), and the undo of those changes."""
    import loader.dataloader as dlm
    import loader.gpu.dali_stage as ds
    import loader.gpu.prefetch as pf
    import loader.gpu.stage as gs

    words = setting.split("+")
    undo: list = []

    def patch(obj, name: str, value) -> None:
        undo.append((obj, name, vars(obj)[name]))  # a class's staticmethod as it is
        setattr(obj, name, value)

    kwargs: dict = {}
    depth, fixed = None, None
    for w in words:
        if w.startswith("hw"):  # the engines' pipeline at this load, no trials
            patch(ds, "_HW_LOAD", {ds.ENGINES: float(w[2:]), ds.CUDA: 0.0})
            fixed = ds.ENGINES
        elif w in ("engines", "cuda"):  # one pipeline only, no trials
            fixed = w
        elif w.startswith("t") and w[1:].isdigit():  # DALI's threads (not capped by cores)
            init = ds.DaliStage.__init__

            def with_threads(self, *args, init=init, n=int(w[1:]), **kw) -> None:
                init(self, *args, **{**kw, "threads": n})

            patch(ds.DaliStage, "__init__", with_threads)
        elif w.startswith("d") and w[1:].isdigit():
            depth = int(w[1:])
            for module in (pf, dlm):
                patch(module, "batches_on_gpu", lambda calls, n=depth: n)
        elif w.startswith("pf"):
            kwargs["prefetch_factor"] = int(w[2:])
        elif w.startswith("share"):
            kwargs["cpu_share"] = float(w[5:])
        elif w == "auto":
            kwargs["cpu_share"] = "auto"
        elif w == "cpu":  # with "engines" / "cuda": that way with the workers' share
            pass  # set once the way is known
        elif w == "shrink":  # a loop's wait shrinks an auto share whatever the thread holds
            patch(gs, "_HELD", 2.0)  # (the rule before 2026-12-02)
        elif w == "roi":
            patch(ds.DaliStage, "_centre_crop", property(lambda self: True))
        elif w == "copy":
            patch(ds, "NO_COPY", False)
        elif w == "prealloc":  # the engines' buffers sized for the store's largest image
            index = Store(store).index
            largest = {"preallocate_height_hint": int(index["height"].max()),
                       "preallocate_width_hint": int(index["width"].max())}  # fmt: skip
            patch(ds, "ENGINE_ARGS", {**ds.ENGINE_ARGS, **largest})
        elif w == "pad":  # nvjpeg's buffer padding passed on to the engines' decoder
            padding = {"device_memory_padding": 64 << 20, "host_memory_padding": 32 << 20}
            patch(ds, "ENGINE_ARGS", {**ds.ENGINE_ARGS, **padding})
        elif w in ("mean", "median") or (w.startswith("w") and w[1:].isdigit()):
            pass  # the picker's, set once the loader is made
        elif w == "prime1":
            feed_one = ds.DaliStage.__dict__["_feed_one"].__func__

            def one_sample_dummies(own, encoded, args, feed_one=feed_one):
                if not own.primed and len(own.queue) < dl._gpu_stage.depth - 1:
                    encoded, args = encoded[:1], {k: v[:1] for k, v in args.items()}
                feed_one(own, encoded, args)

            patch(ds.DaliStage, "_feed_one", staticmethod(one_sample_dummies))
        elif w == "prof":  # the prefetch thread's calls, by their own time
            profiler = cProfile.Profile()
            produce_one = pf.GpuEpochIterator._produce_one

            def profiled(self, produce_one=produce_one, profiler=profiler):
                profiler.enable()
                try:
                    return produce_one(self)
                finally:
                    profiler.disable()

            patch(pf.GpuEpochIterator, "_produce_one", profiled)
        elif w not in ("base", "") and not w.startswith("prio"):
            raise SystemExit(f"unknown word {w!r} in DALI setting {setting!r}")
    if "cpu" in words and (fixed is None or "cpu_share" not in kwargs):
        raise SystemExit(f"DALI setting {setting!r}: 'cpu' needs 'engines' or 'cuda', and "
                         "'auto' or a 'shareX'")  # fmt: skip
    dl = loader.DataLoader(store, batch_size=256, shuffle=True, drop_last=True,
                           num_workers=workers, transform="train", dtype=torch.float16,
                           channels_last=True, device="cuda", decoder="dali",
                           persistent_workers=True, **kwargs)  # fmt: skip
    stage = dl._gpu_stage
    if depth is not None:
        stage.depth = depth
    if fixed is not None:
        stage.fix_way(fixed + (gs.WITH_SHARE if "cpu" in words else ""))
    for w in words:
        if w.startswith("prio"):
            stage.stream = torch.cuda.Stream(priority=-int(w[4:]))
    windows = [int(w[1:]) for w in words if w.startswith("w") and w[1:].isdigit()]
    stats = {"mean": statistics.fmean, "median": statistics.median}
    chosen = [stats[w] for w in words if w in stats]
    if stage.picker is not None and (chosen or windows):
        stage.picker = WayPicker(
            stage.picker.ways,
            window=windows[0] if windows else stage.picker.window,
            statistic=chosen[0] if chosen else stage.picker.statistic,
        )

    def restore() -> None:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)
        if "prof" in words:
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue(), flush=True)

    return dl, restore


def record_trials(picker) -> list:
    """The gaps each trial of ``picker`` (None: none) counted, by way, as it decides:
    a list of (handed off, finished) dicts of lists, filled as trials end."""
    trials: list = []
    if picker is None:
        return trials
    decide = picker._decide

    def recorded() -> None:
        trials.append(({w: list(g) for w, g in picker._gaps.items()},
                       {w: list(g) for w, g in picker._made.items()}))  # fmt: skip
        decide()

    picker._decide = recorded
    return trials


def per_batch(dl) -> dict:
    """The loader's stage timings, in ms a batch."""
    stats = dl.stats()
    keys = ("prefetch_cpu_s", "gpu_decode_s", "augment_s", "wait_s", "stage_wait_s",
            "stage_busy_s", "stage_held_s", "dali_feed_s")  # fmt: skip
    return {k: round(1000 * stats[k] / stats["batches"], 2) for k in keys if k in stats}


def run(step, batches, steps: int, warmup: int = 8) -> dict:
    util = []
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    torch.cuda.synchronize()
    t0, waited, n = time.perf_counter(), 0.0, 0
    starts = []
    for k in range(steps):
        w = time.perf_counter()
        starts.append(w)
        x, y = next(it)
        waited += time.perf_counter() - w
        step(x, y)
        n += x.shape[0]
        if k % 5 == 0:
            util.append(torch.cuda.utilization())
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": round(n / wall, 1), "wait_share": round(waited / wall, 3),
            "gpu_util": round(float(np.mean(util)), 1) if util else None,
            "step_ms": spread(np.diff(starts))}  # fmt: skip


def spread(gaps) -> dict:
    """Median, mean, 90th percentile and largest of ``gaps`` (seconds), in ms: a median
    under the mean tells of stalls among otherwise even steps."""
    if len(gaps) == 0:
        return {}
    ms = 1e3 * np.asarray(gaps, dtype=float)
    return {
        "p50": round(float(np.median(ms)), 2),
        "mean": round(float(ms.mean()), 2),
        "p90": round(float(np.percentile(ms, 90)), 2),
        "max": round(float(ms.max()), 2),
    }


class Side:
    """A background thread running ``work`` until stopped; counts its rounds."""

    def __init__(self, work) -> None:
        self.stop, self.rounds, self.error = threading.Event(), 0, None
        self.thread = threading.Thread(target=self._loop, args=(work,), daemon=True)

    def _loop(self, work) -> None:
        try:
            while not self.stop.is_set():
                work()
                self.rounds += 1
        except Exception as e:  # reported with the condition's figures
            self.error = f"{type(e).__name__}: {e}"

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.per_s = self.rounds / (time.perf_counter() - self.t0)


def alone(work, seconds: float = 3.0) -> float:
    """Rounds per second of ``work`` by itself (after one untimed round)."""
    work()
    t0, rounds = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        work()
        rounds += 1
    return rounds / (time.perf_counter() - t0)


def nvimgcodec_work(blobs: list[np.ndarray], priority: int):
    """One batched nvImageCodec decode of ``blobs`` on a stream of ours of ``priority``,
    waited for; None where nvImageCodec is not installed."""
    try:
        from nvidia import nvimgcodec
    except ImportError:
        return None
    kinds = (nvimgcodec.BackendKind.HW_GPU_ONLY, nvimgcodec.BackendKind.HYBRID_CPU_GPU)
    try:  # the hardware engines, then nvjpeg's CUDA decoder (GPU_ONLY failed here once)
        with filtered(_LIBRARY_LINES):  # the optional codecs it did not find
            decoder = nvimgcodec.Decoder(
                device_id=torch.cuda.current_device(),
                backends=[nvimgcodec.Backend(kind) for kind in kinds],
            )
    except Exception as e:  # reported, and the other conditions still run
        print(f"nvimgcodec: no decoder ({type(e).__name__}: {e})", flush=True)
        return None
    stream = torch.cuda.Stream(priority=priority)

    def work() -> None:
        images = decoder.decode([nvimgcodec.CodeStream(b) for b in blobs],
                                cuda_stream=stream.cuda_stream)  # fmt: skip
        assert all(image is not None for image in images)
        stream.synchronize()

    return work


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=8, help="untimed steps first")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--only", default=",".join(CONDITIONS))
    ap.add_argument("--dali", default="", help="DALI stage settings (module docstring)")
    ap.add_argument(
        "--train-priority", type=int, default=0,
        help="N > 0: every condition trains on a stream of priority -N (higher than the "
        "default stream's and DALI's), to see whether the GPU then serves the model first",
    )  # fmt: skip
    args = ap.parse_args()
    if args.train_priority:
        torch.cuda.set_stream(torch.cuda.Stream(priority=-args.train_priority))
    only = args.only.split(",")
    dali = [s for s in args.dali.split(",") if s]
    step = step_fn(args.model)
    x = torch.randn(256, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (256,), device="cuda")
    synthetic = itertools.repeat((x, y))
    out = {"model": args.model}

    def say(name: str) -> None:
        print(name, out[name], flush=True)

    if "synthetic" in only:
        out["synthetic"] = run(step, synthetic, args.steps)
        say("synthetic")
    if "synthetic+gil" in only:
        a = np.random.default_rng(0).random(1000)
        with Side(lambda: float(np.sort(a)[0])) as side:
            out["synthetic+gil"] = run(step, synthetic, args.steps)
        out["synthetic+gil"]["side_per_s"] = round(side.per_s)
        say("synthetic+gil")

    st = Store(args.store)
    raw = [np.frombuffer(st.image(i)[0], dtype=np.uint8) for i in range(256)]
    blobs = [torch.from_numpy(b.copy()) for b in raw]
    from torchvision.io import ImageReadMode, decode_jpeg

    wanted = {name.removeprefix("synthetic+") for name in only}  # nvImageCodec's decoders
    sides = {  # made only where asked for: they load its extensions, which print
        "decode": lambda: decode_jpeg(blobs, mode=ImageReadMode.RGB, device="cuda"),
        "nvimgcodec": nvimgcodec_work(raw, priority=0) if "nvimgcodec" in wanted else None,
        "nvimgcodec-hi": nvimgcodec_work(raw, priority=-1) if "nvimgcodec-hi" in wanted else None,
    }
    for name in ("decode", "nvimgcodec"):
        if name in only and sides[name] is not None:
            try:
                out[name] = {"decoded_per_s": round(256 * alone(sides[name]))}
            except Exception as e:  # reported; the other conditions still run
                out[name] = {"error": f"{type(e).__name__}: {e}"}
            say(name)
    for name in ("decode", "nvimgcodec", "nvimgcodec-hi"):
        key = f"synthetic+{name}"
        if key in only and sides[name] is not None:
            with Side(sides[name]) as side:
                out[key] = run(step, synthetic, args.steps)
            out[key]["decoded_per_s"] = round(256 * side.per_s)
            if side.error:
                out[key]["error"] = side.error
            say(key)

    for name, interval, share in (("fed", None, 0.0), ("fed-0.3", None, 0.3),
                                  ("fed+switch", 2e-4, 0.0)):  # fmt: skip
        if name not in only:
            continue
        old = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        dl = loader.DataLoader(args.store, batch_size=256, shuffle=True, drop_last=True,
                               num_workers=args.workers, transform="train",
                               dtype=torch.bfloat16, channels_last=True, device="cuda",
                               decoder="nvjpeg", cpu_share=share,
                               persistent_workers=True)  # fmt: skip

        out[name] = run(step, chain.from_iterable(repeat(dl)), args.steps)
        out[name]["ms_per_batch"] = per_batch(dl)
        say(name)
        dl.close()
        sys.setswitchinterval(old)
    for setting in dali:
        name = f"dali:{setting}"
        dl, restore = dali_fed(args.store, args.workers, setting)
        gaps = record_trials(dl._gpu_stage.picker)
        try:
            cpu0 = tree_cpu_seconds()
            t0 = time.perf_counter()
            out[name] = run(step, chain.from_iterable(repeat(dl)), args.steps, args.warmup)
            busy = (tree_cpu_seconds() - cpu0) / (time.perf_counter() - t0)
            out[name]["cores_busy"] = round(busy, 2)
            out[name]["ms_per_batch"] = per_batch(dl)
            stats = dl.stats()
            out[name]["cuda_batches"] = round(
                stats.get("dali_cuda_batches", 0) / stats["batches"], 3
            )
            out[name]["starved"] = round(stats.get("starved_handoffs", 0) / stats["batches"], 3)
            out[name]["way"] = (stats.get("way"), stats.get("way_trials"))
            # The share of the ways with one, and of the way kept (0 on a way without).
            out[name]["cpu_share"] = round(dl._gpu_stage.producer.cpu_share, 3)
            out[name]["kept_share"] = round(stats["cpu_share"], 3)
            picker = dl._gpu_stage.picker
            if picker is not None:  # each trial: its cause, hand-offs so far, the way kept,
                # and by way the ms between batches handed off and between batches finished
                out[name]["trials"] = [t.report() for t in picker.history]
                # each trial's counted gaps by way: handed off, then finished
                out[name]["trial_gaps"] = [
                    {w: (spread(handed[w]), spread(made.get(w, []))) for w in handed}
                    for handed, made in gaps
                ]
        except Exception as e:  # reported; the other settings still run
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            dl.close()
            restore()
        say(name)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

"""Why does a model train slower when fed by the GPU path than the wait for data explains?

Runs ResNet-50 (bf16 autocast, channels_last, SGD, batch 256) for a fixed number of steps
in one process, under each condition below, and prints img/s, the share of step time the
loop waited in ``next()`` and NVML's GPU utilisation:

- ``synthetic``: one batch already on the GPU (the ceiling);
- ``synthetic+gil``: the same with a Python thread doing small numpy work without pause
  (how much a busy Python thread beside the loop costs it);
- ``synthetic+decode``: the same with a thread calling torchvision's batched nvjpeg decode
  on 256 JPEGs in a loop (the GPU decoder's own cost);
- ``fed``: fed by ``loader.DataLoader(decoder="nvjpeg", cpu_share=0)``, with the prefetch
  thread's CPU time per batch from ``dl.stats()``;
- ``fed+switch``: the same with ``sys.setswitchinterval(2e-4)`` (GIL hand-offs 25x sooner).

    python3 benchmarks/diagnose_training.py STORE [--steps 40] [--workers 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
import torchvision

import loader
from loader.store import Store


def step_fn():
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def run(step, batches, steps: int, warmup: int = 8) -> dict:
    util = []
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    torch.cuda.synchronize()
    t0, waited, n = time.perf_counter(), 0.0, 0
    for k in range(steps):
        w = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - w
        step(x, y)
        n += x.shape[0]
        if k % 5 == 0:
            util.append(torch.cuda.utilization())
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": round(n / wall, 1), "wait_share": round(waited / wall, 3),
            "gpu_util": round(float(np.mean(util)), 1) if util else None}  # fmt: skip


class Side:
    """A background thread running ``work`` until stopped; counts its rounds."""

    def __init__(self, work) -> None:
        self.stop, self.rounds = threading.Event(), 0
        self.thread = threading.Thread(target=self._loop, args=(work,), daemon=True)

    def _loop(self, work) -> None:
        while not self.stop.is_set():
            work()
            self.rounds += 1

    def __enter__(self):
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.per_s = self.rounds / (time.perf_counter() - self.t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    step = step_fn()
    x = torch.randn(256, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    x = x.contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (256,), device="cuda")
    synthetic = itertools.repeat((x, y))
    out = {"synthetic": run(step, synthetic, args.steps)}
    print("synthetic", out["synthetic"], flush=True)

    a = np.random.default_rng(0).random(1000)
    with Side(lambda: float(np.sort(a)[0])) as side:
        out["synthetic+gil"] = run(step, synthetic, args.steps)
    out["synthetic+gil"]["side_per_s"] = round(side.per_s)
    print("synthetic+gil", out["synthetic+gil"], flush=True)

    st = Store(args.store)
    blobs = [torch.frombuffer(bytearray(st.image(i)[0]), dtype=torch.uint8) for i in range(256)]
    from torchvision.io import ImageReadMode, decode_jpeg

    with Side(lambda: decode_jpeg(blobs, mode=ImageReadMode.RGB, device="cuda")) as side:
        out["synthetic+decode"] = run(step, synthetic, args.steps)
    out["synthetic+decode"]["decoded_per_s"] = round(256 * side.per_s)
    print("synthetic+decode", out["synthetic+decode"], flush=True)

    for name, interval in (("fed", None), ("fed+switch", 2e-4)):
        old = sys.getswitchinterval()
        if interval:
            sys.setswitchinterval(interval)
        dl = loader.DataLoader(args.store, batch_size=256, shuffle=True, drop_last=True,
                               num_workers=args.workers, transform="train",
                               dtype=torch.bfloat16, channels_last=True, device="cuda",
                               decoder="nvjpeg", cpu_share=0.0,
                               persistent_workers=True)  # fmt: skip

        def forever(dl=dl):
            while True:
                yield from dl

        out[name] = run(step, forever(), args.steps)
        stats = dl.stats()
        per_batch = {k: round(1000 * stats[k] / stats["batches"], 2)
                     for k in ("prefetch_cpu_s", "gpu_decode_s", "augment_s", "wait_s",
                               "stage_wait_s", "stage_busy_s") if k in stats}  # fmt: skip
        out[name]["ms_per_batch"] = per_batch
        print(name, out[name], flush=True)
        dl.close()
        sys.setswitchinterval(old)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

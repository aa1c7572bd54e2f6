"""Which decoders add up: GPU decode rates alone and side by side, on one store's JPEGs.

The loader's GPU decoders share the GPU's hardware JPEG engines: torchvision's nvjpeg
sends every baseline JPEG there, and DALI sends ``hw_decoder_load`` of them there (the rest
to its CUDA decoder, whose Huffman stage runs on its CPU threads). This measures, with the
bytes in RAM and batches of the sampler's crop windows:

- torchvision from 1 and 2 threads, back to back (the loader calls it from 2);
- DALI's ``image_slice`` in a pipelined, asynchronous pipeline fed ``DEPTH`` batches ahead
  (as DALI's own loaders run), for several engine shares and thread counts;
- torchvision and DALI at once, each taking a share of every batch: the split that keeps
  every decoder busy, if the sum beats either alone.

    python3 benchmarks/gpu_split.py STORE [--batches 40] [--out gpu-split.json]
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np
import torch

from benchmarks.gpu_decoders import from_threads, setup, sync
from loader.decode import get_decoder
from loader.gpu.dali_decode import copy_into

DEPTH = 2


class AsyncDali:
    """DALI's image_slice in an asynchronous, pipelined pipeline, fed DEPTH batches ahead;
    each output copied into one torch buffer before the pipeline may reuse it."""

    def __init__(self, batch: int, threads: int, load: float, device: torch.device) -> None:
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(
            batch_size=batch, num_threads=threads, device_id=device.index or 0,
            prefetch_queue_depth=DEPTH, exec_async=True, exec_pipelined=True,
        )  # fmt: skip
        def graph():
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
            return fn.decoders.image_slice(
                jpegs, anchor, shape, device="mixed", output_type=types.RGB, axis_names="WH",
                normalized_anchor=False, normalized_shape=False, hw_decoder_load=load,
            )  # fmt: skip

        self.pipe = graph()
        self.pipe.build()
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.first = True

    def feed(self, data, windows) -> None:
        w = np.asarray(windows, dtype=np.float32)
        self.pipe.feed_input("jpegs", [t.numpy() for t in data])
        self.pipe.feed_input("anchor", np.ascontiguousarray(w[:, [1, 0]]))
        self.pipe.feed_input("shape", np.ascontiguousarray(w[:, [3, 2]]))

    def take(self) -> torch.Tensor:
        (out,) = self.pipe.outputs()
        size = sum(int(np.prod(s)) for s in out.shape())
        buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        copy_into(buffer, out, self.stream)
        self.stream.synchronize()  # before the next outputs() lets DALI reuse its buffers
        return buffer

    def run(self, work) -> int:
        """Decode every batch of ``work``, DEPTH ahead; images decoded. (A pipelined
        pipeline's first ``schedule_run`` runs DEPTH iterations: it needs DEPTH batches.)"""
        pending = 0
        for data, windows in work:
            if pending == DEPTH:
                self.take()
                pending -= 1
            self.feed(data, windows)
            pending += 1
            if not self.first:
                self.pipe.schedule_run()
            elif pending == DEPTH:
                self.pipe.schedule_run()
                self.first = False
        for _ in range(pending):
            self.take()
        return sum(len(d) for d, _ in work)


def timed(fn, device) -> float:
    """img/s of ``fn()``, which returns the images it decoded."""
    sync(device)
    t0 = time.perf_counter()
    n = fn()
    sync(device)
    return n / (time.perf_counter() - t0)


def torchvision_threads(nvjpeg, work, threads: int) -> int:
    """Decode ``work`` (whole images) from ``threads`` threads; images decoded."""
    return from_threads(lambda data, _windows: nvjpeg.decode_batch(data), work, threads)


def split(work, share: float):
    """Each batch cut in two: (torchvision's part, DALI's part), DALI taking ``share``."""
    mine, theirs = [], []
    for data, windows in work:
        k = round(len(data) * (1 - share))
        mine.append((data[:k], windows[:k]))
        theirs.append((data[k:], windows[k:]))
    return mine, theirs


def side_by_side(nvjpeg, pipe: AsyncDali, work, share: float) -> int:
    """torchvision (2 threads) and DALI at once, DALI taking ``share`` of every batch."""
    mine, theirs = split(work, share)
    done = {}
    thread = threading.Thread(target=lambda: done.setdefault("dali", pipe.run(theirs)))
    thread.start()
    n = torchvision_threads(nvjpeg, mine, 2)
    thread.join()
    return n + done["dali"]


def main() -> None:
    a, device, work = setup(__doc__, "gpu-split.json")
    nvjpeg = get_decoder("nvjpeg", device=device)
    results = []

    def report(name: str, r: float, **extra) -> None:
        results.append({"setting": name, "img_s": round(r), **extra})
        print(f"{name:44s} {r:9,.0f} img/s", flush=True)

    torchvision_threads(nvjpeg, work[:2], 2)  # warm-up
    for threads in (1, 2, 1, 2):
        report(f"torchvision, {threads} thread(s)", timed(
            lambda t=threads: torchvision_threads(nvjpeg, work, t), device))  # fmt: skip
    halves = zip(work[::2], work[1::2], strict=False)
    pairs = [(a + b, np.concatenate([v, w])) for (a, v), (b, w) in halves]
    report("torchvision, 1 thread, 512 per call", timed(
        lambda: torchvision_threads(nvjpeg, pairs, 1), device))  # fmt: skip
    pipes = {}
    for load in (0.0, 0.65, 1.0):
        for threads in (4, 8, 12):
            pipes[load, threads] = pipe = AsyncDali(a.batch_size, threads, load, device)
            pipe.run(work[:3])  # warm-up
            report(f"DALI async, hw={load} threads={threads}", timed(
                lambda p=pipe: p.run(work), device))  # fmt: skip
    for load, threads in ((0.0, 8), (0.0, 12), (0.65, 8), (1.0, 4)):
        pipe = pipes[load, threads]
        for share in (0.25, 0.4, 0.5):
            name = f"torchvision x2 + DALI hw={load} t={threads}, {share:.0%}"
            report(name, timed(lambda p=pipe, s=share: side_by_side(nvjpeg, p, work, s), device))
    Path(a.out).write_text(json.dumps({"batch_size": a.batch_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()

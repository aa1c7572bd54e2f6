"""GPU decoders alone on one store's JPEGs, batch by batch, as the loader calls them.

For each setting: torchvision's nvjpeg decoding whole images, and DALI decoding only the
RandomResizedCrop windows the sampler draws (hardware engine share and CPU threads
varied). Bytes are read into RAM first; each timed batch ends with a device
synchronisation. Prints one line per setting and writes JSON.

    python3 benchmarks/gpu_decoders.py STORE [--batches 40] [--out gpu-decoders.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import numpy as np
import torch

from ingest import format as fmt
from loader.augment import Transform, plan_crops
from loader.decode import get_decoder
from loader.store import Store


def planned(store: Store, batch: int, count: int, seed: int = 0) -> list:
    """``count`` batches of baseline JPEGs drawn at random: (the JPEGs' bytes, their crop
    rows for the train transform at 224 px)."""
    index = store.index
    jpeg = (index["format"] == fmt.FORMAT_CODES["jpeg"]) & (
        index["flags"] & fmt.FLAG_PROGRESSIVE == 0
    )
    rng = np.random.default_rng(seed)
    chosen = rng.permutation(np.flatnonzero(jpeg))[: batch * count]
    out = []
    for k in range(0, len(chosen) - batch + 1, batch):
        idx = chosen[k : k + batch]
        crops = plan_crops(Transform("train", 224), index["height"][idx], index["width"][idx], rng)
        out.append(([store.image(int(i))[0] for i in idx], crops))
    return out


def batches(store: Store, batch: int, count: int, seed: int = 0) -> list:
    """``count`` batches of (encoded tensors, windows) of baseline JPEGs, in RAM."""
    return [
        ([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs], crops[:, :4])
        for blobs, crops in planned(store, batch, count, seed)
    ]


def sync(device: torch.device) -> None:
    """Wait for the device's work (nothing to wait for on the CPU, in dry runs)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate(decode, work, device) -> float:
    """img/s of ``decode(data, windows)`` over ``work`` after a warm-up on its first batch
    (pipelines, allocations), which is not counted."""
    decode(*work[0])
    sync(device)
    t0 = time.perf_counter()
    for data, windows in work[1:]:
        decode(data, windows)
    sync(device)
    return sum(len(d) for d, _ in work[1:]) / (time.perf_counter() - t0)


def from_threads(decode, work, threads: int) -> int:
    """``decode(data, windows)`` every batch of ``work`` from ``threads`` threads taking
    batches in turn, back to back, as the loader's decode threads call it; images decoded."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: decode(*item), work))
    return sum(len(d) for d, _ in work)


def setup(doc: str, out: str) -> tuple[argparse.Namespace, torch.device, list]:
    """The decoder benchmarks' command line (STORE, --batch-size, --batches, --out), the
    CUDA device and the store's batches in RAM."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("store")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--out", default=out)
    a = ap.parse_args()
    return a, torch.device("cuda"), batches(Store(a.store), a.batch_size, a.batches)


def main() -> None:
    a, device, work = setup(__doc__, "gpu-decoders.json")
    results = []
    nvjpeg = get_decoder("nvjpeg", device=device)
    settings = [("nvjpeg", "whole image", lambda d, w: nvjpeg.decode_batch(d))]
    for load in (0.5, 0.75, 0.9, 1.0):
        for threads in (2, 4, 8):
            dali = get_decoder(
                "dali",
                device=device,
                batch_size=a.batch_size,
                threads=threads,
                hw_decoder_load=load,
            )
            settings.append((f"dali hw={load} threads={threads}", "crop window", dali.decode_batch))
    for name, what, decode in settings:
        r = rate(decode, work, device)
        results.append({"decoder": name, "decodes": what, "img_s": round(r)})
        print(f"{name:28s} {what:12s} {r:9,.0f} img/s", flush=True)
    Path(a.out).write_text(json.dumps({"batch_size": a.batch_size, "results": results}, indent=1))


if __name__ == "__main__":
    main()

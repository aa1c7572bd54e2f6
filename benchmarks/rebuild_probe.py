"""Where the memory of a loader closed and built again goes (the soak's preemptions).

For each decoder: a loader reads ``--warm`` epochs, then ``--rebuilds`` times is closed
mid-epoch, built again from its state and read to the end of that epoch and one more, as
``benchmarks/soak.py`` does. After each rebuild: device memory in use (everything the
process holds), torch's allocated and reserved device memory, torch's pinned host memory
(its caching host allocator), the PSS of the process, and the loader objects still alive;
then the same after ``gc.collect()``, and with ``--release-each`` after DALI's
``ReleaseUnusedMemory`` and torch's ``empty_cache`` (what pools hold, not what is leaked);
at the end, closed, the same before and after glibc's ``malloc_trim`` (host memory freed
but kept by malloc's arenas, not leaked). Host memory is split as ``soak.pss_parts`` and
``soak.heap`` split it (this process's anonymous PSS, malloc's bytes in use and free).
Without it the rows add up over the rebuilds, as in a training run; with it each shows
one rebuild's cost (``gpu-h200-rebuild-probe.json`` was taken with it).

Usage (the GPU machine: ``benchmarks/gpu_run.sh rebuild``):
    python3 benchmarks/rebuild_probe.py STORE --decoders dali,nvjpeg --out rebuild.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak import device_mib, heap, pss_parts

import loader
import loader.gpu.stage
from loader.hostmem import trim_heap

_WATCHED = ("DataLoader", "GpuStage", "DaliStage", "_Pipeline", "Pipeline", "DaliDecoder",
            "GpuEpochIterator", "EpochIterator", "HostRing", "Workers")  # fmt: skip


def live() -> dict[str, int]:
    """How many objects of the watched classes are alive (tracked by the collector)."""
    counts: dict[str, int] = {}
    for obj in gc.get_objects():
        name = type(obj).__name__
        if name in _WATCHED:
            counts[name] = counts.get(name, 0) + 1
    return counts


def measure(device: torch.device) -> dict:
    out = pss_parts() | heap()
    if device.type != "cuda":
        return out
    out |= {
        "device_mib": device_mib(device),
        "torch_allocated_mib": round(torch.cuda.memory_allocated(device) / (1 << 20), 1),
        "torch_reserved_mib": round(torch.cuda.memory_reserved(device) / (1 << 20), 1),
    }
    return out  # torch's pinned host memory: heap()'s pinned_mib


def streams_of(dl) -> str:
    stage = dl._gpu_stage
    if stage is None:  # decoder="cpu"
        return "no streams"
    return f"streams {id(stage.stream):x} {id(stage.decode_stream):x}"


def release_pools(device: torch.device) -> None:
    if device.type != "cuda":
        return
    try:
        from nvidia.dali import backend

        fn = getattr(backend, "ReleaseUnusedMemory", None)
        if fn is not None:
            fn()
    except ImportError:
        pass
    torch.cuda.empty_cache()


def probe(a: argparse.Namespace, decoder: str, device: torch.device) -> list[dict]:
    def make() -> loader.DataLoader:
        return loader.DataLoader(
            a.store, batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
            persistent_workers=True, transform=loader.Transform("train", a.size),
            dtype=torch.bfloat16, channels_last=True, device=device, decoder=decoder,
            cpu_share=0.0, seed=0,
        )  # fmt: skip

    rows = []
    dl = make()
    for epoch in range(a.warm):
        dl.set_epoch(epoch)
        for _ in dl:
            pass
    for r in range(a.rebuilds):
        epoch = a.warm + 2 * r
        dl.set_epoch(epoch)
        it = iter(dl)
        for _ in range(len(dl) // 2):
            next(it)
        state = json.loads(json.dumps(dl.state_dict()))
        dl.close()
        del it
        dl = make()
        dl.load_state_dict(state)
        dl.set_epoch(epoch)
        for _ in dl:
            pass
        dl.set_epoch(epoch + 1)
        for _ in dl:
            pass
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        row = {"decoder": decoder, "rebuild": r + 1, "as_is": measure(device), "live": live()}
        gc.collect()
        row["after_gc"] = measure(device)
        row["live_after_gc"] = live()
        if a.release_each:
            release_pools(device)
            row["after_release"] = measure(device)
        rows.append(row)
        print(streams_of(dl), json.dumps(row), flush=True)
    dl.close()
    del dl
    gc.collect()
    release_pools(device)
    rows.append({"decoder": decoder, "closed": measure(device), "live": live()})
    trim_heap()  # what stays was in use, or kept by another allocator
    rows[-1]["after_trim"] = measure(device)
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--decoders", default="dali,nvjpeg")
    ap.add_argument("--rebuilds", type=int, default=5)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=min(16, len(os.sched_getaffinity(0))))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--streams", default="pooled,new", help="pooled (lent again), new (as before)")
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--release-each", action="store_true", help="empty the pools each time")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    rows = [{"start": measure(device)}]
    pool = loader.gpu.stage._STREAMS
    for streams in a.streams.split(","):
        # "new": each stage its own streams, as before the pool (nothing is given back).
        if streams == "new":
            pool.give_back = lambda lent: None
        else:
            pool.__dict__.pop("give_back", None)
        for decoder in a.decoders.split(","):
            rows += [row | {"streams": streams} for row in probe(a, decoder, device)]
            a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

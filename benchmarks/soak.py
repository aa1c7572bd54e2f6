"""A long run of the loader as a training job meets it, to catch what only time shows.

Epochs back to back, a model trained on every batch (``--model``), and every
``--resume-every`` epochs a preemption halfway through one: ``state_dict()`` through JSON,
the loader closed, a new one built, ``load_state_dict()``, the rest of the epoch. After
every epoch: whether each sample came exactly once with its stored label (across the
preemption too), images not finite (float outputs), host memory (PSS of this process and
its workers, so that pages shared with the workers or the cache count once; and apart,
its anonymous part, where a leak shows, and its part mapped from the store and the shm
cache, which grows up to their size as the processes touch their pages), device
memory (and torch's share of it), open file descriptors, threads and child processes,
the way kept and the trials so far (``loader.gpu.tuning.picker``), and the lines that reached fd 2
(none should: the loader turns C libraries' output into counts). Written to ``--out``
every ``WRITE_EVERY_S`` seconds, so that a run cut short keeps what it saw.

Usage (the GPU machine: ``benchmarks/gpu_run.sh soak``):
    python3 benchmarks/soak.py STORE --seconds 300 --device cuda --cpu-share auto \\
        --model resnet18 --batch-size 64 --workers 16 --out soak.json

Exits 1 when a sample was lost, repeated or mislabelled, an image was not finite, or a
line reached fd 2; growth (memory, descriptors, threads) is reported, not judged (a cache
filling is growth too).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import loader
from loader.bench.train import model_step
from loader.telemetry.proctree import descendants

WRITE_EVERY_S = 10.0  # the report is written at most this often while it runs, and at the end
WARM_EPOCHS = 2  # memory growth is counted from the end of this epoch (pools, cache filled)


class Stderr:
    """fd 2 becomes a pipe whose lines are counted (the first few kept)."""

    def __init__(self) -> None:
        read, write = os.pipe()
        self.saved = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self.lines: list[str] = []
        self.count = 0
        self.thread = threading.Thread(target=self._read, args=(read,), daemon=True)
        self.thread.start()

    def _read(self, fd: int) -> None:
        with os.fdopen(fd, "rb") as f:
            for line in f:
                self.count += 1
                if len(self.lines) < 20:
                    self.lines.append(line.decode("utf-8", "replace").rstrip()[:200])

    def close(self) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)  # the pipe's last writer goes: the reader sees its end
        os.close(self.saved)
        self.thread.join(timeout=5)


PSS_PARTS = {"Pss:": "pss_mib", "Pss_Anon:": "pss_anon_mib", "Pss_File:": "pss_mapped_mib",
             "Pss_Shmem:": "pss_mapped_mib"}  # fmt: skip


def pss_parts() -> dict[str, float]:
    """PSS of this process and its descendants (MiB; those gone meanwhile count 0): in all,
    its anonymous part (the heaps, pools, arrays: where a leak shows), and its part
    mapped from files and shared memory (the store's and the shm cache's pages, which
    grow as the processes touch more of them, up to their size); and this process's
    anonymous memory alone (``anon_main_mib``, resident, whether or not forked workers
    share its pages: a new loader's workers replace theirs, never this)."""
    total = dict.fromkeys(PSS_PARTS.values(), 0.0)
    main = 0.0
    for pid in (os.getpid(), *descendants()):
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    key, *rest = line.split()
                    if key in PSS_PARTS:
                        total[PSS_PARTS[key]] += int(rest[0]) / 1024
                    elif key == "Anonymous:" and pid == os.getpid():
                        main = int(rest[0]) / 1024
        except OSError:
            continue
    return {k: round(v, 1) for k, v in total.items()} | {"anon_main_mib": round(main, 1)}


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]  # fmt: skip


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):  # not glibc, or glibc before 2.33
        return None
    fn.restype = _Mallinfo2
    return fn


MALLINFO2 = _mallinfo2()


def heap() -> dict[str, float | int | None]:
    """This process's heaps, to tell where its anonymous memory goes: glibc malloc's bytes
    in use and free in its arenas, and in chunks of their own mapping (MiB; None without
    glibc 2.33), Python's allocated blocks (a leak of Python objects grows them), and
    the pinned host memory torch's caching allocator holds (MiB; None on the CPU)."""
    out: dict[str, float | int | None] = dict.fromkeys(
        ("malloc_used_mib", "malloc_free_mib", "malloc_mmap_mib")
    )
    if MALLINFO2 is not None:
        m = MALLINFO2()
        out = {"malloc_used_mib": round(m.uordblks / (1 << 20), 1),
               "malloc_free_mib": round(m.fordblks / (1 << 20), 1),
               "malloc_mmap_mib": round(m.hblkhd / (1 << 20), 1)}  # fmt: skip
    out["py_blocks"] = sys.getallocatedblocks()
    pinned = None
    if torch.cuda.is_initialized() and hasattr(torch.cuda, "host_memory_stats"):
        stats = torch.cuda.host_memory_stats()
        held = stats.get("allocated_bytes.current", stats.get("reserved_bytes.current"))
        pinned = None if held is None else round(held / (1 << 20), 1)
    out["pinned_mib"] = pinned
    return out


def census() -> Counter:
    """How many objects of each type the collector tracks (by type name)."""
    return Counter(type(o).__name__ for o in gc.get_objects())


def held() -> dict[str, int]:
    """What this process holds that a leak would pile up: open file descriptors, threads,
    and descendant processes (the workers, alive or not yet reaped)."""
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": threading.active_count(),
            "children": len(descendants())}  # fmt: skip


def device_mib(device: torch.device) -> float | None:
    """Device memory in use (MiB), everything this process holds (DALI's pools too)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return round((total - free) / (1 << 20), 1)


def torch_reserved_mib(device: torch.device) -> float | None:
    """Device memory torch's caching allocator holds (MiB): of ``device_mib``, what is
    torch's (the rest: DALI's pools, the decoders', the CUDA context)."""
    if device.type != "cuda":
        return None
    return round(torch.cuda.memory_reserved(device) / (1 << 20), 1)


def trainer(name: str, device: torch.device):
    """The training checks' step of ``name`` on a batch (``loader.bench.train``);
    ``None``: the batches are only read."""
    return None if name == "none" else model_step(name, device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("store")
    ap.add_argument("--seconds", type=float, default=300, help="run until then (whole epochs)")
    ap.add_argument("--epochs", type=int, default=0, help="at most this many (0: no bound)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--decoder", default="auto")
    ap.add_argument("--cpu-share", default="auto")
    ap.add_argument("--model", default="resnet18", help="a torchvision model, or none")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", type=int, default=224, help="the output's side")
    ap.add_argument("--cache", default=None, help="the loader's cache (shm), none by default")
    ap.add_argument("--resume-every", type=int, default=5, help="0: no preemption")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    err = Stderr()
    try:
        report, resumes, seconds = soak(a, device, err)
    finally:
        err.close()  # a traceback reaches the terminal
    result = summary(report, resumes, seconds) | {"stderr": err.lines}
    result["objects_grown"] = report.get("objects_grown")
    write(a.out, report, result)
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def soak(a: argparse.Namespace, device: torch.device, err: Stderr) -> tuple[dict, int, float]:
    """The run: its report (written to ``a.out`` as it goes), the preemptions, and its
    seconds."""
    share = a.cpu_share if a.cpu_share == "auto" else float(a.cpu_share)

    def make() -> loader.DataLoader:
        return loader.DataLoader(
            a.store, batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
            persistent_workers=a.workers > 0, transform=loader.Transform("train", a.size),
            dtype=a.dtype, channels_last=True, device=device, decoder=a.decoder,
            cpu_share=share,
            cache=a.cache, with_indices=True, seed=0,
        )  # fmt: skip

    step = trainer(a.model, device)
    dl = make()
    n = len(dl.store)
    stored = torch.as_tensor(np.asarray(dl.store.labels), device=device)
    report = {
        "what": __doc__.splitlines()[0],
        "settings": vars(a),
        "images": n,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cores": len(os.sched_getaffinity(0)),
        "epochs": [],
    }
    t0 = time.perf_counter()
    deadline = t0 + a.seconds
    written = t0
    epoch, resumes = 0, 0
    while time.perf_counter() < deadline and not (a.epochs and epoch >= a.epochs):
        start = time.perf_counter()
        seen = np.zeros(n, np.int64)
        images = 0
        # Counted on the device: no wait for the GPU at each step, as in a training loop.
        mislabelled = torch.zeros((), dtype=torch.int64, device=device)
        nonfinite = torch.zeros((), dtype=torch.int64, device=device)
        preempt = a.resume_every and epoch % a.resume_every == a.resume_every - 1
        dl.set_epoch(epoch)
        it, taken, resumed = iter(dl), 0, False
        while True:
            if preempt and not resumed and taken == len(dl) // 2:
                state = json.loads(json.dumps(dl.state_dict()))  # as a checkpoint keeps it
                dl.close()
                dl = make()
                dl.load_state_dict(state)
                dl.set_epoch(epoch)
                it, resumed = iter(dl), True
                resumes += 1
            batch = next(it, None)
            if batch is None:
                break
            x, y, idx = batch
            np.add.at(seen, idx.numpy(), 1)
            mislabelled += (y.to(device) != stored[idx.to(device)]).sum()
            if x.is_floating_point():
                nonfinite += (~torch.isfinite(x)).sum()
            if step is not None:
                step(x, y)
            images += len(idx)
            taken += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took = time.perf_counter() - start
        stats = dl.stats()
        routing = getattr(dl._gpu_stage, "routing", None)
        picker = getattr(dl._gpu_stage, "picker", None)
        report["epochs"].append(
            {
                "epoch": epoch,
                "seconds": round(took, 3),
                "img_s": round(images / took, 1),
                "exactly_once": bool((seen == 1).all()),
                "missing": int((seen == 0).sum()),
                "repeated": int((seen > 1).sum()),
                "mislabelled": int(mislabelled),
                "nonfinite": int(nonfinite),
                "preempted": bool(preempt),
                **pss_parts(),
                **heap(),
                **held(),
                "device_mib": device_mib(device),
                "torch_reserved_mib": torch_reserved_mib(device),
                "stderr_lines": err.count,
                "way": stats.get("way"),
                "cpu_share": stats.get("cpu_share"),
                "way_trials": stats.get("way_trials"),
                # Ways remembered for batches planned, not started; not handed off.
                "planned": None if routing is None else routing.pending,
                "picker_in_flight": None if picker is None else len(picker._in_flight),
            }
        )
        if epoch == WARM_EPOCHS:
            first = census()
        epoch += 1
        if time.perf_counter() - written > WRITE_EVERY_S:  # the whole report: not each epoch
            write(a.out, report, summary(report, resumes, time.perf_counter() - t0))
            written = time.perf_counter()
    if epoch > WARM_EPOCHS:  # the types of objects that grew in number since the warm epochs
        grown = census()
        grown.subtract(first)
        report["objects_grown"] = dict(grown.most_common(12))
    dl.close()
    return report, resumes, time.perf_counter() - t0


def summary(report: dict, resumes: int, seconds: float) -> dict:
    """The run's verdict: correctness (every epoch) and memory growth past the warm epochs."""
    epochs = report["epochs"]
    quarter = max(1, (len(epochs) - WARM_EPOCHS) // 4)
    early, late = epochs[WARM_EPOCHS : WARM_EPOCHS + quarter], epochs[-quarter:]

    def growth(key: str) -> float | None:
        """The median of the last quarter of the epochs less that of the first past the
        warm ones: a trend, not the ups and downs of workers' pages and pools."""
        if not early or early[0].get(key) is None:
            return None
        med = [float(np.median([e[key] for e in part])) for part in (early, late)]
        return round(med[1] - med[0], 1)

    wrong = ("missing", "repeated", "mislabelled", "nonfinite")
    bad = [e["epoch"] for e in epochs if any(e[k] for k in wrong)]
    last = epochs[-1] if epochs else {}
    stderr = last.get("stderr_lines", 0)
    return {
        "epochs": len(epochs),
        "seconds": round(seconds, 1),
        "resumes": resumes,
        "bad_epochs": bad,
        "stderr_lines": stderr,
        "pss_growth_mib": growth("pss_mib"),
        "pss_anon_growth_mib": growth("pss_anon_mib"),
        "device_growth_mib": growth("device_mib"),
        "torch_reserved_growth_mib": growth("torch_reserved_mib"),
        "fds_growth": growth("fds"),
        "threads_growth": growth("threads"),
        "anon_main_growth_mib": growth("anon_main_mib"),
        "malloc_used_growth_mib": growth("malloc_used_mib"),
        "py_blocks_growth": growth("py_blocks"),
        "pinned_growth_mib": growth("pinned_mib"),
        "ways": sorted({e["way"] for e in epochs if e["way"]}),
        "way_trials": last.get("way_trials"),
        "ok": bool(epochs) and not bad and stderr == 0,
    }


def write(path: str, report: dict, result: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(report | {"summary": result}, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())

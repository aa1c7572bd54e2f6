"""How often a batch of the DALI stage is delivered with pixels not yet written (NaN or
inf in float16), and which change makes it go away.

Once on the H200 (``gpu-h200-tests`` of 2026-12-01), the GPU tests' never-overwritten test
got a batch of the small store whose rows held NaN when delivered; the same test passed in
every run before and after. Each variant here runs the test's loop (three epochs, the
device kept busy after every batch) ``--runs`` times with new seeds and counts the
batches with a non-finite value, read on the training stream as a model would:

- ``as-is``: the loader as shipped;
- ``slots-early``: slots go back to the workers as soon as ``finish`` returns (as before
  the slots were kept until their batch's GPU work is done);
- ``copy-fed``: DALI copies the JPEGs when fed (``dali_stage.NO_COPY`` off);
- ``host-sync``: the host waits for each batch's copy out of DALI before handing it on.

Usage (GPU machine, wheels installed as in ../shared/GPU.md):
    python3 benchmarks/dali_delivery_probe.py [--runs 12] [--variants as-is,slots-early]
        [--out delivery.json] [--device cpu: a dry run]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import pytest
import torch
from gpu_path_data import dali_backend, make_small_store, use_stand_ins
from test_gpu_dali import TRAIN

import loader
import loader.dali_stage as ds
from loader.prefetch import GpuEpochIterator

VARIANTS = ("as-is", "slots-early", "copy-fed", "host-sync")


def early(self, wait: bool = False, every: bool = False) -> None:
    """``_give_back_slots`` that does not wait for the batches' GPU work."""
    while self._in_use:
        self._free.append(self._in_use.popleft()[0])


def synced(copy_out):
    def copy_then_wait(self, out, count, into=None):
        target = copy_out(self, out, count, into)
        if self.stream is not None:  # none on the CPU
            self.stream.synchronize()
        return target

    return copy_then_wait


def variant(name: str):
    """Patch the loader for ``name``; returns the undo."""
    saved = (ds.NO_COPY, ds.DaliStage._copy_out, GpuEpochIterator._give_back_slots)
    if name == "slots-early":
        GpuEpochIterator._give_back_slots = early
    elif name == "copy-fed":
        ds.NO_COPY = False
    elif name == "host-sync":
        ds.DaliStage._copy_out = synced(ds.DaliStage._copy_out)

    def undo() -> None:
        ds.NO_COPY, ds.DaliStage._copy_out, GpuEpochIterator._give_back_slots = saved

    return undo


def one_run(store: Path, seed: int, device: str) -> dict:
    cuda = device.startswith("cuda")
    dl = loader.DataLoader(
        store, batch_size=8, transform=TRAIN, device=device, decoder=dali_backend(),
        with_indices=True, num_workers=2, shuffle=True, seed=seed, dtype=torch.float16,
    )  # fmt: skip
    flags = []
    for e in range(3):
        for k, (images, _labels, _indices) in enumerate(dl):
            flags.append((e, k, (~images.isfinite()).flatten(1).any(1)))
            if cuda:
                torch.cuda._sleep(1_000_000)  # the device busy, as in the test
    if cuda:
        torch.cuda.synchronize()
    stats = dl.stats()
    dl.close()
    bad = [(e, k, rows.nonzero().flatten().tolist()) for e, k, rows in flags if rows.any()]
    keys = ("dali_way", "dali_trials", "dali_cuda_batches", "dali_batches_redone", "batches")
    return {"seed": seed, "bad": bad, **{k: stats.get(k) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script")
    a = ap.parse_args()
    store = make_small_store(Path(tempfile.mkdtemp()))
    use_stand_ins(pytest.MonkeyPatch())  # without CUDA: DALI's CPU operators, as the tests
    gpu = torch.cuda.get_device_name() if a.device.startswith("cuda") else None
    report = {"gpu": gpu, "runs": a.runs, "variants": {}}
    for name in a.variants.split(","):
        undo = variant(name)
        t0, runs = time.perf_counter(), []
        try:
            for r in range(a.runs):
                runs.append(one_run(store, 5 + r, a.device))
                print(name, runs[-1], flush=True)
        finally:
            undo()
        bad_runs = sum(bool(r["bad"]) for r in runs)
        report["variants"][name] = {"runs_with_bad_batches": bad_runs, "runs": runs,
                                    "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(f"{name}: {bad_runs} of {len(runs)} runs delivered a batch with NaN", flush=True)
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

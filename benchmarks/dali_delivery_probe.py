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
- ``host-sync``: the host waits for each batch's copy out of DALI before handing it on;
- ``drop-last``: no partial batch (in the first runs, only the epochs' last batch, 7 of the
  23 samples, came with NaN);
- ``padded``: every batch is fed to DALI whole (a short one padded with copies of its
  first image, whose outputs are dropped);
- ``dali-checked``: the device is synchronised once DALI hands each output over, and that
  output is read back: are the NaN already in DALI's output?

Each bad batch is reported with its rows: which of them DALI decoded (the others the
workers decoded), and, for ``dali-checked``, which rows of DALI's output were not finite.

What it found (``results/gpu-h200-delivery-*.json``): DALI's output was always finite; the
NaN were in DALI's rows of batches put together through a temporary, because DALI copied
its output on the legacy default stream instead of the loader's
(``loader.gpu.dali_decode.copy_into`` says why). With the copy on the loader's stream, no
variant delivered NaN in 48 runs.

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

import numpy as np
import pytest
import torch
from gpu_path_data import dali_backend, make_small_store, use_stand_ins
from test_gpu_dali import TRAIN

import loader
import loader.gpu.dali_stage as ds
from loader.gpu.prefetch import GpuEpochIterator

BATCH = 8
VARIANTS = ("as-is", "slots-early", "copy-fed", "host-sync", "drop-last", "padded", "dali-checked")


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


def recorded(finish, log: list):
    """``finish`` noting, batch by batch in delivery order, (samples, rows DALI decoded)."""

    def finish_noting(self, started, waited=0.0):
        rows = started.gpu_rows.tolist() if isinstance(started, ds.DaliStarted) else []
        log.append({"n": int(started.report.n), "dali_rows": rows, "dali_bad": None})
        return finish(self, started, waited)

    return finish_noting


def checked(output_of, log: list):
    """``_output_of`` that synchronises the device and reads DALI's output back."""

    def output_then_check(self, ticket):
        out = output_of(self, ticket)
        if out is not None and self.device.type == "cuda":
            torch.cuda.synchronize()
            copy = self._copy_out(out, len(out))
            torch.cuda.synchronize()
            bad = (~copy.isfinite()).flatten(1).any(1).nonzero().flatten().tolist()
            log.append(bad)
        return out

    return output_then_check


def padded(ticket_init, batch_size: int):
    """``_Ticket.__init__`` padding a short batch to ``batch_size`` with its first image."""

    def pad(self, encoded, args, kind):
        more = batch_size - len(encoded)
        if more > 0:
            encoded = list(encoded) + [encoded[0]] * more
            args = {k: np.concatenate([v, np.repeat(v[:1], more, axis=0)]) for k, v in args.items()}
        ticket_init(self, encoded, args, kind)

    return pad


def trimmed(copy_out):
    """``_copy_out`` of a padded output: its first ``count`` images."""

    def copy_first(self, out, count, into=None):
        if len(out) == count:
            return copy_out(self, out, count, into)
        whole = copy_out(self, out, len(out))[:count]
        if into is None:
            return whole
        into.copy_(whole)
        return into

    return copy_first


def variant(name: str, log: list, dali_log: list):
    """Patch the loader for ``name`` (``log``: the batches finished, ``dali_log``: DALI's
    outputs checked); returns the undo."""
    stage = ds.DaliStage
    saved = (ds.NO_COPY, stage._copy_out, stage.finish, stage._output_of,
             GpuEpochIterator._give_back_slots, ds._Ticket.__init__)  # fmt: skip
    stage.finish = recorded(stage.finish, log)
    if name == "slots-early":
        GpuEpochIterator._give_back_slots = early
    elif name == "copy-fed":
        ds.NO_COPY = False
    elif name == "host-sync":
        stage._copy_out = synced(stage._copy_out)
    elif name == "padded":
        ds._Ticket.__init__ = padded(ds._Ticket.__init__, BATCH)
        stage._copy_out = trimmed(stage._copy_out)
    elif name == "dali-checked":
        stage._output_of = checked(stage._output_of, dali_log)

    def undo() -> None:
        (ds.NO_COPY, stage._copy_out, stage.finish, stage._output_of,
         GpuEpochIterator._give_back_slots, ds._Ticket.__init__) = saved  # fmt: skip

    return undo


def one_run(store: Path, seed: int, device: str, name: str) -> dict:
    cuda = device.startswith("cuda")
    log, dali_log = [], []
    undo = variant(name, log, dali_log)
    try:
        dl = loader.DataLoader(
            store, batch_size=BATCH, transform=TRAIN, device=device, decoder=dali_backend(),
            with_indices=True, num_workers=2, shuffle=True, seed=seed, dtype=torch.float16,
            drop_last=name == "drop-last",
        )  # fmt: skip
        flags = []
        for e in range(3):
            for k, (images, _labels, indices) in enumerate(dl):
                flags.append((e, k, (~images.isfinite()).flatten(1).any(1), indices.tolist()))
                if cuda:
                    torch.cuda._sleep(1_000_000)  # the device busy, as in the test
        if cuda:
            torch.cuda.synchronize()
        stats = dl.stats()
        dl.close()
    finally:
        undo()
    bad = []
    for b, (e, k, rows, indices) in enumerate(flags):
        if rows.any():
            seen = log[b] if b < len(log) and log[b]["n"] == len(indices) else {}
            bad.append({"epoch": e, "batch": k, "rows": rows.nonzero().flatten().tolist(),
                        "samples": indices, **seen})  # fmt: skip
    dali_bad = [b for b in dali_log if b]
    keys = ("way", "way_trials", "dali_cuda_batches", "dali_batches_redone", "batches")
    return {"seed": seed, "bad": bad, "dali_outputs_not_finite": dali_bad,
            **{k: stats.get(k) for k in keys}}  # fmt: skip


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
        t0, runs = time.perf_counter(), []
        for r in range(a.runs):
            runs.append(one_run(store, 5 + r, a.device, name))
            print(name, runs[-1], flush=True)
        bad_runs = sum(bool(r["bad"]) for r in runs)
        report["variants"][name] = {"runs_with_bad_batches": bad_runs, "runs": runs,
                                    "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(f"{name}: {bad_runs} of {len(runs)} runs delivered a batch with NaN", flush=True)
    if a.out:
        a.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""What an epoch's start costs a training loop, with and without the head start.

With ``persistent_workers=True`` the loader makes the next epoch's first batches while the
loop trains on the last ones (``loader.epoch``). This measures the loop's wait in ``next()``
for each epoch's first batch and for the others, in a loop that is the bottleneck (as a
model on a GPU is): each step sleeps 1.5 times the loader's own time per batch, measured
in an untimed first epoch. Two ways, alternating in rotating order for ``--rounds``
rounds, each a fresh loader with persistent workers:

- ``head-start``: as shipped;
- ``cold``: the same, but the batches made for the next epoch are dropped before each
  epoch (as ``imfeed-bench`` does between its timed passes): each epoch starts with the
  workers idle, as before the head start existed.

Writes benchmarks/results/epoch-starts-<device>-<cpus>cpu.json.

    python3 benchmarks/epoch_starts.py [--images 2048] [--batch-size 64] [--epochs 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

# This checkout first (not an installed copy), then the shared benchmark helpers.
sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from common import REPO, machine, make_store, write_result

from ingest.cores import usable_cores

WAYS = ("head-start", "cold")


def run(store: Path, way: str, a) -> dict:
    """One fresh loader: an untimed epoch (the step time), then ``a.epochs`` timed ones."""
    import loader

    dl = loader.DataLoader(
        str(store), batch_size=a.batch_size, shuffle=True, num_workers=a.workers,
        persistent_workers=True, transform="train", device=a.device, drop_last=True, seed=0,
    )  # fmt: skip
    t0 = time.perf_counter()
    n = sum(1 for _ in dl)
    step = 1.5 * (time.perf_counter() - t0) / n  # the loop, not the loader, sets the pace
    first, rest, epochs = [], [], []
    for _ in range(a.epochs):
        if way == "cold":
            dl._drop_carry()  # keeps the workers, drops what they made ahead
        start = time.perf_counter()
        it = iter(dl)
        for k in range(len(dl)):
            asked = time.perf_counter()
            next(it)
            (first if k == 0 else rest).append(time.perf_counter() - asked)
            time.sleep(step)
        next(it, None)  # the epoch's end (StopIteration)
        epochs.append(time.perf_counter() - start)
    stats = dl.stats()
    dl.close()
    ideal = step * len(dl)  # an epoch of steps with no wait at all
    return {
        "step_ms": round(step * 1e3, 2),
        "batches_per_epoch": len(dl),
        "first_wait_ms": round(statistics.median(first) * 1e3, 2),
        "other_wait_ms": round(statistics.median(rest) * 1e3, 2),
        "epoch_over_ideal": round(statistics.median(epochs) / ideal, 4),
        "epochs_carried": int(stats.get("epochs_carried", 0)),
        "carries_dropped": int(stats.get("carries_dropped", 0)),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--workers", type=int, default=usable_cores())
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/imfeed-epoch-starts"))
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    a = p.parse_args()
    _, store = make_store(a.workdir, a.images, a.classes)
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for r in range(a.rounds):
        for way in WAYS[r % 2 :] + WAYS[: r % 2]:
            runs[way].append(run(store, way, a))
            print(way, runs[way][-1], flush=True)
    summary = {
        way: {
            key: statistics.median(x[key] for x in runs[way])
            for key in ("first_wait_ms", "other_wait_ms", "epoch_over_ideal")
        }
        for way in WAYS
    }
    report = {
        "what": __doc__.split("\n\n")[0],
        "machine": machine(),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
        "runs": runs,
        "summary": summary,
    }
    cpus = usable_cores()
    write_result(a.out, f"epoch-starts-{a.device.split(':')[0]}-{cpus}cpu.json", report)
    for way in WAYS:
        print(way, summary[way])


if __name__ == "__main__":
    main()

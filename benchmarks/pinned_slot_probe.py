"""Can the ring's shared-memory pixel rows go to the GPU without a CPU copy?

Registers a shared-memory tensor shaped like a slot's pixel rows (256 x 224 x 224 x 3
uint8) with ``cudaHostRegister`` and times, per batch, three ways to bring a share of its
rows (scattered, as the workers' rows are) to the device: the loader's gather into a
pinned buffer and one copy (``augment_gpu.upload``), one copy of the rows' whole span from
the registered memory, and a GPU gather kernel reading the rows straight from the
registered (mapped) memory. Prints a JSON line per way and share.

    python3 benchmarks/pinned_slot_probe.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from loader.gpu.augment import Rows, upload
from loader.gpu.mapped import DeviceView


def main() -> None:
    dev = torch.device("cuda")
    shape = (256, 224, 224, 3)
    t = torch.empty(shape, dtype=torch.uint8).share_memory_()
    t.numpy()[:] = np.random.default_rng(0).integers(0, 255, shape, dtype=np.uint8)
    print("pinned before", t.is_pinned())
    rt = torch.cuda.cudart()
    err = rt.cudaHostRegister(t.data_ptr(), t.numel(), 2)  # cudaHostRegisterMapped
    print("register", err, "pinned after", t.is_pinned())
    alias = torch.as_tensor(DeviceView(t.data_ptr(), tuple(t.shape)), device=dev)
    print("alias", alias.device, alias.shape, alias.data_ptr() == t.data_ptr())
    rng = np.random.default_rng(1)
    stream = torch.cuda.Stream()
    for share in (0.05, 0.1, 0.2, 0.3):
        rows = np.sort(rng.choice(256, int(share * 256), replace=False))
        want = torch.from_numpy(t.numpy()[rows]).to(dev)
        for way in ("upload", "span", "mapped"):
            times, gpu = [], []
            for _ in range(30):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    if way == "upload":
                        (got,) = upload(dev, Rows(t.numpy(), rows))
                    elif way == "span":
                        lo, hi = int(rows[0]), int(rows[-1]) + 1
                        span = t[lo:hi].to(dev, non_blocking=True)
                        got = span[torch.from_numpy(rows - lo).to(dev, non_blocking=True)]
                    else:
                        got = alias[torch.from_numpy(rows).to(dev, non_blocking=True)]
                host = time.perf_counter() - t0
                stream.synchronize()
                times.append(host)
                gpu.append(time.perf_counter() - t0)
            ok = bool(torch.equal(got, want))
            print(
                json.dumps(
                    {
                        "share": share,
                        "rows": len(rows),
                        "way": way,
                        "equal": ok,
                        "host_ms": round(1e3 * float(np.median(times[5:])), 3),
                        "done_ms": round(1e3 * float(np.median(gpu[5:])), 3),
                    }
                )
            )
    rt.cudaHostUnregister(t.data_ptr())


if __name__ == "__main__":
    main()

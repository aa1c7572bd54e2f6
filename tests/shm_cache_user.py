"""A process that uses a store's shm cache, for loader/cache/test_shm_cache.py (run as a script).

    python shm_cache_user.py MODE STORE CACHE_ROOT [ARGS]

MODE ``read`` (ARGS: BARRIER_DIR N): make ``loader.DataLoader(num_workers=2, cache="shm")``
(which joins the cache), wait until N processes have joined (files in BARRIER_DIR), so that
they all use the cache together, read one epoch, print one JSON line: the cache
stats, the sample indices delivered (sorted) and the SHA-256 of every record read through
the cache. MODE ``hold``: join the cache, read every record, print "ready", then wait for
stdin to close. MODE ``stall``: start copying the first shard, write GO_FILE halfway
through the copy and stall there (to be killed).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import torch

import loader
from loader.cache import shm as shmcache
from loader.dataset import LMDBDataset


def records_sha(ds: LMDBDataset) -> str:
    sha = hashlib.sha256()
    for i in range(len(ds)):
        sha.update(ds.store.raw(i))
    return sha.hexdigest()


def read(store: str, root: str, barrier: str, n: str) -> None:
    dl = loader.DataLoader(store, batch_size=5, shuffle=True, num_workers=2, transform="eval",
                           image_size=32, device="cpu", with_indices=True, cache="shm",
                           cache_root=root)  # fmt: skip
    open(os.path.join(barrier, str(os.getpid())), "w").close()
    while len(os.listdir(barrier)) < int(n):
        time.sleep(0.01)
    seen = torch.cat([batch[2] for batch in dl]).tolist()
    out = {"stats": dl.cache_stats(), "indices": sorted(seen), "sha": records_sha(dl.dataset)}
    print(json.dumps(out), flush=True)


def hold(store: str, root: str) -> None:
    ds = LMDBDataset(store, cache="shm", cache_root=root)
    records_sha(ds)
    print("ready", flush=True)
    sys.stdin.read()


def stall(store: str, root: str, go: str) -> None:
    def half_then_stall(src, fd, size):
        with open(src, "rb") as f:
            os.write(fd, f.read(size // 2))
        open(go, "w").close()
        time.sleep(600)

    shmcache.copy_bytes = half_then_stall
    LMDBDataset(store, cache="shm", cache_root=root).store.raw(0)


if __name__ == "__main__":
    mode, store, root, *rest = sys.argv[1:]
    {"read": read, "hold": hold, "stall": stall}[mode](store, root, *rest)

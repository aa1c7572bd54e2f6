"""The node-wide shard cache (cache="shm"): one copy per shard across processes and workers,
the budget, crash safety, verification of earlier copies, several stores, cleanup when the
last user leaves, `ingest cache ls/clear`, and the real /dev/shm."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures import REPO, TESTS, run_ingest

import loader
from ingest import format as fmt
from ingest.format import cachedir as cd
from loader.cache import shm as shmcache
from loader.dataset import LMDBDataset
from loader.store import Store

USER = TESTS / "shm_cache_user.py"
MiB = 1 << 20


def records(store: Path | Store) -> list[bytes]:
    store = store if isinstance(store, Store) else Store(store)
    return [store.raw(i) for i in range(len(store))]


def sha(values: list[bytes]) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(v)
    return h.hexdigest()


def cache_of(store: Path, root: Path) -> Path:
    return cd.base_dir(root) / cd.store_id((store / fmt.MANIFEST).read_bytes())


def sizes(store: Path) -> list[int]:
    shards = fmt.read_manifest(store)["shards"]
    return [(store / s["name"] / "data.mdb").stat().st_size for s in shards]


def entries(cache: Path, prefix: str) -> list[str]:
    return sorted(p.name for p in cache.iterdir() if p.name.startswith(prefix))


def start(mode: str, store: Path, root: Path, *extra: str | Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.Popen(
        [sys.executable, str(USER), mode, str(store), str(root), *map(str, extra)],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the helper process exited with {proc.returncode}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def release(ds: LMDBDataset) -> None:
    ds.store.cache.release()
    ds.store.close()
    gc.collect()  # let the LMDB environments on the cached files close


def test_arguments_are_checked(clean_store: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cache='ram' is unknown; pass cache=\"shm\""):
        LMDBDataset(clean_store, cache="ram")
    with pytest.raises(
        ValueError, match='cache_limit= and cache_root= apply only with cache="shm"'
    ):
        LMDBDataset(clean_store, cache_limit="1GiB")
    with pytest.raises(ValueError, match="cache_limit='lots': 'lots' is not a size"):
        LMDBDataset(clean_store, cache="shm", cache_limit="lots", cache_root=tmp_path)
    with pytest.raises(ValueError, match="cache_limit=-1 is invalid"):
        LMDBDataset(clean_store, cache="shm", cache_limit=-1, cache_root=tmp_path)
    with pytest.raises(cd.CacheError, match="missing' is not a directory; pass an existing one"):
        LMDBDataset(clean_store, cache="shm", cache_root=tmp_path / "missing")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"imfeed-cache-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(cd.CacheError, match="is not a directory owned by you"):
        LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
    with pytest.raises(ValueError, match="cache= cannot be given with an LMDBDataset"):
        loader.DataLoader(LMDBDataset(clean_store), transform="eval", cache="shm")
    with pytest.warns(UserWarning, match="cache=, cache_root= ignored: torch's DataLoader"):
        loader.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2)), cache="shm",
                          cache_root=tmp_path)  # fmt: skip


def test_one_copy_per_shard_across_processes_and_workers(clean_store: Path, tmp_path) -> None:
    barrier = tmp_path / "joined"
    barrier.mkdir()
    procs = [start("read", clean_store, tmp_path, barrier, 3) for _ in range(3)]
    outs = [json.loads(p.communicate(timeout=180)[0]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    original = sha(records(clean_store))
    for out in outs:
        assert out["indices"] == list(range(24)) and out["sha"] == original
        assert out["stats"]["from_original"] == out["stats"]["replaced"] == 0
    # each of the 4 shards copied once on the node, whoever did it
    assert sum(out["stats"]["misses"] for out in outs) == 4
    assert sum(out["stats"]["bytes_copied"] for out in outs) == sum(sizes(clean_store))
    assert not cache_of(clean_store, tmp_path).exists()  # the last one out removed it
    assert os.listdir(cd.base_dir(tmp_path)) == []


def eval_loader(store: Path, **kwargs) -> loader.DataLoader:
    args = {"batch_size": 5, "transform": "eval", "image_size": 32, "device": "cpu",
            "with_indices": True}  # fmt: skip
    return loader.DataLoader(store, **{**args, **kwargs})


def test_budget_smaller_than_the_store(clean_store: Path, tmp_path: Path, caplog) -> None:
    size = sizes(clean_store)  # 4 shards
    limit = size[0] + size[2]  # in store order, shard 1 and then 3 no longer fit
    plain = list(eval_loader(clean_store))
    with caplog.at_level(logging.WARNING, logger="loader.cache.shm"):
        dl = eval_loader(clean_store, cache="shm", cache_limit=limit, cache_root=tmp_path)
        batches = list(dl)
    assert len(batches) == len(plain) == 5
    for got, want in zip(batches, plain, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    cache = cache_of(clean_store, tmp_path)
    assert entries(cache, "shard-") == ["shard-00000", "shard-00002"]
    stats = {"hits": 0, "misses": 2, "bytes_copied": limit, "from_original": 2, "replaced": 0}
    assert dl.cache_stats() == stats
    said = [r.message for r in caplog.records if "read from the store" in r.message]
    assert len(said) == 1 and said[0].startswith("shm cache: shard-00001 (0.1 MiB) and later")
    # workers, shuffled, on the same cache: every sample exactly once, nothing more copied
    dl2 = eval_loader(clean_store, shuffle=True, num_workers=2, cache="shm",
                      cache_limit=limit, cache_root=tmp_path)  # fmt: skip
    seen = torch.cat([b[2] for b in dl2]).tolist()
    assert sorted(seen) == list(range(24))
    assert dl2.cache_stats()["misses"] == dl2.cache_stats()["bytes_copied"] == 0
    assert entries(cache, "shard-") == ["shard-00000", "shard-00002"]


def test_a_small_shm_caches_what_fits(clean_store: Path, tmp_path, monkeypatch) -> None:
    free = 150 * 1024  # a crowded /dev/shm: 150 KiB free, a tenth of 1 MiB kept free
    monkeypatch.setattr(shmcache, "_free", lambda path: (free, 100 * 1024))
    ds = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
    assert ds.store.cache.limit == (free - 100 * 1024) // 2  # the default share: half
    assert records(ds.store) == records(clean_store)
    assert entries(cache_of(clean_store, tmp_path), "shard-") == []  # no shard fits in 25 KiB
    assert ds.cache_stats()["from_original"] == 4
    release(ds)
    monkeypatch.setattr(shmcache, "_free", lambda path: (free, 0))
    ds = LMDBDataset(clean_store, cache="shm", cache_limit="1TiB", cache_root=tmp_path)
    assert ds.store.cache.limit == free  # never more than there is
    assert records(ds.store) == records(clean_store)
    # in store order: 0 and 1 fit, 2 would take it over 150 KiB, the smaller 3 fits
    assert entries(cache_of(clean_store, tmp_path), "shard-") == [
        "shard-00000",
        "shard-00001",
        "shard-00003",
    ]
    assert ds.cache_stats() == {"hits": 0, "misses": 3, "bytes_copied": 57344 + 53248 + 28672,
                                "from_original": 1, "replaced": 0}  # fmt: skip
    release(ds)


def test_sigkill_mid_copy_then_a_new_run(clean_store: Path, tmp_path: Path) -> None:
    halfway = tmp_path / "halfway"
    proc = start("stall", clean_store, tmp_path, halfway)
    wait_for(halfway, proc)
    cache = cache_of(clean_store, tmp_path)
    owner = f"{proc.pid}-{cd.start_time(proc.pid)}"
    assert entries(cache, cd.TMP_PREFIX) == [f".tmp-shard-00000.{owner}"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    ls = run_ingest("cache", "ls", "--root", tmp_path)
    assert f"  user {owner}: dead\n  copy .tmp-shard-00000.{owner}: owner dead\n" in ls.stdout
    ds = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
    assert records(ds.store) == records(clean_store)
    assert ds.cache_stats() == {"hits": 0, "misses": 4, "bytes_copied": sum(sizes(clean_store)),
                                "from_original": 0, "replaced": 0}  # fmt: skip
    assert entries(cache, cd.TMP_PREFIX) == []
    assert os.listdir(cache / cd.USERS) == [cd.me()]  # the dead user is gone
    release(ds)
    assert not cache.exists()


def test_damaged_copy_is_detected_and_replaced(clean_store: Path, tmp_path, caplog) -> None:
    ds = LMDBDataset(clean_store, cache="shm:keep", cache_root=tmp_path)
    assert records(ds.store) == records(clean_store)
    release(ds)
    cache = cache_of(clean_store, tmp_path)
    assert entries(cache, "shard-") == [f"shard-0000{i}" for i in range(4)]  # kept
    data = cache / "shard-00001" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40
    data.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="loader.cache.shm"):
        ds = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
        assert records(ds.store) == records(clean_store)
    assert ds.cache_stats() == {"hits": 3, "misses": 1, "bytes_copied": sizes(clean_store)[1],
                                "from_original": 0, "replaced": 1}  # fmt: skip
    assert [r.message for r in caplog.records] == [
        f"shm cache: {cache / 'shard-00001'} is damaged; copying the shard again"
    ]
    release(ds)
    assert not cache.exists()  # this run did not ask to keep it


def test_a_damaged_store_shard_is_not_cached(clean_store: Path, tmp_path, caplog) -> None:
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    data = store / "shard-00002" / "data.mdb"
    raw = bytearray(data.read_bytes())
    raw[raw.index(b"\xff\xd8\xff") + 200] ^= 0x01  # inside a JPEG payload: a CRC mismatch
    data.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="loader.cache.shm"):
        ds = LMDBDataset(store, cache="shm", cache_root=tmp_path)
        assert records(ds.store) == records(store)
    assert entries(cache_of(store, tmp_path), "shard-") == ["shard-00000", "shard-00001",
                                                            "shard-00003"]  # fmt: skip
    assert ds.cache_stats()["from_original"] == 1 and ds.cache_stats()["misses"] == 3
    assert [r.message for r in caplog.records] == [
        f"shm cache: {store / 'shard-00002'} differs from the checksum in its manifest; it is "
        f"read from the store, not cached; check the store with `ingest verify {store}`"
    ]
    release(ds)


def test_two_stores_side_by_side_and_the_cli(clean_store, awkward_store, tmp_path) -> None:
    a = LMDBDataset(clean_store, cache="shm:keep", cache_root=tmp_path)
    b = LMDBDataset(awkward_store, cache="shm:keep", cache_root=tmp_path)
    assert records(a.store) == records(clean_store)
    assert records(b.store) == records(awkward_store)
    ida, idb = (cache_of(s, tmp_path).name for s in (clean_store, awkward_store))
    assert ida != idb and sorted(os.listdir(cd.base_dir(tmp_path))) == sorted(
        [ida, idb, ida + ".lock", idb + ".lock"]
    )
    nb = len(fmt.read_manifest(awkward_store)["shards"])
    ls = run_ingest("cache", "ls", "--root", tmp_path)
    line = f"{ida}  {os.path.realpath(clean_store)}  4/4 shards, 0.2 MiB, kept for the next run"
    assert ls.returncode == 0 and f"{line}\n  user {cd.me()}: alive\n" in ls.stdout
    busy = run_ingest("cache", "clear", clean_store, "--root", tmp_path)
    assert busy.returncode == 1 and busy.stderr == (
        f"ingest cache: {ida} is in use by process(es) {cd.me()}: left in place; stop them "
        "first, or pass --force\n"
    )
    release(a)
    release(b)
    listed = json.loads(run_ingest("cache", "ls", "--json", "--root", tmp_path).stdout)
    assert {c["id"]: (c["shards"], c["store_shards"], c["users"], c["keep"]) for c in listed} == {
        ida: (4, 4, {}, True),
        idb: (nb, nb, {}, True),
    }
    assert next(c for c in listed if c["id"] == ida)["bytes"] == sum(sizes(clean_store))
    one = run_ingest("cache", "clear", clean_store, "--root", tmp_path)
    assert (one.returncode, one.stdout) == (0, f"ingest cache: removed {ida}\n")
    assert [c["id"] for c in cd.list_caches(tmp_path)] == [idb]
    rest = run_ingest("cache", "clear", "--root", tmp_path)
    assert (rest.returncode, rest.stdout) == (0, f"ingest cache: removed {idb}\n")
    none = run_ingest("cache", "ls", "--root", tmp_path)
    assert none.stdout == f"ingest cache: nothing cached under {tmp_path}\n"
    bad = run_ingest("cache", "clear", tmp_path / "nostore", "--root", tmp_path)
    assert bad.returncode == 2 and "nostore: no such store directory" in bad.stderr
    # A relative path is a path too (it was taken for a cache id: "nothing cached", exit 0)
    bad = run_ingest("cache", "clear", "nostore.lmdb", "--root", tmp_path)
    assert bad.returncode == 2 and "nostore.lmdb: no such store directory" in bad.stderr
    unknown = run_ingest("cache", "clear", "0123456789abcdef0123", "--root", tmp_path)
    assert (unknown.returncode, unknown.stdout) == (  # an id: nothing cached by that id
        0,
        "ingest cache: nothing cached for 0123456789abcdef0123\n",
    )


def test_store_identity_is_its_content(clean_store: Path, tmp_path: Path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(clean_store, copy)
    assert cache_of(copy, tmp_path) == cache_of(clean_store, tmp_path)  # same store, moved
    release(LMDBDataset(copy, cache="shm:keep", cache_root=tmp_path))
    kept = cache_of(copy, tmp_path)
    manifest = json.loads((copy / fmt.MANIFEST).read_bytes())
    manifest["shards"][3]["digest"] = "0" * 64  # a rebuild with other records
    fmt.write_json_atomic(copy / fmt.MANIFEST, manifest)
    assert cache_of(copy, tmp_path) != cache_of(clean_store, tmp_path)
    ls = run_ingest("cache", "ls", "--root", tmp_path)
    assert ls.stdout == (
        f"{kept.name}  {copy}  0/4 shards, 0.0 MiB, kept for the next run (stale: that store "
        "is gone or was rebuilt since)\n"
    )


def test_removed_when_the_last_user_exits(clean_store: Path, tmp_path: Path) -> None:
    ds = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
    cache = cache_of(clean_store, tmp_path)
    other, killed = (start("hold", clean_store, tmp_path) for _ in range(2))
    assert other.stdout.readline() == killed.stdout.readline() == "ready\n"
    assert len(os.listdir(cache / cd.USERS)) == 3
    other.communicate(timeout=30)  # closes its stdin: it exits normally
    assert other.returncode == 0 and len(os.listdir(cache / cd.USERS)) == 2
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert len(os.listdir(cache / cd.USERS)) == 2  # a killed user cannot clean up...
    release(ds)  # ...the last live one recognises it as dead
    assert os.listdir(cd.base_dir(tmp_path)) == []


def _use_cache(store: Path, root: Path) -> None:
    assert len(records(LMDBDataset(store, cache="shm", cache_root=root).store)) == 24


def test_a_multiprocessing_child_leaves_on_exit(clean_store: Path, tmp_path: Path) -> None:
    # such a process ends in os._exit (as torch.multiprocessing.spawn'ed ranks do)
    proc = torch.multiprocessing.get_context("fork").Process(
        target=_use_cache, args=(clean_store, tmp_path)
    )
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and os.listdir(cd.base_dir(tmp_path)) == []


def test_spawned_workers_share_the_stats(clean_store: Path, tmp_path: Path) -> None:
    dl = eval_loader(clean_store, num_workers=1, multiprocessing_context="spawn",
                     cache="shm", cache_root=tmp_path)  # fmt: skip
    assert sorted(torch.cat([b[2] for b in dl]).tolist()) == list(range(24))
    assert dl.cache_stats() == {"hits": 0, "misses": 4, "bytes_copied": sum(sizes(clean_store)),
                                "from_original": 0, "replaced": 0}  # fmt: skip
    dl.close()


@pytest.mark.skipif(not os.access("/dev/shm", os.W_OK), reason="no writable /dev/shm")
def test_the_real_dev_shm(clean_store: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    manifest = json.loads((store / fmt.MANIFEST).read_bytes())
    manifest["test_nonce"] = f"{os.getpid()}-{time.time_ns()}"  # a cache no one else shares
    fmt.write_json_atomic(store / fmt.MANIFEST, manifest)
    base = Path("/dev/shm") / f"imfeed-cache-{os.getuid()}"
    made_base = not base.exists()
    cache = base / cd.store_id((store / fmt.MANIFEST).read_bytes())
    try:
        ds = LMDBDataset(store, cache="shm")
        assert records(ds.store) == records(store)
        assert entries(cache, "shard-") == [f"shard-0000{i}" for i in range(4)]
        st = os.statvfs("/dev/shm")
        assert 0 < ds.store.cache.limit <= st.f_bavail * st.f_frsize + sum(sizes(store))
        release(ds)
        assert not cache.exists() and not Path(f"{cache}.lock").exists()
    finally:
        cd.clear("/dev/shm", cache.name, force=True)
        if made_base:
            with contextlib.suppress(OSError):
                base.rmdir()  # only when empty: another run may be using it


@pytest.mark.parametrize("cache", [None, "shm"])
def test_each_file_is_walked_once(clean_store: Path, tmp_path: Path, monkeypatch, cache) -> None:
    """The LMDB pages of what is mapped are walked once (ingest.format.pages), whatever the
    processes: without a cache each shard when the store is opened, its forked workers
    never again at any epoch; with one each copy as it is made, never the shard it copies,
    nor the copy again in the other workers."""
    import ingest.format.pages
    import loader.cache.shm

    log, real = tmp_path / "walks", ingest.format.pages.pages_problem

    def walk(path):
        with open(log, "a") as f:  # from every process: a line each
            f.write(f"{os.getpid()} {path}\n")
        return real(path)

    monkeypatch.setattr(ingest.format.pages, "pages_problem", walk)
    monkeypatch.setattr(loader.cache.shm, "pages_problem", walk)
    monkeypatch.setattr(ingest.format.pages, "_SOUND", set())  # what earlier tests walked
    extra = {"cache": cache, "cache_root": tmp_path} if cache else {}
    dl = eval_loader(clean_store, num_workers=2, **extra)
    for _ in range(2):  # workers started again at each epoch
        assert sum(len(indices) for _, _, indices in dl) == 24
    walks = [line.split(" ", 1) for line in log.read_text().splitlines()]
    originals = [(pid, path) for pid, path in walks if path.startswith(str(clean_store))]
    assert sorted(originals) == [  # at open, by this process
        (str(os.getpid()), f"{clean_store}/shard-0000{k}/data.mdb") for k in range(4)
    ]
    copies = [path for _, path in walks if not path.startswith(str(clean_store))]
    assert len(copies) == (4 if cache else 0)  # each as it was made, by its copier
    if cache:
        release(dl.dataset)


def test_a_copy_changed_after_its_walk_is_checked_again(clean_store: Path, tmp_path: Path, caplog):
    """A copy's walk is trusted by the processes of its session while the copy is the
    bytes that were walked; damaged since (here so that LMDB would read past the end of
    the file), it is checked again before LMDB reads it, by a new reader and by one that
    has it open, and copied again: both read every record as the store holds it."""
    from hostile_data import damage_last_leaf_page

    first = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)
    records(first.store)  # every shard copied, each copy walked and opened
    shard = cache_of(clean_store, tmp_path) / "shard-00001"
    damage_last_leaf_page(shard)
    with caplog.at_level(logging.WARNING, logger="loader.cache.shm"):
        second = LMDBDataset(clean_store, cache="shm", cache_root=tmp_path)  # the same session
        assert records(second.store) == records(clean_store)
        assert records(first.store) == records(clean_store)  # its mapping changed under it
    assert [r.message for r in caplog.records] == [
        f"shm cache: {shard} is damaged; copying the shard again"
    ]
    assert second.cache_stats() == {"hits": 3, "misses": 1, "bytes_copied": sizes(clean_store)[1],
                                    "from_original": 0, "replaced": 1}  # fmt: skip
    assert first.cache_stats() == {"hits": 1, "misses": 4, "bytes_copied": sum(sizes(clean_store)),
                                   "from_original": 0, "replaced": 0}  # fmt: skip
    release(second)
    release(first)

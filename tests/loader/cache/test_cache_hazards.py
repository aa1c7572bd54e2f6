"""Hostile tests of the shm cache and of store permissions (issue 40): a cached copy damaged
during a run, a cache cleared under its users, a cache_root this user cannot write, and a
store or shard this user may not read (run as the user nobody: root reads everything)."""

from __future__ import annotations

import contextlib
import gc
import io
import logging
import multiprocessing
import os
import shutil
import tempfile
import traceback
from pathlib import Path

import pytest
import torch
from fixtures import run_ingest
from hostile_data import damage_last_leaf_page

import loader
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.cli import main as ingest_main
from ingest.format import cachedir as cd
from loader.bench.synth import make_image_folder
from loader.cache import shm as shmcache
from loader.dataset import LMDBDataset
from loader.store import Store

N = 100
NOBODY = 65534
REMOVED = (
    ", where the store's shard reads fine: the copy was damaged since it was made; it is "
    "removed (copied again when next needed) and the shard read from the store"
)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 images in 4 classes, in shards of about 8 (12 shards); read it, never change it."""
    base = tmp_path_factory.mktemp("hostile-cache")
    make_image_folder(base / "src", 4, 25, seed=1, short_side=(56, 96))
    build(base / "src", base / "store", BuildOptions(shard_size=32 << 10), workers=1,
          progress=False)  # fmt: skip
    return base / "store"


def epoch(dl: loader.DataLoader) -> dict[int, tuple[torch.Tensor, int]]:
    """One epoch: {sample index: (image, label)}; every index once."""
    out: dict[int, tuple[torch.Tensor, int]] = {}
    for images, labels, indices in dl:
        for image, label, i in zip(images, labels.tolist(), indices.tolist(), strict=True):
            assert i not in out, f"sample {i} delivered twice"
            out[i] = (image.clone(), label)
    return out


@pytest.fixture(scope="module")
def reference(store: Path) -> dict[int, tuple[torch.Tensor, int]]:
    """The uncached loader's epoch, the truth."""
    return epoch(eval_loader(store))


def eval_loader(store: Path, **kwargs) -> loader.DataLoader:
    args = {"batch_size": 10, "transform": "eval", "image_size": 32, "device": "cpu",
            "with_indices": True}  # fmt: skip
    return loader.DataLoader(store, **{**args, **kwargs})


def assert_all_read(got: dict, reference: dict, dl: loader.DataLoader) -> None:
    """Every sample exactly once, none replaced, images and labels as the store holds them."""
    assert sorted(got) == list(range(N))
    assert dl.num_replaced == 0 and dl.bad_samples == {}
    for i, (image, label) in got.items():
        assert label == reference[i][1] and torch.equal(image, reference[i][0]), i


def cache_of(store: Path, root: Path) -> Path:
    return cd.base_dir(root) / cd.store_id((store / fmt.MANIFEST).read_bytes())


def shard_sizes(store: Path) -> list[int]:
    return [s["file_bytes"] for s in fmt.read_manifest(store)["shards"]]


def flip_record(copy: Path, store: Path, i: int) -> None:
    """Flip 16 bytes inside record ``i``'s image in the shard copy ``copy``, in place (the
    file's size unchanged): its CRC-32 fails."""
    image = Store(store).record(i)["image"]
    path = copy / "data.mdb"
    data = bytearray(path.read_bytes())
    at = data.find(image) + len(image) // 2
    assert at > len(image) // 2
    for k in range(16):
        data[at + 7 * k] ^= 0x5A
    with open(path, "r+b") as f:
        f.write(data)


# -- 1. a cached copy damaged during a run ---------------------------------------------------


@pytest.mark.parametrize("workers", ["none", "two", "persistent"])
def test_a_copy_damaged_between_epochs_is_copied_again(
    store: Path, reference: dict, tmp_path: Path, caplog, workers: str
) -> None:
    """A copy damaged in place between two epochs (its size unchanged) is found by each
    process that reads it next (a new worker, or one that has it open) before anything
    reads it, and copied again: nothing is replaced, the store is never blamed."""
    extra = {"none": {}, "two": {"num_workers": 2},
             "persistent": {"num_workers": 2, "persistent_workers": True}}[workers]  # fmt: skip
    dl = eval_loader(store, cache="shm", cache_root=tmp_path, **extra)
    assert_all_read(epoch(dl), reference, dl)
    copy = cache_of(store, tmp_path) / "shard-00000"
    flip_record(copy, store, 3)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):  # (persistent workers read the next epoch's first batches ahead)
            assert_all_read(epoch(dl), reference, dl)
    dl.close()
    stats = dl.cache_stats()
    assert (stats["misses"], stats["replaced"], stats["from_original"]) == (12 + 1, 1, 0)
    assert stats["bytes_copied"] == sum(shard_sizes(store)) + shard_sizes(store)[0]
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "ingest verify" in m or "DataLoader" in m]
    if workers == "none":  # (the workers' warnings are theirs, on their stderr)
        assert said == [f"shm cache: {copy} is damaged; copying the shard again"]


def _damage_once_when_handed_out(monkeypatch, flag: Path, shard: int, damage) -> None:
    """Damage shard ``shard``'s copy once, in whichever process, just after the cache hands
    it out checked and before the reader opens it: a copy damaged while in use."""
    real = shmcache.ShmCache.shard_path

    def shard_path(self, k: int) -> str:
        path = real(self, k)
        if k == shard and Path(path).parent == self.dir:
            try:
                os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                return path
            damage(Path(path))
        return path

    monkeypatch.setattr(shmcache.ShmCache, "shard_path", shard_path)


def _one_batch_shard(store: Path, batch: int) -> tuple[int, int]:
    """A shard whose samples all lie in one batch (read by one worker): (shard, first key)."""
    for k, s in enumerate(fmt.read_manifest(store)["shards"]):
        if s["first"] // batch == (s["first"] + s["count"] - 1) // batch and s["first"] % batch:
            return k, s["first"]
    raise AssertionError("no shard lies in one batch")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("damage", ["record", "pages"])
def test_a_copy_failing_while_in_use_is_dropped_for_the_store(
    store: Path, reference: dict, tmp_path: Path, monkeypatch, caplog, num_workers, damage
) -> None:
    """A copy damaged after its check, once a reader has it: a record of it failing its
    CRC-32, or its pages failing their walk when mapped, makes that reader (the training
    process, or the worker that reads it) read the store's shard instead, which is sound:
    nothing is replaced, the copy is removed and counted, the message names the copy."""
    shard, first = _one_batch_shard(store, 10)
    name = fmt.shard_name(shard)
    copy = cache_of(store, tmp_path) / name
    leaf = []
    hurt = {"record": lambda p: flip_record(p, store, first),
            "pages": lambda p: leaf.append(damage_last_leaf_page(p))}[damage]  # fmt: skip
    _damage_once_when_handed_out(monkeypatch, tmp_path / "damaged", shard, hurt)
    dl = eval_loader(store, cache="shm", cache_root=tmp_path, num_workers=num_workers)
    with caplog.at_level(logging.WARNING):
        assert_all_read(epoch(dl), reference, dl)
    assert (tmp_path / "damaged").exists()
    stats = dl.cache_stats()
    assert (stats["misses"], stats["replaced"], stats["from_original"]) == (12, 1, 1)
    assert sorted(p.name for p in copy.parent.glob("shard-*")) == sorted(
        fmt.shard_name(k) for k in range(12) if k != shard
    )  # removed; not copied again by that process, which reads the store's shard now
    said = [r.getMessage() for r in caplog.records]
    assert not [m for m in said if "ingest verify" in m or "DataLoader" in m]
    if num_workers == 0:
        problem = {
            "record": f"{copy}: key {first}: the record's bytes differ from the index "
            "(CRC-32 mismatch)",
            "pages": f"{copy}/data.mdb: damaged LMDB pages (page {leaf and leaf[0]} has a "
            "node outside its node area)",
        }[damage]
        assert said == [f"shm cache: {problem}{REMOVED}"]
    dl.close()
    assert_all_read(epoch(dl), reference, dl)  # the next epoch's workers copy it again
    if num_workers:
        assert dl.cache_stats()["misses"] == 13 and (copy / "data.mdb").is_file()


# -- 2. a cache cleared under its users -----------------------------------------------------


def test_a_new_dataset_after_cache_clear_force(store: Path, tmp_path: Path) -> None:
    """`ingest cache clear --force` removes a cache in use; a new dataset in that process
    makes it again (it no longer counts itself a user of the removed one), and the one
    that used it moves to the new copies: both read every record as the store holds them."""
    want = [Store(store).raw(i) for i in range(N)]
    old = LMDBDataset(store, cache="shm", cache_root=tmp_path)
    assert [old.store.raw(i) for i in range(N)] == want
    cleared = run_ingest("cache", "clear", "--force", "--root", tmp_path)
    assert (cleared.returncode, cleared.stderr) == (0, "")
    assert not cache_of(store, tmp_path).exists()
    new = LMDBDataset(store, cache="shm", cache_root=tmp_path)
    assert [new.store.raw(i) for i in range(N)] == want
    assert new.cache_stats() == {"hits": 0, "misses": 12, "bytes_copied": sum(shard_sizes(store)),
                                 "from_original": 0, "replaced": 0}  # fmt: skip
    assert os.listdir(cache_of(store, tmp_path) / cd.USERS) == [cd.me()]
    assert [old.store.raw(i) for i in range(N)] == want  # its copies gone: the new ones
    assert old.cache_stats()["hits"] == 12 and old.cache_stats()["from_original"] == 0
    for ds in (old, new):
        ds.store.cache.release()
    assert os.listdir(cd.base_dir(tmp_path)) == []  # the last user out removed it


def test_an_error_in_a_locked_block_reaches_its_caller(tmp_path: Path) -> None:
    """cachedir.locked() never swallows its body's error (a FileNotFoundError was retried
    and ended in "generator didn't stop after throw()"), and the lock is free after it."""
    lock = tmp_path / "budget.lock"
    with pytest.raises(FileNotFoundError, match="gone"), cd.locked(lock):
        raise FileNotFoundError("gone")
    with cd.locked(lock):
        pass  # free again: a held flock would block here


def test_a_copy_renamed_by_another_worker_while_counting_the_budget(
    store: Path, tmp_path: Path, monkeypatch
) -> None:
    """Another worker's copy in the making may be renamed (complete) or removed (failed)
    between this one listing the cache and sizing what it lists: this one still copies
    and reads every shard (it used to fail the worker; CI saw it with two workers)."""
    want = [Store(store).raw(i) for i in range(N)]
    ds = LMDBDataset(store, cache="shm", cache_root=tmp_path)
    other = cache_of(store, tmp_path) / f"{cd.TMP_PREFIX}shard-00011.other"
    listed = Path.glob

    def glob_then_rename(self, pattern):
        found = list(listed(self, pattern))
        if pattern.endswith(shmcache.DATA) and other.exists():
            shutil.rmtree(other)  # the other worker's rename, after the listing
        return iter(found)

    other.mkdir()
    (other / shmcache.DATA).write_bytes(b"x" * 1000)
    monkeypatch.setattr(Path, "glob", glob_then_rename)
    assert ds.store.raw(0) == want[0]
    assert not other.exists()  # it was listed, then renamed
    monkeypatch.undo()
    assert [ds.store.raw(i) for i in range(N)] == want
    assert ds.cache_stats()["misses"] == 12 and ds.cache_stats()["from_original"] == 0
    ds.store.cache.release()


def test_a_dataset_whose_cache_was_cleared_reads_the_store(store: Path, tmp_path, caplog):
    """A dataset whose cache was cleared under it (and not made again) reads the store,
    the shards it had open as well as the others, and says so once."""
    want = [Store(store).raw(i) for i in range(N)]
    ds = LMDBDataset(store, cache="shm", cache_root=tmp_path)
    half = fmt.read_manifest(store)["shards"][6]["first"]
    assert [ds.store.raw(i) for i in range(half)] == want[:half]  # shards 0-5 open
    assert run_ingest("cache", "clear", "--force", "--root", tmp_path).returncode == 0
    with caplog.at_level(logging.WARNING):
        assert [ds.store.raw(i) for i in range(N)] == want
    assert [r.getMessage() for r in caplog.records] == [
        f"shm cache {cache_of(store, tmp_path)} was removed while in use; reading the store "
        "instead (said once)"
    ]
    assert ds.cache_stats() == {"hits": 0, "misses": 6, "bytes_copied": sum(shard_sizes(store)[:6]),
                                "from_original": 12, "replaced": 0}  # fmt: skip
    ds.store.cache.release()
    assert not cache_of(store, tmp_path).exists()


# -- as another user ------------------------------------------------------------------------


def _warm_up(store: Path) -> None:
    """Import, as root, what the readers import lazily (here, in the workers and verify's
    children): the user nobody cannot read this interpreter's library under /root."""
    root = Path(tempfile.mkdtemp())
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            ingest_main(["info", str(store)])
            ingest_main(["verify", str(store)])
            LMDBDataset(store)[0]
            dl = eval_loader(store, num_workers=2, cache="shm", cache_root=root)
            epoch(dl)
            dl.close()
            dl.dataset.store.cache.release()
            del dl
            gc.collect()  # its semaphores unlinked by root, who made them
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_nobody(store: Path, fn, *args) -> dict:
    """``fn(*args)`` in a new process (spawned: nothing of this one's threads) as the user
    nobody when this one is root, else as this user: {"value": what it returned, or
    "error": [type, message, whether it chains another]; "logs": the warnings logged}.
    Skips when the user cannot be changed."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_nobody_child, args=(writer, str(store), fn, args))
    proc.start()
    writer.close()
    try:
        assert reader.poll(300), "the process as the user nobody hung"
        out = reader.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    if "skip" in out:
        pytest.skip(out["skip"])
    assert "crash" not in out, out["crash"]
    return out


def _nobody_child(writer, store: str, fn, args) -> None:
    # Locks made as root (tqdm's) must not be named ones that the user nobody cannot unlink.
    multiprocessing.set_start_method("fork", force=True)
    try:
        out = {}
        if os.geteuid() == 0:
            _warm_up(Path(store))
            try:
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            except OSError as e:
                out = {"skip": f"cannot become the user nobody: {e}"}
        writer.send(out or _run_capturing(fn, *args))
    except BaseException:
        writer.send({"crash": traceback.format_exc()})


def _run_capturing(fn, *args) -> dict:
    logs: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: logs.append(record.getMessage())
    logging.getLogger().addHandler(handler)
    try:
        return {"value": fn(*args), "logs": logs}
    except Exception as e:
        chained = e.__cause__ is not None or (e.__context__ is not None
                                              and not e.__suppress_context__)  # fmt: skip
        return {"error": [type(e).__name__, str(e), chained], "logs": logs}
    finally:
        logging.getLogger().removeHandler(handler)


@contextlib.contextmanager
def _public_folder():
    """A folder the user nobody can enter (tmp_path's parents may not let it), removed after."""
    base = Path(tempfile.mkdtemp(dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for folder, dirs, _ in os.walk(base):  # as a user that is not root: let it remove them
            for d in dirs:
                with contextlib.suppress(OSError):
                    os.chmod(os.path.join(folder, d), 0o755)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def public_dir():
    with _public_folder() as base:
        yield base


# -- 3. a cache_root this user cannot write -------------------------------------------------


def _read_with_cache(store: str, root: str) -> dict:
    ds = LMDBDataset(store, cache="shm", cache_root=root)
    sha = [Store(store).raw(i) == ds.store.raw(i) for i in range(N)]
    dl = eval_loader(Path(store), num_workers=2, cache="shm", cache_root=root)
    seen = sorted(i for _, _, indices in dl for i in indices.tolist())
    stats = dl.cache_stats()  # (each worker reads its shards from the store: their count)
    copied = stats["hits"] + stats["misses"] + stats["bytes_copied"] + stats["replaced"]
    return {"same": all(sha), "stats": ds.cache_stats(), "seen": seen == list(range(N)),
            "copied": copied}  # fmt: skip


def test_an_unwritable_cache_root_reads_the_store_uncached(store: Path, public_dir: Path):
    """A cache_root this user may not write (here root's, as the user nobody) is no reason
    to fail a run: the store is read without a cache, with one warning saying why."""
    shutil.copytree(store, public_dir / "store")
    root = public_dir / "shm"
    root.mkdir(mode=0o755)  # root's: nobody may not write in it
    out = as_nobody(store, _read_with_cache, str(public_dir / "store"), str(root))
    assert "error" not in out, out["error"]
    uncached = {"hits": 0, "misses": 0, "bytes_copied": 0, "from_original": 12, "replaced": 0}
    assert out["value"] == {"same": True, "stats": uncached, "seen": True, "copied": 0}
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    said = (
        f"shm cache: cache_root={str(root)!r} cannot hold a cache for this user (uid {uid}): "
        f"{root}/imfeed-cache-{uid}: Permission denied; the store is read without one (give "
        "the user write access to it, or pass another cache_root)"
    )
    assert out["logs"] == [said, said]  # one for each loader
    assert os.listdir(root) == []


def test_a_read_only_cache_root_reads_the_store_uncached(store: Path, tmp_path, monkeypatch):
    """As above, a read-only mount (EROFS, as a mount would refuse every write)."""
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(30, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    (tmp_path / "ro").mkdir()
    monkeypatch.setattr(os, "mkdir", mkdir)
    out = _read_with_cache(str(store), str(tmp_path / "ro"))
    uncached = {"hits": 0, "misses": 0, "bytes_copied": 0, "from_original": 12, "replaced": 0}
    assert out == {"same": True, "stats": uncached, "seen": True, "copied": 0}


# -- 4. a store or shard this user may not read ---------------------------------------------

# what becomes unreadable -> (its path in the store, a folder?, read by running workers?)
UNREADABLE = {
    "shard file": ("shard-00003/data.mdb", False, True),
    "shard folder": ("shard-00003", True, True),
    "store folder": ("", True, True),
    "manifest": ("manifest.json", False, False),
    "folder above": ("..", True, True),
}


def _all_readers(cases: dict[str, tuple[str, str, int]]) -> dict:
    """``_readers`` of each case in turn, in one process: {case: what they said}."""
    return {what: _readers(*args) for what, args in cases.items()}


def _readers(store: str, target: str, mode: int) -> dict:
    """As the store's owner: make a loader with workers, then take this user's access to
    ``target`` away; then what `ingest info`, `ingest verify`, LMDBDataset and the loader's
    workers say."""
    dl = eval_loader(Path(store), num_workers=2)
    os.chmod(target, mode)
    out = {}
    for name in ("info", "verify"):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = ingest_main([name, store])
        out[name] = [code, err.getvalue()]
    out["dataset"] = _run_capturing(LMDBDataset, store).get("error")
    out["workers"] = _run_capturing(lambda: sum(len(i) for _, _, i in dl))
    dl.close()
    os.chmod(target, 0o755)  # its owner's again: removable
    return out


@pytest.fixture(scope="module")
def unreadable(store: Path):
    """Each case of UNREADABLE on a copy of its own, all read by one process as the user
    nobody (one start, not one per case): {case: (the copy, its target, what was said)}."""
    with _public_folder() as base:
        cases, paths = {}, {}
        for k, (what, (rel, folder, _)) in enumerate(UNREADABLE.items()):
            mid = base / f"case-{k}" / "mid"
            shutil.copytree(store, mid / "store")
            if os.geteuid() == 0:  # the store nobody's, so that it can change its modes
                for path in [mid, *mid.rglob("*")]:
                    os.chown(path, NOBODY, NOBODY)
            root = mid / "store"
            target = (root / rel).resolve()
            cases[what] = (str(root), str(target), 0o600 if folder else 0)
            paths[what] = (root, target)
        said = as_nobody(store, _all_readers, cases)
        assert "error" not in said, said["error"]
        yield {what: (*paths[what], out) for what, out in said["value"].items()}


@pytest.mark.parametrize("what", UNREADABLE)
def test_an_unreadable_store_says_which_file_in_one_line(unreadable, what):
    """A file or folder of a store this user may not read is said so, in one line naming
    it and what to do, by `ingest info`, `ingest verify`, LMDBDataset and a worker (the
    same one line: no traceback in it, no chained one); never "rebuild the store"."""
    rel, folder, in_workers = UNREADABLE[what]
    root, target, value = unreadable[what]
    uid = NOBODY if os.geteuid() == 0 else os.geteuid()
    shown = target if folder else root / rel
    said = (
        f"{shown}: permission denied: this user (uid {uid}) may not enter this folder; give "
        "it access (chmod/chown)"
        if folder
        else f"{shown}: permission denied: this user (uid {uid}) may not read it; give it "
        "read access (chmod/chown)"
    )
    info_code = 1 if what.startswith("shard") else 2  # the summary is the manifest's
    assert value["info"] == [info_code, f"ingest info: error: {said}\n"]
    assert value["verify"] == [2, f"ingest verify: error: {said}\n"]
    assert value["dataset"] == ["AccessDenied", said, False]
    if in_workers:
        assert value["workers"] == {"error": ["AccessDenied", said, False], "logs": []}
    else:  # the workers read what they had before: every sample
        assert value["workers"] == {"value": N, "logs": []}

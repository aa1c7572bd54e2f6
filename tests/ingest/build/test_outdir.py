"""What a build may delete and when: --overwrite over a store that holds SRC, through a
symlink, failing or cut short anywhere; and two builds of one OUT at once (one owns it)."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fixtures import REPO, assert_same_store, run_ingest

from ingest import format as fmt
from ingest.build import BuildOptions, build, outdir
from ingest.build import local as local_build
from ingest.build.resume import OutputError
from ingest.format import lock as buildlock
from ingest.format.lock import BuildLock
from ingest.verify import verify_store
from loader.bench.synth import make_image_folder

SMALL = BuildOptions(shard_size=16 << 10)
OTHER = BuildOptions(shard_size=16 << 10, max_size=24)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("builds") / "src"
    make_image_folder(root, 2, 6, seed=21, short_side=(40, 64))
    return root


def _files(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes; not the build lock (it
    names its last holder) nor an --overwrite build's new store."""
    files = {p.relative_to(root).as_posix(): p for p in root.rglob("*") if p.is_file()}
    return {k: p.read_bytes() for k, p in files.items()
            if k != ".build.lock" and not k.startswith(".overwrite/")}  # fmt: skip


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    return result.stderr


def test_overwrite_never_deletes_a_source_inside_the_store(tmp_path: Path, tree: Path):
    ds = tmp_path / "ds"
    assert run_ingest("build", tree, ds, "--workers", "1").returncode == 0
    store_before = _files(ds)
    shutil.copytree(tree, ds / "images")
    images = _files(ds / "images")
    for extra in ([], ["--ray"]):
        result = run_ingest("build", ds / "images", ds, "--overwrite", *extra)
        assert _one_line_error(result) == (
            f"ingest build: error: source {ds / 'images'} is inside the output {ds}; move the "
            "image folder out of the store's directory (e.g. next to it), then build again\n"
        )
        assert _files(ds / "images") == images  # every image, byte for byte
        assert {k: v for k, v in _files(ds).items() if not k.startswith("images/")} == store_before
    assert verify_store(ds) == []


def test_a_build_deletes_only_its_own_files(tmp_path: Path, tree: Path):
    """Over a store (--overwrite) or an interrupted build that starts over, what the user
    put in OUT stays."""
    out = tmp_path / "out"
    build(tree, out, SMALL, workers=1, progress=False)
    (out / "NOTES.txt").write_text("mine")
    (out / "shard-x").mkdir()  # not a shard's name
    build(tree, out, OTHER, workers=1, progress=False, overwrite=True)
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "shard-x").is_dir()
    assert verify_store(out) == [] and fmt.read_manifest(out)["options"]["max_size"] == 24
    (out / fmt.MANIFEST).unlink()  # an interrupted build of other options: starts over
    (out / fmt.BUILD_STATE).write_text('{"fingerprint": {}, "cursor": 0, "shards": []}')
    build(tree, out, SMALL, workers=1, progress=False)
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "shard-x").is_dir()
    assert verify_store(out) == []


def test_overwrite_through_a_symlink_replaces_the_store_behind_it(tmp_path: Path, tree: Path):
    real, link = tmp_path / "real.lmdb", tmp_path / "train.lmdb"
    build(tree, real, SMALL, workers=1, progress=False)
    link.symlink_to(real.name)
    result = run_ingest("build", tree, link, "--overwrite", "--max-size", "24", "--shard-size",
                        "16KiB", "--workers", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert link.is_symlink() and os.readlink(link) == real.name
    assert fmt.read_manifest(link)["options"]["max_size"] == 24 and verify_store(link) == []
    expected = tmp_path / "expected"
    build(tree, expected, OTHER, workers=2, progress=False)
    assert_same_store(real, expected)  # the same store as a fresh build, nothing left over


def test_a_failed_overwrite_leaves_the_old_store_as_it_was(tmp_path: Path, tree: Path):
    out = tmp_path / "out"
    build(tree, out, SMALL, workers=1, progress=False)
    before = _files(out)
    bad = tmp_path / "bad"
    (bad / "a").mkdir(parents=True)
    (bad / "a" / "x.jpg").write_bytes(b"not a jpeg")
    result = run_ingest("build", bad, out, "--overwrite", "--workers", "1")
    assert result.returncode == 2 and "no valid image" in result.stderr
    assert _files(out) == before
    assert verify_store(out) == []
    # killed mid-build: the old store whole; the same command again resumes and replaces it
    big = tmp_path / "big"
    make_image_folder(big, 2, 40, seed=22, short_side=(48, 80))
    from fixtures import kill_9_after_a_shard

    args = ["build", big, out, "--overwrite", "--shard-size", "16KiB", "--workers", "1"]
    kill_9_after_a_shard(args, out / fmt.STAGING_DIR, within=60)
    assert _files(out) == before
    again = run_ingest("build", big, out, "--shard-size", "16KiB")
    assert "an --overwrite build of it was interrupted: pass --overwrite to resume it" in (
        _one_line_error(again)
    )
    resumed = run_ingest(*args)
    assert resumed.returncode == 0 and "resuming the interrupted build" in resumed.stderr
    assert fmt.read_manifest(out)["num_samples"] == 80 and verify_store(out) == []
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".build.lock"]


@pytest.mark.parametrize("cut", range(1, 20))
def test_an_overwrite_cut_short_as_it_swaps_is_finished_by_the_next_build(
    tmp_path: Path, tree: Path, monkeypatch: pytest.MonkeyPatch, cut: int
):
    """Killed at any rename of the --overwrite build (18 of them here, the swap's last):
    OUT is always one whole store or none, and the next build of OUT ends with the new
    store, byte for byte."""
    out, expected = tmp_path / "out", tmp_path / "expected"
    build(tree, out, SMALL, workers=1, progress=False)
    build(tree, expected, OTHER, workers=1, progress=False)
    real, calls = os.replace, []

    def dies(src, dst):
        calls.append(src)
        if len(calls) == cut:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(outdir.os, "replace", dies)
    try:
        build(tree, out, OTHER, workers=1, progress=False, overwrite=True)
        swapped = True
    except KeyboardInterrupt:
        swapped = False
    monkeypatch.setattr(outdir.os, "replace", real)
    if swapped:  # fewer renames than ``cut``
        assert cut > 18
        assert_same_store(out, expected)
        return
    if (out / fmt.MANIFEST).exists():  # either store, whole
        assert fmt.read_manifest(out)["options"]["max_size"] in (None, 24)
        assert verify_store(out) == []
    else:
        with pytest.raises(fmt.StoreError, match="run the same `ingest build --overwrite` again"):
            fmt.read_manifest(out)
    if (out / fmt.STAGING_DIR / fmt.MANIFEST).exists():  # the new store was complete: not
        monkeypatch.setattr(local_build, "convert", _never)  # built a second time
    build(tree, out, OTHER, workers=1, progress=False, overwrite=True)
    assert_same_store(out, expected)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [".build.lock"]


def _never(*args, **kwargs):
    raise AssertionError("the build converted the images again")


def test_a_folder_with_another_programs_manifest_is_not_a_store(tmp_path: Path, tree: Path):
    """A manifest.json that is not a store's does not make OUT ours: --overwrite refuses
    it and deletes nothing (it had moved the user's files aside, then deleted them)."""
    out = tmp_path / "project"
    out.mkdir()
    (out / fmt.MANIFEST).write_text('{"name": "my project"}')
    (out / fmt.INDEX).write_bytes(b"the user's")
    before = _files(out)
    result = run_ingest("build", tree, out, "--overwrite")
    assert _one_line_error(result) == (
        f"ingest build: error: output {out} is a non-empty directory that is not a store; "
        "choose a new or empty directory\n"
    )
    assert _files(out) == before and sorted(os.listdir(out)) == [fmt.INDEX, fmt.MANIFEST]


def test_a_lock_whose_pid_cannot_be_written_is_not_kept(tmp_path: Path, monkeypatch):
    """A full disk as the lock's holder is written: the lock is let go (this process could
    not build OUT again until it exited: its own lock held it off)."""

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(buildlock.os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        BuildLock(tmp_path).__enter__()
    monkeypatch.undo()
    with BuildLock(tmp_path):
        pass


def test_a_reader_asking_who_builds_never_fails_a_build(tmp_path: Path):
    """``holder`` (info, verify, the loader) takes the lock shared for an instant; a build
    starting in that instant waits for it instead of saying OUT is being written."""
    fd = os.open(tmp_path / ".build.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_SH)  # a reader, at that instant
    threading.Timer(0.05, os.close, [fd]).start()
    with BuildLock(tmp_path):
        assert buildlock.holder(tmp_path) == f"pid {os.getpid()}"


def test_one_build_owns_out(tmp_path: Path, tree: Path):
    out = tmp_path / "out"
    out.mkdir()
    with BuildLock(out):  # as a build that runs: a second one, info and verify say so
        result = run_ingest("build", tree, out)
        assert _one_line_error(result) == (
            f"ingest build: error: output {out} is being written by another `ingest build` "
            f"(pid {os.getpid()}); wait for it to end, or stop it and run this command again\n"
        )
        with pytest.raises(OutputError, match=r"being written by another `ingest build`"):
            build(tree, out, workers=1, progress=False, overwrite=True)
        (out / fmt.BUILD_STATE).write_text("{}")
        for command in ("info", "verify"):
            said = _one_line_error(run_ingest(command, out))
            assert said == (
                f"ingest {command}: error: {out}: not a complete store, manifest.json is "
                f"missing (`ingest build` is writing it now, pid {os.getpid()}: wait for it "
                "to end)\n"
            )
    said = _one_line_error(run_ingest("info", out))  # the lock gone with its holder
    assert "an interrupted build: run the same `ingest build` again to resume" in said
    assert run_ingest("build", tree, out, "--workers", "1").returncode == 0
    assert verify_store(out) == []


def test_two_builds_at_once_one_store(tmp_path: Path):
    """Two builds of other options started together: one builds the store, the other is
    refused in one line; the store is whole and of the winner's options."""
    src = tmp_path / "src"
    make_image_folder(src, 2, 60, seed=23, short_side=(64, 96))
    out = tmp_path / "out"

    def command(size: str) -> list:
        return [sys.executable, "-m", "ingest", "build", src, out, "--max-size", size,
                "--workers", "1", "--shard-size", "32KiB"]  # fmt: skip

    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    procs = [subprocess.Popen(command(size), cwd=REPO, **pipes) for size in ("48", "40")]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    for p in procs:
        p.stdout.close()
        p.stderr.close()
    codes = sorted(code for code, _ in results)
    assert codes == [0, 2], results
    loser = next(err for code, err in results if code == 2)
    assert loser.count("\n") == 1 and "Traceback" not in loser
    assert "is being written by another `ingest build`" in loser or (
        "is already a complete store" in loser
    )
    winner = 48 if results[0][0] == 0 else 40
    manifest = fmt.read_manifest(out)
    assert manifest["options"]["max_size"] == winner and manifest["num_samples"] == 120
    assert verify_store(out) == []

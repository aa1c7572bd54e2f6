"""Crash safety and determinism of builds: kill -9 and resume, worker counts, map growth."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fixtures import (
    AWKWARD_OPTIONS,
    Tree,
    assert_same_store,
    build_killed_in_a_worker,
    kill_9_after_a_shard,
    make_big_tree,
    read_shards,
    rerun_gives_the_clean_build,
    run_ingest,
    sealed_shards,
)

from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.build import tasks as ray_tasks
from ingest.build.local import facts_on_workers, make_pool
from ingest.build.resume import fingerprint
from ingest.build.scan import scan
from ingest.format.codec import unpack_record


def test_resume_after_kill_9_gives_the_clean_build(tmp_path: Path) -> None:
    src = make_big_tree(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ["build", src, out, "--shard-size", "200KiB", "--workers", "2"]
    sealed = kill_9_after_a_shard(args, out, within=60)
    assert 0 < len(sealed) < 20  # of 23: killed early
    inodes = {name: (out / name / "data.mdb").stat().st_ino for name in sealed}

    rerun = run_ingest(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "seen 122 = kept 120 + rejected 2 + ignored 0 in 23 shard(s)" in rerun.stdout
    # Sealed shards were kept, not rewritten: the build resumed.
    assert {name: (out / name / "data.mdb").stat().st_ino for name in sealed} == inodes
    assert not (out / fmt.BUILD_STATE).exists() and not (out / fmt.PARTIAL_DIR).exists()

    done = run_ingest(*args[:2], clean, *args[3:])
    assert done.returncode == 0, done.stderr
    assert_same_store(out, clean)  # data.mdb files included, byte for byte


_write_shard = ray_tasks.write_shard


def _killed_in_shard_2(src, out, k, *args, write=_write_shard):
    """write_shard, but the worker is killed (as by the OOM killer) when it gets shard 2."""
    if k == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return write(src, out, k, *args)


def _stream_killed_in_shard_2(src, out, k, *args):
    """stream_shard, killed likewise: shard 2 may be the one open when a stream starts."""
    return _killed_in_shard_2(src, out, k, *args, write=_stream_shard)


_stream_shard = ray_tasks.stream_shard


def test_a_killed_worker_is_one_line_and_the_rerun_gives_the_clean_build(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    src = make_big_tree(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ["build", str(src), str(out), "--shard-size", "200KiB", "--workers", "2"]
    monkeypatch.setattr(ray_tasks, "write_shard", _killed_in_shard_2)  # found so by the pool
    monkeypatch.setattr(ray_tasks, "stream_shard", _stream_killed_in_shard_2)
    assert "shard-00002" not in sealed_shards(build_killed_in_a_worker(args, capsys))
    monkeypatch.undo()
    rerun_gives_the_clean_build(args, clean)


def test_same_store_whatever_the_number_of_workers(
    tmp_path: Path, awkward_tree: Tree, awkward_store: Path
) -> None:
    out = tmp_path / "store"
    build(awkward_tree.root, out, AWKWARD_OPTIONS, workers=2, progress=False)
    assert_same_store(out, awkward_store)  # that one was built with workers=1


def test_the_workers_fingerprint_the_files_as_one_process_does(awkward_tree: Tree) -> None:
    tree = scan(awkward_tree.root)
    with make_pool(3) as pool:
        facts = facts_on_workers(pool, tree, chunk=3)  # many runs of files: their order counts
        assert fingerprint(tree, {}, facts) == fingerprint(tree, {})
    assert len(tree.items) > 9


def test_map_grows_from_a_tiny_initial_map(
    tmp_path: Path, clean_tree: Path, clean_store: Path
) -> None:
    out = tmp_path / "store"
    options = BuildOptions()  # one shard of all the records, about 100 KB
    manifest = build(clean_tree, out, options, workers=1, progress=False, map_size=64 << 10)
    assert len(manifest["shards"]) == 1 and manifest["shards"][0]["map_growths"] > 0
    assert {s["map_growths"] for s in fmt.read_manifest(clean_store)["shards"]} == {0}
    assert [unpack_record(v) for _, _, v in read_shards(out)] == [
        unpack_record(v) for _, _, v in read_shards(clean_store)
    ]
    assert manifest["num_samples"] == len(read_shards(out)) == 24

"""The open shard written as its ranges are checked (``tasks.stream_shard``): the same store."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from fixtures import (
    assert_same_store,
    build_killed_in_a_worker,
    make_big_tree,
    make_image_folder,
    rerun_gives_the_clean_build,
    sealed_shards,
)

from ingest.build import BuildOptions, build, tasks

_stream_shard = tasks.stream_shard


_LOG: list[Path] = []  # where _streamed notes each shard streamed (read by forked workers)


def _streamed(src, out, k, *args):
    with open(_LOG[-1], "a") as f:
        f.write(f"{k}\n")
    return _stream_shard(src, out, k, *args)


def test_streamed_shards_give_the_store_of_one_process(tmp_path: Path, monkeypatch) -> None:
    # One shard (the default size) and 23 of 200 KiB, cut inside the check ranges of 64
    # samples: each streamed at least once, byte for byte the store of workers=1.
    src = make_big_tree(tmp_path / "src")
    for size in (512 * 2**20, 200 * 2**10):
        log = tmp_path / f"streamed-{size}"
        _LOG.append(log)
        monkeypatch.setattr(tasks, "stream_shard", _streamed)
        opts = BuildOptions(shard_size=size)
        got = build(src, tmp_path / f"two-{size}", opts, workers=2, progress=False)
        monkeypatch.undo()
        want = build(src, tmp_path / f"one-{size}", opts, workers=1, progress=False)
        streamed = [int(k) for k in log.read_text().split()]
        assert streamed and streamed == sorted(set(streamed))
        assert len(got["shards"]) == (1 if size > 2**20 else 23)
        assert streamed[0] == 0 and streamed[-1] < len(got["shards"])
        assert_same_store(tmp_path / f"two-{size}", tmp_path / f"one-{size}")
        assert want["shards"] == got["shards"]


def _killed(src, out, k, *args):
    os.kill(os.getpid(), signal.SIGKILL)  # as by the OOM killer, as it starts


def test_a_killed_stream_is_one_line_and_the_rerun_gives_the_clean_build(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    src = make_big_tree(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ["build", str(src), str(out), "--workers", "2"]  # one shard, streamed from the start
    monkeypatch.setattr(tasks, "stream_shard", _killed)
    assert sealed_shards(build_killed_in_a_worker(args, capsys)) == []
    monkeypatch.undo()
    rerun_gives_the_clean_build(args, clean)


def test_a_stream_past_ranges_that_keep_nothing_gives_the_store_of_one_process(
    tmp_path: Path,
) -> None:
    # The first 70 files sort first and are all rejects: the first check range of 64
    # keeps nothing while the stream's shard is still empty (it failed on an IndexError).
    src = tmp_path / "src"
    make_image_folder(src, 1, 10, seed=3)
    for i in range(70):
        (src / "class_00" / f"a_empty_{i:03d}.JPEG").write_bytes(b"")
    got = build(src, tmp_path / "two", workers=2, progress=False)
    build(src, tmp_path / "one", workers=1, progress=False)
    assert (got["num_samples"], len(got["shards"])) == (10, 1)
    assert_same_store(tmp_path / "two", tmp_path / "one")

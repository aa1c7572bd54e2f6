"""`ingest build --ray`: the local build's store from Ray tasks, through worker and driver kills.

One local Ray instance of 2 CPUs serves the module (starting one costs seconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import numpy as np
import pytest
from fixtures import (
    AWKWARD_OPTIONS,
    Tree,
    assert_same_store,
    kill_9_after_a_shard,
    make_big_tree,
    run_ingest,
)

from ingest import cli
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.build.resume import OutputError, fingerprint, fresh_state
from ingest.build.scan import SourceError, scan
from ingest.build.shardplan import rolls_over, shard_starts
from loader.bench.synth import make_image_folder

KiB = 1 << 10


def test_shard_starts_follow_the_record_sizes_only() -> None:
    # A shard rolls over when the next record would take it over 10 bytes; a record
    # larger than that gets a shard of its own.
    assert shard_starts([5, 5, 5, 20, 1, 1, 9, 10], 10) == [0, 2, 3, 4, 6, 7]
    assert shard_starts([], 10) == []
    assert shard_starts([11], 10) == [0]
    assert shard_starts([10, 10, 0, 3], 10) == [0, 1, 3]


def test_shard_starts_cut_as_the_local_build_rolls_over() -> None:
    rng = np.random.default_rng(0)
    for shard_size in (1, 50, 1000, 10**6):
        sizes = rng.integers(0, 300, size=2000)
        cuts, nbytes, count = [], 0, 0  # the local build's writer, record by record
        for i, size in enumerate(sizes.tolist()):
            if count == 0 or rolls_over(nbytes, count, size, shard_size):
                cuts.append(i)
                nbytes = count = 0
            nbytes, count = nbytes + size, count + 1
        assert shard_starts(sizes, shard_size) == cuts


def test_the_local_build_cuts_shards_by_the_rule(awkward_store: Path) -> None:
    index = fmt.load_index(awkward_store)
    shards = fmt.read_manifest(awkward_store)["shards"]
    assert len(shards) == 16
    assert [s["first"] for s in shards] == shard_starts(index["nbytes"].tolist(), 48 * KiB)


def test_without_ray_the_flag_says_how_to_install(
    tmp_path: Path, awkward_tree: Tree, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert cli.main(["build", str(awkward_tree.root), str(tmp_path / "out"), "--ray"]) == 2
    assert capsys.readouterr().err == (
        "ingest build: error: --ray needs Ray, which is not installed: pip install 'imfeed[ray]'\n"
    )
    assert not (tmp_path / "out").exists()


def test_workers_are_refused_with_ray(tmp_path: Path, awkward_tree: Tree, capsys) -> None:
    args = ["build", str(awkward_tree.root), str(tmp_path / "out"), "--ray", "--workers", "2"]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("ingest build: error: --workers is for a local build; with --ray")
    assert not (tmp_path / "out").exists()


def test_an_address_where_no_cluster_answers_fails_at_once(
    tmp_path: Path, awkward_tree: Tree, capsys
) -> None:
    pytest.importorskip("ray")
    with socket.socket() as s:  # a port that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["build", str(awkward_tree.root), str(tmp_path / "out"), "--ray", f"127.0.0.1:{port}"]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        f"ingest build: error: no Ray cluster answers at 127.0.0.1:{port} (Connection refused): "
        "start one there with `ray start --head --port 6379`, or check the address\n"
    )
    assert not (tmp_path / "out").exists()


def test_an_interrupted_ray_build_is_not_resumed_locally(
    tmp_path: Path, awkward_tree: Tree, awkward_store: Path, caplog
) -> None:
    out = tmp_path / "store"
    out.mkdir()
    digest = fingerprint(scan(awkward_tree.root), AWKWARD_OPTIONS.output_affecting())
    fmt.write_json_atomic(out / fmt.BUILD_STATE, fresh_state(digest, "ray"))
    with caplog.at_level(logging.WARNING, logger="ingest"):
        build(awkward_tree.root, out, AWKWARD_OPTIONS, workers=1, progress=False)
    assert f"{out} holds an interrupted build made with --ray; starting over" in caplog.text
    assert_same_store(out, awkward_store)


def test_cli_ray_on_a_new_local_instance(
    tmp_path: Path, awkward_tree: Tree, awkward_store: Path
) -> None:
    # First in the module: no Ray runs yet in this process; the command starts its own.
    pytest.importorskip("ray")
    out = tmp_path / "store"
    done = run_ingest("build", awkward_tree.root, out, "--ray", "--shard-size", "48KiB")
    assert done.returncode == 0, done.stderr
    assert "seen 37 = kept 26 + rejected 6 + ignored 5 in 16 shard(s)" in done.stdout
    assert done.stderr == ""  # nothing from Ray on the terminal
    assert_same_store(out, awkward_store)


@pytest.fixture(scope="module")
def ray_address():
    """A local Ray instance of 2 CPUs for the module; its address, for drivers to join."""
    ray = pytest.importorskip("ray")
    # The tasks' fault hooks are functions of this module, which the workers cannot
    # import (tests/ is not on their path): send them by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    context = ray.init(
        num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
    )
    yield context.address_info["address"]
    ray.shutdown()


def test_ray_build_gives_the_local_store(
    tmp_path: Path, ray_address: str, awkward_tree: Tree, awkward_store: Path
) -> None:
    from ingest.build.ray import build_ray

    out = tmp_path / "store"
    # 4 samples a task: 8 ranges of the first pass, none of them cut at a shard boundary.
    manifest = build_ray(awkward_tree.root, out, AWKWARD_OPTIONS, progress=False, range_items=4)
    assert (manifest["num_samples"], manifest["num_rejected"]) == (26, 6)
    assert len(manifest["shards"]) == 16
    assert_same_store(out, awkward_store)  # manifest, index, paths, rejects, data.mdb bytes


class KillOnce:
    """A fault hook: SIGKILL the worker running the task at (pass, range/shard, item),
    the first time only (a marker file says it was done)."""

    def __init__(self, at: tuple[str, int, int], marker: Path) -> None:
        self.at, self.marker = at, marker

    def __call__(self, kind: str, where: int, item: int) -> None:
        if (kind, where, item) == self.at and not self.marker.exists():
            self.marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_killed_worker_is_retried_to_the_same_store(
    tmp_path: Path, ray_address: str, awkward_tree: Tree, awkward_store: Path
) -> None:
    from ingest.build.ray import build_ray

    kills = [KillOnce(("check", 8, 2), tmp_path / "check-kill"),
             KillOnce(("write", 4, 2), tmp_path / "write-kill")]  # fmt: skip

    def fault(kind: str, where: int, item: int) -> None:
        for kill in kills:
            kill(kind, where, item)

    out = tmp_path / "store"
    build_ray(awkward_tree.root, out, AWKWARD_OPTIONS, progress=False, range_items=4, fault=fault)
    pids = {int((tmp_path / name).read_text()) for name in ("check-kill", "write-kill")}
    assert len(pids) == 2 and os.getpid() not in pids  # two worker processes were killed
    assert_same_store(out, awkward_store)  # the half-written shard 4 left nothing behind


def test_a_file_changed_between_the_passes_stops_the_build(
    tmp_path: Path, ray_address: str, awkward_tree: Tree
) -> None:
    from ingest.build.ray import build_ray

    src = tmp_path / "src"
    shutil.copytree(awkward_tree.root, src)
    victim = src / "class_00" / "img_00000.JPEG"
    changed = bytearray(victim.read_bytes())
    changed[-3] ^= 0xFF  # the same size, other bytes
    spare = tmp_path / "changed.JPEG"
    spare.write_bytes(bytes(changed))

    def fault(kind: str, where: int, item: int) -> None:
        # At the second pass's first sample in any task: the victim's shard may be
        # another task's, which may start first (it did now and then, and the build
        # passed). Renamed into place: whole, and by one task only.
        if kind == "write":
            with contextlib.suppress(FileNotFoundError):  # another task did it
                os.replace(spare, victim)

    with pytest.raises(SourceError, match=f"^{victim} changed while the build ran"):
        build_ray(src, tmp_path / "out", AWKWARD_OPTIONS, progress=False, fault=fault)
    assert not (tmp_path / "out" / fmt.MANIFEST).exists()


def test_a_store_error_in_a_task_is_its_one_line(tmp_path: Path, ray_address: str, awkward_tree):
    """A StoreError raised on a node (its py-lmdb without LMDB 0.9's engine) reached the
    command as Ray's task error, whose message is the whole remote traceback."""
    from ingest.build.ray import build_ray

    def fault(kind: str, where: int, item: int) -> None:
        if kind == "write":
            raise fmt.StoreError("py-lmdb here has no LMDB 0.9 engine")

    with pytest.raises(fmt.StoreError) as raised:
        build_ray(awkward_tree.root, tmp_path / "out", AWKWARD_OPTIONS, progress=False,
                  fault=fault)  # fmt: skip
    assert str(raised.value) == "py-lmdb here has no LMDB 0.9 engine"


def test_a_killed_driver_resumes_to_the_same_store(tmp_path: Path, ray_address: str) -> None:
    src = make_big_tree(tmp_path / "src")
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = ["build", src, out, "--shard-size", "200KiB", "--ray", ray_address]
    sealed = kill_9_after_a_shard(args, out, within=120)  # once the driver recorded one
    assert 0 < len(sealed) < 23
    plans = sorted(p.name for p in (out / fmt.PARTIAL_DIR).glob("plan2-*.msgpack"))
    assert plans == [  # the first pass was done: 2 ranges of at most 64 samples
        "plan2-000000000000-000000000064.msgpack",
        "plan2-000000000064-000000000122.msgpack",
    ]
    inodes = {name: (out / name / "data.mdb").stat().st_ino for name in sealed}

    rerun = run_ingest(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert "seen 122 = kept 120 + rejected 2 + ignored 0 in 23 shard(s)" in rerun.stdout
    assert f"resuming the interrupted build in {out}: {len(sealed)} sealed shard(s)" in (
        rerun.stderr
    )
    # Sealed shards were kept, not rewritten: the build resumed.
    assert {name: (out / name / "data.mdb").stat().st_ino for name in sealed} == inodes
    assert not (out / fmt.BUILD_STATE).exists() and not (out / fmt.PARTIAL_DIR).exists()

    build(src, clean, BuildOptions(shard_size=200 * KiB), workers=1, progress=False)
    assert_same_store(out, clean)


def test_a_task_on_a_node_without_src_or_out_refuses_to_run(tmp_path: Path) -> None:
    from ingest.build.tasks import check_range

    missing, out = tmp_path / "nowhere", tmp_path / "out"
    (out / fmt.PARTIAL_DIR).mkdir(parents=True)
    plan = out / fmt.PARTIAL_DIR / "plan.msgpack"
    with pytest.raises(SourceError, match=f"^{missing} is not there on node .*: put SRC and OUT"):
        check_range(missing, [], 0, AWKWARD_OPTIONS, plan, None)
    with pytest.raises(OutputError, match=f"^{missing} is not there on node .*: put SRC and OUT"):
        check_range(tmp_path, [], 0, AWKWARD_OPTIONS, missing / fmt.PARTIAL_DIR / "p", None)


def test_a_rerun_takes_the_first_pass_from_its_plans(
    tmp_path: Path, ray_address: str, awkward_tree: Tree, awkward_store: Path
) -> None:
    import ray

    from ingest.build.ray import build_ray

    def fail_writing(kind: str, where: int, item: int) -> None:
        if kind == "write" and where == 5:
            raise RuntimeError("injected failure")

    def no_checking(kind: str, where: int, item: int) -> None:
        if kind == "check":
            raise RuntimeError("the first pass ran again")

    out = tmp_path / "store"
    with pytest.raises(ray.exceptions.RayTaskError, match="injected failure"):
        build_ray(awkward_tree.root, out, AWKWARD_OPTIONS, progress=False, range_items=4,
                  fault=fail_writing)  # fmt: skip
    assert len(list((out / fmt.PARTIAL_DIR).glob("plan2-*.msgpack"))) == 8
    build_ray(awkward_tree.root, out, AWKWARD_OPTIONS, progress=False, range_items=4,
              fault=no_checking)  # fmt: skip
    assert_same_store(out, awkward_store)


def test_no_valid_image_is_an_error_with_ray_too(tmp_path: Path, ray_address: str) -> None:
    from ingest.build.ray import build_ray

    src, out = tmp_path / "src", tmp_path / "out"
    for name in ("class_00", "class_01"):
        (src / name).mkdir(parents=True)
        (src / name / "bad.jpg").write_bytes(b"<html>404</html>")
    with pytest.raises(SourceError, match=r"^no valid image in .*: 2 file\(s\) rejected"):
        build_ray(src, out, AWKWARD_OPTIONS, progress=False)
    assert not (out / fmt.MANIFEST).exists()
    lines = (out / fmt.REJECTS).read_text().splitlines()
    assert [json.loads(line)["path"] for line in lines] == ["class_00/bad.jpg", "class_01/bad.jpg"]


def test_names_that_are_not_utf8_with_ray(tmp_path: Path, ray_address: str) -> None:
    from ingest.build.ray import build_ray

    src = tmp_path / "src"
    make_image_folder(src, 2, 2, short_side=(48, 72))
    raw = os.fsencode(src)
    os.mkdir(raw + b"/cl\xffass")
    jpeg = (src / "class_01" / "img_00000.JPEG").read_bytes()
    for name, data in ((b"/class_01/caf\xe9.jpg", jpeg), (b"/cl\xffass/x.jpg", jpeg),
                       (b"/cl\xffass/bad\xfe.jpg", b"<html>404</html>")):  # fmt: skip
        with open(raw + name, "wb") as f:
            f.write(data)
    manifest = build_ray(src, tmp_path / "ray", progress=False, range_items=2)
    assert (manifest["num_samples"], manifest["num_rejected"]) == (6, 1)
    build(src, tmp_path / "local", workers=1, progress=False)
    assert_same_store(tmp_path / "ray", tmp_path / "local")
    rejected = json.loads((tmp_path / "ray" / fmt.REJECTS).read_text())
    assert rejected["path"] == os.fsdecode(b"cl\xffass/bad\xfe.jpg")


def test_an_interrupted_local_build_is_not_resumed_with_ray(
    tmp_path: Path, ray_address: str, awkward_tree: Tree, awkward_store: Path, caplog
) -> None:
    from ingest.build.ray import build_ray

    out = tmp_path / "store"
    out.mkdir()
    digest = fingerprint(scan(awkward_tree.root), AWKWARD_OPTIONS.output_affecting())
    fmt.write_json_atomic(out / fmt.BUILD_STATE, {**fresh_state(digest), "cursor": 5})
    with caplog.at_level(logging.WARNING, logger="ingest"):
        build_ray(awkward_tree.root, out, AWKWARD_OPTIONS, progress=False)
    assert f"{out} holds an interrupted build made without --ray; starting over" in caplog.text
    assert_same_store(out, awkward_store)

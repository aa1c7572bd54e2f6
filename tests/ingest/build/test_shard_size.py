"""Shard sizes this machine cannot map (issue 40): refused at the door, saying the limit.

A shard is mapped in memory whole while it is written (LMDB's map: 1.25x the shard size,
doubled if small records outgrow that). ``--shard-size 2**63`` raised an OverflowError
traceback and ``100TiB`` failed at the first shard with "Cannot allocate memory; check the
disk", the same again at each rerun.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from fixtures import REPO

from ingest.build import BuildOptions, build
from ingest.build.resume import OutputError
from ingest.build.writer import MiB, ShardSizeError, check_shard_size
from ingest.cli import parse_size
from loader.bench.synth import make_image_folder

TiB = 1 << 40
WHY = (
    r"a shard is mapped in memory whole while it is written \(1\.25x its size, doubled if "
    r"small records outgrow that\), and this process can map about (?P<limit>[\d.]+[KMGT]iB) "
    r"at once \((?:its largest free block of address space|`ulimit -v` lets it have "
    r"[\d.]+[KMGT]iB in all)\); pass a shard size of at most (?P<most>[\d.]+[KMGT]iB)"
    r"(?:, or raise `ulimit -v`)?$"
)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard-size") / "src"
    make_image_folder(root, 2, 3, seed=1)
    return root


def ingest(*args, ulimit_kib: int | None = None) -> subprocess.CompletedProcess:
    """``python3 -m ingest ARGS``, under ``ulimit -v ulimit_kib`` if given."""
    limit = f"ulimit -v {ulimit_kib} && " if ulimit_kib else ""
    return subprocess.run(
        ["bash", "-c", f'{limit}exec "$0" "$@"', sys.executable, "-m", "ingest", *map(str, args)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


@pytest.mark.parametrize(
    "size", [str(2**63), "100TiB", "9" * 400], ids=["2**63", "100TiB", "1e400"]
)
def test_the_cli_refuses_a_shard_size_no_process_can_map(src, tmp_path, size):
    out = tmp_path / "out"
    for _ in range(2):  # and a rerun says the same
        done = ingest("build", src, out, "--shard-size", size, "--workers", "1")
        assert (done.returncode, done.stdout) == (2, "")
        assert len(done.stderr.splitlines()) == 1, done.stderr  # no traceback, no usage
        line = done.stderr.rstrip("\n")
        assert re.match(rf"^ingest build: error: --shard-size {size}: {WHY}", line), line
        assert not out.exists()


def test_the_cli_limit_is_what_ulimit_v_leaves_and_the_size_it_advises_builds(src, tmp_path):
    # Under `ulimit -v 4GiB`, a 4GiB shard (a map of 5GiB, 10GiB grown) is refused at
    # once; the size the message advises builds, under the same limit.
    out = tmp_path / "out"
    done = ingest("build", src, out, "--shard-size", "4GiB", ulimit_kib=4 << 20)
    assert (done.returncode, done.stdout) == (2, "") and not out.exists()
    line = done.stderr.rstrip("\n")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert line.startswith("ingest build: error: --shard-size 4GiB: "), line
    assert line.endswith(", or raise `ulimit -v`"), line
    assert "(`ulimit -v` lets it have 4GiB in all)" in line, line
    found = re.search(WHY, line)
    assert found, line
    limit, most = parse_size(found["limit"]), parse_size(found["most"])
    assert 2 << 30 < limit < 4 << 30  # what the interpreter left of the 4GiB
    assert 512 * MiB < most < limit * 0.95 / 2.5
    done = ingest("build", src, out, "--shard-size", found["most"], ulimit_kib=4 << 20)
    assert done.returncode == 0, done.stderr
    assert "in 1 shard(s)" in done.stdout


@pytest.mark.parametrize(
    ("size", "given"),
    [(2**63, f"shard_size={2**63}"), (100 * TiB, "--shard-size 100TiB")],
    ids=["2**63", "100TiB"],
)
def test_check_shard_size_refuses_what_cannot_be_mapped(size, given):
    with pytest.raises(ShardSizeError, match=rf"^{re.escape(given)}: {WHY}") as refused:
        check_shard_size(size, None if given.startswith("shard_size=") else given)
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, OutputError)
    most = parse_size(re.search(WHY, str(refused.value))["most"])
    check_shard_size(most)  # the size it advises passes
    check_shard_size(BuildOptions().shard_size)  # and the default, 512MiB
    check_shard_size(1)


@pytest.mark.parametrize("size", [0, -1, 1.5, True, "512MiB", None])
def test_check_shard_size_refuses_what_is_not_a_size(size):
    with pytest.raises(
        ShardSizeError, match=r"is invalid: pass a whole number of bytes, at least 1$"
    ):
        check_shard_size(size)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_map_that_cannot_be_made_is_said_as_such_not_as_a_disk_failure(src, tmp_path, workers):
    # map_size= (or a map grown past what fits) fails in the writer: there, the same limit.
    out = tmp_path / "out"
    opts = BuildOptions(shard_size=64 << 10)
    with pytest.raises(ShardSizeError) as refused:
        build(src, out, opts, workers=workers, progress=False, map_size=1 << 62)
    message = str(refused.value)
    assert re.match(
        r"^shard-\d{5}: its LMDB map of 4194304TiB could not be made \(.*Cannot allocate "
        r"memory\), and this process can map about [\d.]+[KMGT]iB at once \(.*\); build with "
        r"a shard size of at most [\d.]+[KMGT]iB(?:, or raise `ulimit -v`)? \(or give build\(\) "
        r"a smaller map_size\)$",
        message,
    ), message
    assert "check the disk" not in message


def test_the_python_build_refuses_it_before_out_is_made(tmp_path):
    from ingest.build.writer import ShardSizeError
    from loader.bench.synth import make_image_folder

    make_image_folder(tmp_path / "src", 1, 2, seed=1, short_side=(32, 40))
    with pytest.raises(ShardSizeError, match="a shard is mapped in memory whole"):
        build(tmp_path / "src", tmp_path / "out", BuildOptions(shard_size=2**63), workers=1)
    assert not (tmp_path / "out").exists()

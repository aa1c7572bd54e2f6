"""The `ingest` command and the build API at their edges: bad inputs, --strict, info, verify."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO, read_shards, run_ingest

from ingest import format as fmt
from ingest.build import build
from ingest.build.resume import OutputError
from ingest.build.scan import SourceError
from ingest.format.codec import unpack_record
from ingest.verify import verify_store
from loader.bench.synth import make_image_folder


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 classes x 3 JPEGs and one HTML page named .jpg (a reject)."""
    root = tmp_path_factory.mktemp("small") / "src"
    make_image_folder(root, 2, 3, seed=11, short_side=(40, 56))
    (root / "class_01" / "download.jpg").write_text("<html><body>Access denied</body></html>")
    return root


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(
    "make_src, match",
    [
        (lambda p: p / "missing", r"source .*missing does not exist; pass the image folder"),
        (lambda p: _touch(p / "file.jpg"), r"source .*file\.jpg is not a directory"),
        (lambda p: _touch(p / "flat" / "a.jpg").parent, r"has no class folders; expected"),
        (
            lambda p: _store_like(p / "store"),  # it said "no valid image"
            r"source .*store is the output of `ingest build` \(a store, or a build of one\), not "
            r"an image folder; pass the image folder it was built from$",
        ),
    ],
    ids=["missing", "file", "no-class-folders", "a-store"],
)
def test_bad_source_is_refused(tmp_path: Path, make_src, match: str) -> None:
    with pytest.raises(SourceError, match=match):
        build(make_src(tmp_path), tmp_path / "out", workers=1, progress=False)
    assert not (tmp_path / "out").exists()


def _store_like(path: Path) -> Path:
    """A folder with a store's manifest (its format named), nothing else."""
    path.mkdir(parents=True)
    (path / fmt.MANIFEST).write_text(json.dumps({"format": fmt.FORMAT_NAME}))
    return path


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\xff\xd8\xff")
    return path


def test_bad_output_is_refused(tmp_path: Path, small_tree: Path) -> None:
    out = tmp_path / "out"
    first = build(small_tree, out, workers=1, progress=False)
    with pytest.raises(OutputError, match=r"is already a complete store; pass --overwrite"):
        build(small_tree, out, workers=1, progress=False)
    assert fmt.read_manifest(out) == first  # untouched
    assert build(small_tree, out, workers=1, progress=False, overwrite=True) == first

    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(OutputError, match=r"non-empty directory that is not a store"):
        build(small_tree, foreign, workers=1, progress=False, overwrite=True)
    assert [p.name for p in foreign.iterdir()] == ["holiday.jpg"]  # nothing deleted

    with pytest.raises(OutputError, match=r"is a file; pass a directory path"):
        build(small_tree, foreign / "holiday.jpg", workers=1, progress=False)
    assert (foreign / "holiday.jpg").read_bytes() == b"precious"


def test_cli_errors_are_one_line_and_exit_non_zero(tmp_path: Path, small_tree: Path) -> None:
    missing = run_ingest("build", tmp_path / "nope", tmp_path / "out")
    assert missing.returncode == 2 and missing.stdout == ""
    assert one_line(missing.stderr).startswith("ingest build: error: source ")
    assert "does not exist" in missing.stderr

    out = tmp_path / "store"
    assert run_ingest("build", small_tree, out, "--workers", "1").returncode == 0
    again = run_ingest("build", small_tree, out)
    assert again.returncode == 2
    assert "is already a complete store; pass --overwrite" in one_line(again.stderr)
    assert run_ingest("build", small_tree, out, "--overwrite").returncode == 0

    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    foreign = run_ingest("build", small_tree, tmp_path / "foreign")
    assert foreign.returncode == 2
    assert "non-empty directory that is not a store" in one_line(foreign.stderr)

    bad = run_ingest("build", small_tree, tmp_path / "x", "--compression", "lz4")
    assert bad.returncode == 2 and "unknown compressor 'lz4'" in bad.stderr
    assert not (tmp_path / "x").exists()

    not_store = run_ingest("info", tmp_path / "foreign")
    assert not_store.returncode == 2
    assert "not a complete store, manifest.json is missing" in one_line(not_store.stderr)


def test_strict_fails_on_a_reject_but_completes_the_store(tmp_path: Path, small_tree: Path):
    lenient = run_ingest("build", small_tree, tmp_path / "lenient", "--workers", "1")
    assert lenient.returncode == 0, lenient.stderr
    strict = run_ingest("build", small_tree, tmp_path / "strict", "--workers", "1", "--strict")
    assert strict.returncode == 1
    assert "seen 7 = kept 6 + rejected 1 + ignored 0" in strict.stdout
    assert strict.stderr == (  # it said nothing of why it failed
        "ingest build: error: --strict, and 1 file(s) were rejected (the store holds the "
        "others); fix or remove them, then build again with --overwrite\n"
    )
    store = tmp_path / "strict"
    manifest = fmt.read_manifest(store)
    assert (manifest["num_samples"], manifest["num_rejected"]) == (6, 1)
    assert verify_store(store) == []
    rejects = [json.loads(line) for line in (store / fmt.REJECTS).read_text().splitlines()]
    assert [r["path"] for r in rejects] == ["class_01/download.jpg"]
    assert "HTML" in rejects[0]["reason"]
    assert read_shards(store) == read_shards(tmp_path / "lenient")


def test_info_json(awkward_store: Path) -> None:
    result = run_ingest("info", awkward_store, "--json")
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    manifest = fmt.read_manifest(awkward_store)
    expected = {
        "num_samples": 26,
        "num_classes": 2,
        "classes": ["class_00", "class_01"],
        "num_rejected": 6,
        "num_ignored": 5,
        "num_seen": 37,
    }
    assert {k: info[k] for k in expected} == expected
    assert [(s["name"], s["first"], s["count"]) for s in info["shards"]] == [
        (s["name"], s["first"], s["count"]) for s in manifest["shards"]
    ]
    assert sum(s["count"] for s in info["shards"]) == 26
    assert len(info["shards"]) == len(manifest["shards"]) > 1

    text = run_ingest("info", awkward_store)
    assert text.returncode == 0
    assert "seen       37 = kept 26 + rejected 6 + ignored 5" in text.stdout
    lines = [" ".join(line.split()) for line in text.stdout.splitlines()]
    assert "rejected: empty file 1" in lines
    assert "rejected: HTML/XML text, not an image 1" in lines
    assert "ignored: hidden or system file 3" in lines


def test_info_says_when_the_files_are_not_as_the_manifest_says(tmp_path: Path, clean_store):
    """``ingest info`` prints the manifest's summary; a truncated shard or a missing index
    made it look healthy (exit 0), where only ``ingest verify`` told."""
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    shard = store / fmt.shard_name(1) / "data.mdb"
    size = shard.stat().st_size
    os.truncate(shard, size - 4096)
    result = run_ingest("info", store)
    assert result.returncode == 1 and "samples    " in result.stdout
    assert result.stderr == (
        f"ingest info: error: {shard}: {size - 4096} bytes where the manifest records {size} "
        "(truncated or replaced); the store is damaged: rebuild it\n"
    )
    (store / fmt.INDEX).unlink()
    result = run_ingest("info", store, "--json")
    assert result.returncode == 1
    assert [p.split(":")[0] for p in json.loads(result.stdout)["problems"]] == [
        str(store / fmt.INDEX),
        str(shard),
    ]
    assert result.stderr == (
        f"ingest info: error: 2 of its files are not as its manifest says; the first: "
        f"{store / fmt.INDEX}: No such file or directory; the store is incomplete: rebuild it\n"
    )
    assert run_ingest("info", clean_store).stderr == ""


def test_verify_names_the_shard_and_key_of_a_flipped_byte(tmp_path: Path, clean_store: Path):
    store = tmp_path / "store"
    shutil.copytree(clean_store, store)
    clean = run_ingest("verify", store)
    assert clean.returncode == 0, clean.stderr
    assert "OK, 24 records checked" in clean.stdout
    assert verify_store(store) == []

    entry = fmt.read_manifest(store)["shards"][1]
    key = entry["first"] + 1
    payload = unpack_record(read_shards(store)[key][2])["image"]
    data_mdb = store / entry["name"] / "data.mdb"
    data = bytearray(data_mdb.read_bytes())
    at = data.find(payload)
    assert at > 0 and data.find(payload, at + 1) == -1
    data[at + len(payload) // 2] ^= 0x55
    data_mdb.write_bytes(bytes(data))

    broken = run_ingest("verify", store)
    assert broken.returncode != 0
    assert f"{entry['name']}: key {key}: " in broken.stderr
    problems = verify_store(store)
    assert len(problems) == 2
    assert problems[0].startswith(f"{entry['name']}: key {key}: ") and "CRC-32" in problems[0]
    assert problems[1].startswith(f"{entry['name']}: content checksum mismatch")


@pytest.mark.parametrize("command", ["ingest info", "ingest info --json", "loader.bench --replot"])
def test_a_reader_gone_ends_the_command_quietly(
    command: str, awkward_store: Path, tmp_path: Path
) -> None:
    """``ingest info STORE | head -1``: the reader has gone before the output is written.
    It printed a BrokenPipeError's traceback (and another at the interpreter's exit)."""
    module, *args = command.split()
    if module == "ingest":
        args.append(str(awkward_store))
    else:  # imfeed-bench prints a finished run's table again
        shutil.copy(
            REPO / "benchmarks" / "results" / "gpu-h200-picker11.json", tmp_path / "run.json"
        )
        args.append(str(tmp_path / "run.json"))
    read, write = os.pipe()
    os.close(read)  # the reader is gone: every write fails with EPIPE
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, stdout=write, stderr=subprocess.PIPE,
        text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False,
    )  # fmt: skip
    os.close(write)
    assert (proc.returncode, proc.stderr) == (128 + signal.SIGPIPE, "")


def test_a_closed_stdout_is_no_error(awkward_store: Path) -> None:
    """Started with standard output closed (``>&-``), Python has no ``sys.stdout``: the
    pipe handling's flush failed there with an AttributeError, after the work was done."""
    proc = subprocess.run(
        [sys.executable, "-m", "ingest", "info", str(awkward_store)], cwd=REPO,
        stderr=subprocess.PIPE, text=True, timeout=60, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)}, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_broken_pipe_that_is_not_stdout_is_not_hidden() -> None:
    """Only a reader of standard output gone ends the command quietly: a worker's pipe
    broken is an error to show (it ended ``ingest build`` silently with exit 141)."""
    from ingest.cli import quiet_pipe

    def main(argv):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        quiet_pipe(main)([])


def test_the_convert_command_suggested_for_an_image_folder_runs_as_shown(tmp_path, monkeypatch):
    """Given where a store goes, an image folder's message suggests the build: outside the
    folder (a store inside its source is refused), quoted for the shell."""
    make_image_folder(tmp_path / "my imgs", 2, 1, short_side=(48, 56))
    monkeypatch.chdir(tmp_path / "my imgs")
    with pytest.raises(fmt.StoreError, match=r"`ingest build \. '\.\./my imgs\.lmdb'`"):
        fmt.read_manifest(".")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(fmt.StoreError, match=r"`ingest build 'my imgs' 'my imgs\.lmdb'`"):
        fmt.read_manifest("my imgs")
    result = run_ingest("build", tmp_path / "my imgs", tmp_path / "my imgs.lmdb", "--workers", "1")
    assert result.returncode == 0, result.stderr  # the command suggested, run

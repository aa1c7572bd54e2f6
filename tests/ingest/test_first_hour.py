"""What a new user meets first: `ingest --help`/`--version`, defaults in the help, a progress
bar in `ingest verify`, resume messages that say what was resumed or what differs."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
from fixtures import CLEAN_OPTIONS, assert_same_store

import ingest.build.tasks
from ingest import cli
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.verify import verify_store


def run_cli(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main(list(argv))
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_describes_the_tool_with_defaults(capsys):
    top = run_cli(capsys, "--help")
    assert "Pack an image folder (torchvision ImageFolder layout: SRC/CLASS/IMAGE)" in top
    assert "argparse only" not in top
    flat = " ".join(run_cli(capsys, "build", "--help").split())
    assert "--shard-size SIZE shards roll over at this many bytes (default: 512MiB)" in flat
    assert "--quality Q JPEG quality of re-encoded images (default: 95)" in flat


def test_version(capsys):
    out = run_cli(capsys, "--version")
    assert re.fullmatch(rf"ingest \(imfeed\) \S+, store format v{fmt.FORMAT_VERSION}\n", out)


def test_verify_shows_progress(clean_store, capsys):
    assert verify_store(clean_store, progress=True) == []
    err = capsys.readouterr().err
    assert re.search(r"verify: 100%.* 24/24 ", err), err
    assert verify_store(clean_store, progress=False) == [] and capsys.readouterr().err == ""


def interrupted_build(src: Path, out: Path, options: BuildOptions, monkeypatch, after: int):
    """Build until the shards written hold ``after`` images or more, then stop as Ctrl-C
    does (before the next shard is written)."""
    real = ingest.build.tasks.write_shard

    def stopping(src, out, k, first, *args):
        if first >= after:
            raise KeyboardInterrupt
        return real(src, out, k, first, *args)

    with monkeypatch.context() as m:
        m.setattr(ingest.build.tasks, "write_shard", stopping)
        with pytest.raises(KeyboardInterrupt):
            build(src, out, options, workers=1, progress=False)
    return json.loads((out / fmt.BUILD_STATE).read_text())


def test_a_resumed_build_says_so(tmp_path, clean_tree, clean_store, monkeypatch, caplog):
    out = tmp_path / "store"
    state = interrupted_build(clean_tree, out, CLEAN_OPTIONS, monkeypatch, after=15)
    cursor, sealed = state["cursor"], len(state["shards"])
    assert 15 <= cursor < 24 and sealed > 0
    with caplog.at_level(logging.WARNING, logger="ingest.build.resume"):
        build(clean_tree, out, CLEAN_OPTIONS, workers=1, progress=False)
    assert caplog.messages == [
        f"ingest: resuming the interrupted build in {out}: {cursor} of 24 images were done, "
        f"in {sealed} sealed shard(s)"
    ]
    assert_same_store(out, clean_store)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"shard_size": 64 << 10},
         "with other options (--shard-size 32KiB then, --shard-size 64KiB now)"),
        ({"quality": 90, "verify": False},
         "with other options (--quality 95 then, --quality 90 now; verification on then, "
         "--no-verify now)"),
        ({}, "of other source files (24 then, 23 now, or files were changed, renamed or touched "
             "since)"),
    ],
)  # fmt: skip
def test_a_discarded_build_says_what_differs(
    tmp_path, clean_tree, monkeypatch, caplog, change, why
):
    src = tmp_path / "src"
    shutil.copytree(clean_tree, src)
    out = tmp_path / "store"
    interrupted_build(src, out, CLEAN_OPTIONS, monkeypatch, after=15)
    if not change:
        next(src.rglob("*.JPEG")).unlink()
    options = BuildOptions(**{**CLEAN_OPTIONS.__dict__, **change})
    with caplog.at_level(logging.WARNING, logger="ingest.build.resume"):
        manifest = build(src, out, options, workers=1, progress=False)
    assert caplog.messages == [f"ingest: {out} holds an interrupted build {why}; starting over"]
    assert manifest["num_samples"] == (24 if change else 23)


def test_a_build_interrupted_under_another_converter_starts_over(
    tmp_path, clean_tree, clean_store, monkeypatch, caplog
):
    """Its plans hold the records the other converter made (a JPEG not cut at its end):
    resumed, the second pass made other bytes and the build failed on every rerun with
    "changed while the build ran"."""
    out = tmp_path / "store"
    with monkeypatch.context() as m:
        m.setattr(fmt, "CONVERTER_VERSION", 1)
        interrupted_build(clean_tree, out, CLEAN_OPTIONS, monkeypatch, after=15)
    with caplog.at_level(logging.WARNING, logger="ingest.build.resume"):
        build(clean_tree, out, CLEAN_OPTIONS, workers=1, progress=False)
    assert caplog.messages == [
        f"ingest: {out} holds an interrupted build made by another version of ingest (its "
        "converter stores other bytes); starting over"
    ]
    assert_same_store(out, clean_store)


def test_a_build_state_of_an_older_ingest_is_named_so(clean_tree):
    from ingest.build.resume import difference, fingerprint
    from ingest.build.scan import scan

    now = fingerprint(scan(clean_tree), CLEAN_OPTIONS.output_affecting())
    assert now == json.loads(json.dumps(now))  # compares equal to itself read back
    assert difference("3f5a" * 16, now) == "made by another version of ingest"
    before = {k: v for k, v in now.items() if k != "converter"}  # before it entered
    assert difference(before, now) == "made by another version of ingest"
    assert difference({**now, "converter": 1}, now) == (
        "made by another version of ingest (its converter stores other bytes)"
    )
    assert difference({**now, "version": 0}, now) == (
        f"of store format v0 (this ingest writes v{fmt.written_version('jpeg')})"
    )

"""imfeed-bench stopped midway (``timeout``'s SIGTERM to its process group, or to the main
process alone): it writes the timed passes every pipeline finished, says it was cut short,
and exits 130; stopped before one was done, it writes nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fixtures import REPO

from loader.bench.synth import make_image_folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stopped")
    make_image_folder(root / "images", 2, 6, seed=4)
    return root / "images"


def bench_until(images: Path, tmp_path: Path, line: str, group: bool) -> tuple[int, str]:
    """Run the bench (2 pipelines, 3 passes of at least a second each) and send SIGTERM
    when its stderr shows ``line``; (exit code, stderr)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--data", images, "--workdir", tmp_path / "work", "--out", tmp_path / "out",
            "--name", "t", "--batch-size", "4", "--workers", "1", "--device", "cpu",
            "--passes", "3", "--min-pass-seconds", "1",
            "--only", "torch-pil,loader-cpu"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loader.bench", *map(str, args)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    said = []
    for text in proc.stderr:
        said.append(text)
        if line in text:
            if group:  # as ``timeout`` does: the pipelines' processes get it too
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            break
    said += proc.stderr.readlines()
    proc.stdout.read()
    return proc.wait(timeout=120), "".join(said)


@pytest.mark.parametrize("group", [True, False])
def test_a_run_stopped_after_a_pass_writes_that_pass(images, tmp_path, group):
    code, said = bench_until(images, tmp_path, "pass 2/3", group)
    assert code == 130, said
    assert "stopped: 1 of 3 timed passes done" in said
    report = json.loads((tmp_path / "out" / "t.json").read_text())
    assert report["stopped"] == "stopped after 1 of 3 timed passes"
    results = report["results"]
    for name in ("torch-pil", "loader-cpu"):
        assert results[name]["status"] == "ok", results[name]
        assert len(results[name]["rates"]) == 1  # the warm-up and pass 1; pass 2 dropped
        assert [p["images"] % 12 for p in results[name]["passes"]] == [0, 0]  # whole epochs
    md = (tmp_path / "out" / "t.md").read_text()
    assert "The run was stopped after 1 of 3 timed passes: these are their figures." in md


def test_a_run_stopped_in_its_warm_up_writes_nothing(images, tmp_path):
    code, said = bench_until(images, tmp_path, "warm-up", group=True)
    assert code == 130, said
    assert said.rstrip().endswith(
        "imfeed-bench: stopped before a timed pass was done; nothing written"
    )
    assert not (tmp_path / "out" / "t.json").exists()
    assert not (tmp_path / "out" / "t.md").exists()

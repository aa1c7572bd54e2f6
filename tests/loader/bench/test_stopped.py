"""imfeed-bench stopped midway (``timeout``'s SIGTERM to its process group, or to the main
process alone): it writes the timed passes every pipeline finished, says it was cut short,
and exits 130; stopped before one was done, it writes nothing."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fixtures import REPO

from loader.bench.rounds import rounds
from loader.bench.synth import make_image_folder


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stopped")
    make_image_folder(root / "images", 2, 6, seed=4)
    return root / "images"


def bench_until(images: Path, tmp_path: Path, line: str, group: bool) -> tuple[int, str]:
    """Run the bench (2 pipelines, 3 passes of at least 3 s each) and send SIGTERM when its
    stderr shows ``line``; (exit code, stderr). Killed after 4 minutes, whatever happens."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--data", images, "--workdir", tmp_path / "work", "--out", tmp_path / "out",
            "--name", "t", "--batch-size", "4", "--workers", "1", "--device", "cpu",
            "--passes", "3", "--min-pass-seconds", "3",
            "--only", "torch-pil,loader-cpu"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "loader.bench", *map(str, args)],
        env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    watchdog = threading.Timer(240, os.killpg, (proc.pid, signal.SIGKILL))
    watchdog.start()
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
    code = proc.wait()
    watchdog.cancel()
    return code, "".join(said)


@pytest.mark.parametrize("group", [True, False])
def test_a_run_stopped_after_a_pass_writes_the_passes_done(images, tmp_path, group):
    code, said = bench_until(images, tmp_path, "pass 2/3", group)
    assert code == 130, said
    # the signal lands during the second round, unless the machine stalled past a 3 s pass
    done = int(re.search(r"stopped: (\d) of 3 timed passes done", said).group(1))
    assert done in (1, 2), said
    report = json.loads((tmp_path / "out" / "t.json").read_text())
    assert report["stopped"] == {"timed_passes": done, "in_training": False}
    results = report["results"]
    for name in ("torch-pil", "loader-cpu"):
        assert results[name]["status"] == "ok", results[name]
        assert len(results[name]["rates"]) == done  # the round under way dropped
        assert all(p["images"] % 12 == 0 for p in results[name]["passes"])  # whole epochs
    md = (tmp_path / "out" / "t.md").read_text()
    note = f"Stopped after {done} of 3 timed passes: the figures of those."
    assert note in md
    assert md.splitlines()[0].endswith(f"; stopped after {done} of 3 timed passes")
    assert not list((tmp_path / "out" / "logs").glob("*.log"))  # no traceback left in them


def test_a_run_stopped_in_its_warm_up_writes_nothing(images, tmp_path):
    code, said = bench_until(images, tmp_path, "warm-up", group=True)
    assert code == 130, said
    assert said.rstrip().endswith(
        "imfeed-bench: stopped before a timed pass was done; nothing written"
    )
    assert not (tmp_path / "out" / "t.json").exists()
    assert not (tmp_path / "out" / "t.md").exists()


class FakeServer:
    """Answers passes of 12 images; fails in its round ``fail_in``; raises KeyboardInterrupt
    (the stop's signal) when asked in its round ``stop_in``."""

    def __init__(self, fail_in: int | None = None, stop_in: int | None = None) -> None:
        self.fail_in, self.stop_in, self.round = fail_in, stop_in, -1

    def ask(self, request, timeout):
        self.round += 1  # asked once a round while it has not failed
        if self.round == self.stop_in:
            raise KeyboardInterrupt
        if self.round == self.fail_in:
            return {"error": "it died"}
        return {"images": 12, "seconds": 1.0, "cpu_seconds": 1.0, "first_batch_seconds": 0.1}


def test_a_stop_keeps_the_rounds_done_and_their_failures_only():
    """b fails in round 1; in round 2 (order d, e, a, c) d fails, e finishes its pass, then
    the stop comes: d's failure and e's pass go with the unfinished round."""
    servers = {"a": FakeServer(stop_in=2), "b": FakeServer(fail_in=1), "c": FakeServer(),
               "d": FakeServer(fail_in=2), "e": FakeServer()}  # fmt: skip
    said = []
    runs, failed, done = rounds(servers, 3, said.append)
    assert done == 1
    assert failed == {"b": "failed in pass 1: it died"}
    assert [len(runs[n]) for n in "abcde"] == [2, 1, 2, 2, 2]  # the warm-up and pass 1
    assert "  d: failed in pass 2: it died" in said
    assert any(line.strip().startswith("pass 2/3 e ") for line in said)
    assert said[-1] == "  stopped: 1 of 3 timed passes done"

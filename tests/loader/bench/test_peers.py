"""imfeed-bench's peer formats (FFCV, MosaicML Streaming, LitData, WebDataset): each converts
a small folder once and reads whole epochs as ours does (the same samples, shapes, dtype,
layout, labels and, with --eval, pixels); a peer not installed is skipped with the reason.
The conversion record, the busy-machine warning and the table and chart of ten pipelines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
import torch
from PIL import Image

from loader.bench import busy, chart, report, rounds, runner, stores
from loader.bench import data as bench_data
from loader.bench.peers import conversion
from loader.bench.pipelines import PEERS, Settings, build, specs, unavailable
from loader.bench.run import _results, choose
from loader.bench.synth import make_image_folder

NAMES = tuple(PEERS)
FORMATS = {"ffcv": "ffcv-jpg", "ffcv-raw": "ffcv-raw", "mds": "mds", "litdata": "litdata",
           "wds": "wds"}  # their folders under the workdir  # fmt: skip


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> bench_data.Data:
    """12 images in 3 classes (4 each), one of them a grey JPEG, and our store of them."""
    root = tmp_path_factory.mktemp("peers")
    make_image_folder(root / "images", 3, 4, seed=5)
    grey = sorted((root / "images").rglob("*.JPEG"))[0]
    with Image.open(grey) as image:
        image.convert("L").save(grey, quality=92)
    return bench_data.prepare(root / "images", 0, root / "work", None, lambda m: None)


def settings(small: bench_data.Data, **kw) -> Settings:
    base = Settings(folder=str(small.folder), store=str(small.store), batch_size=4, workers=0,
                    dtype="float32", channels_last=False, eval=False, device="cpu",
                    workdir=str(small.folder.parent / "work"))  # fmt: skip
    return dataclasses.replace(base, **kw)


def epoch(name: str, s: Settings) -> tuple[list, dict | None]:
    """One epoch of pipeline ``name``: its batches, and what it read (a peer's conversion)."""
    if name == "mds":  # a dataset closed in this process leaves Streaming's shared memory
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
    pipe = build(name, s)
    try:
        return list(pipe.epoch()), getattr(pipe, "made", None)
    finally:
        pipe.close()


def needs(name: str) -> None:
    pytest.importorskip(PEERS[name].package, reason=f"{name}: {_reason(name)}")


def _reason(name: str) -> str:
    if PEERS[name].package == "ffcv":
        return "FFCV is not installed (see docs/benchmarks.md#peers)"
    return "not installed (pip install 'imfeed[peers]')"


@pytest.mark.parametrize("name", NAMES)
def test_a_peer_converts_once_and_reads_every_sample_as_ours(small, name):
    needs(name)
    s = settings(small)
    batches, made = epoch(name, s)
    ours, _ = epoch("loader-cpu", s)
    # The same epoch as ours: every image once, with ImageFolder's label, in full batches.
    assert [len(labels) for _, labels in batches] == [len(lab) for _, lab in ours] == [4, 4, 4]
    assert Counter(x for _, lab in batches for x in lab.tolist()) == {0: 4, 1: 4, 2: 4}
    for images, labels in batches:
        assert images.shape == ours[0][0].shape == (4, 3, 224, 224)
        assert images.dtype == torch.float32 and images.is_contiguous()
        assert labels.dtype == torch.int64
        # normalised: within what (0 - mean) / std and (1 - mean) / std allow
        assert -2.12 <= images.min() < images.max() <= 2.65
    # Its conversion was made here and is recorded; the next pipeline reuses it.
    assert made["reused"] is False and made["mib"] > 0 and made["files"] >= 1
    assert made["convert_seconds"] >= 0 and made["format"]
    _, again = epoch(name, s)
    assert again == made | {"reused": True}
    stamp = json.loads((conversion.place(s, FORMATS[name]) / conversion.STAMP).read_text())
    assert stamp["samples"] == 12 and stamp["signature"][0] == 12


@pytest.mark.parametrize("name", NAMES)
def test_a_peer_with_workers_delivers_eval_batches_of_the_baselines_pixels(small, name):
    """--eval has no randomness: each image's mean is the baseline's (torchvision's resize
    and crop of the same JPEG), within what another resize filter (and FFCV's re-encoding
    at quality 90) changes; in float16, channels_last, from two workers (FFCV's threads)."""
    needs(name)
    s = settings(small, workers=2, eval=True, dtype="float16", channels_last=True)
    batches, _ = epoch(name, s)
    baseline, _ = epoch("torch-pil", s)
    assert [len(labels) for _, labels in batches] == [4, 4, 4]
    for images, _ in batches:
        assert images.shape == (4, 3, 224, 224) and images.dtype == torch.float16
        assert images.is_contiguous(memory_format=torch.channels_last)

    def means(got: list) -> list[tuple[int, float]]:
        return sorted(
            (int(y), float(x.float().mean())) for b, lab in got for x, y in zip(b, lab, strict=True)
        )

    for (label, mean), (want_label, want) in zip(means(batches), means(baseline), strict=True):
        assert label == want_label and abs(mean - want) < 0.05, (name, label, mean, want)


def test_a_peer_not_installed_is_listed_as_skipped_with_the_reason(small, monkeypatch):
    import importlib.util

    from loader.bench import pipelines

    real = importlib.util.find_spec
    packages = {p.package for p in PEERS.values()}
    monkeypatch.setattr(pipelines.importlib.util, "find_spec",
                        lambda n, *a: None if n in packages else real(n, *a))  # fmt: skip
    s = settings(small)
    by_name = {spec.name: unavailable(spec, s) for spec in specs() if spec.name in PEERS}
    install = "(pip install 'imfeed[peers]')"
    assert by_name == {
        "ffcv": "FFCV is not installed (its build needs libturbojpeg and OpenCV headers: "
        "see docs/benchmarks.md#peers)",
        "ffcv-raw": "FFCV is not installed (its build needs libturbojpeg and OpenCV headers: "
        "see docs/benchmarks.md#peers)",
        "mds": f"MosaicML Streaming is not installed {install}",
        "litdata": f"LitData is not installed {install}",
        "wds": f"WebDataset is not installed {install}",
    }
    known, skipped = choose(argparse.Namespace(only=None), s)
    results = _results([k for k in known if k.name in PEERS], skipped, {}, {}, {})
    for name, reason in by_name.items():
        assert results[name] == {"label": PEERS[name].label, "side": "peer",
                                 "status": "skipped", "reason": reason}  # fmt: skip


def test_a_peer_says_what_it_needs_where_installed(small, monkeypatch):
    from loader.bench import pipelines

    monkeypatch.setattr(pipelines.importlib.util, "find_spec", lambda n, *a: object())
    peer = {spec.name: spec for spec in specs()}
    store_only = settings(small, folder=None)
    folder = "needs an image folder: its converter reads the images (give --data a folder)"
    assert all(unavailable(peer[n], store_only) == folder for n in PEERS)
    raw = "needs --encoding raw or mixed:SHARE: the peer of ours on a store of pixels"
    assert unavailable(peer["ffcv-raw"], settings(small)) == raw
    assert unavailable(peer["ffcv-raw"], settings(small, jpeg_store="y")) is None
    assert unavailable(peer["wds"], settings(small)) is None


def test_a_conversion_is_made_once_and_again_when_cut_short_or_changed(tmp_path):
    make_image_folder(tmp_path / "images", 2, 3, seed=1)
    s = Settings(folder=str(tmp_path / "images"), store=None, batch_size=2, workers=0,
                 dtype="float32", channels_last=False, eval=False, device="cpu",
                 workdir=str(tmp_path / "work"))  # fmt: skip
    calls = []

    def write(found, out):
        calls.append(sorted(found))
        (out / "data.bin").write_bytes(b"x" * 1000)
        return len(found)

    first = conversion.convert(s, "fake", {"v": 1}, write)
    assert len(calls) == 1 and len(calls[0]) == 6
    assert {label for _, label in calls[0]} == {0, 1}
    assert [first[k] for k in ("samples", "bytes", "files", "reused")] == [6, 1000, 1, False]
    assert conversion.convert(s, "fake", {"v": 1}, write) == first | {"reused": True}
    assert len(calls) == 1
    (conversion.place(s, "fake") / conversion.STAMP).unlink()  # as if cut short: made again
    conversion.convert(s, "fake", {"v": 1}, write)
    conversion.convert(s, "fake", {"v": 2}, write)  # another recipe: made again
    make_image_folder(tmp_path / "images", 2, 4, seed=1)  # other images: made again
    assert conversion.convert(s, "fake", {"v": 2}, write)["samples"] == 8
    assert len(calls) == 4
    with pytest.raises(RuntimeError, match=r"the lossy converter wrote 7 samples of the 8 images"):
        conversion.convert(s, "lossy", {}, lambda found, out: len(found) - 1)
    assert conversion.made(s, "lossy", {}) is None
    # A folder the bench did not make is never deleted, but named.
    theirs = conversion.place(s, "theirs")
    theirs.mkdir(parents=True)
    (theirs / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match=r"exists and was not made by imfeed-bench: move"):
        conversion.convert(s, "theirs", {}, write)
    assert (theirs / "keep.txt").read_text() == "mine"
    assert conversion.summary(first | {"reused": False}, "fake shards") == {
        "format": "fake shards", "mib": 0.0, "convert_seconds": first["seconds"], "files": 1,
        "reused": False,
    }  # fmt: skip


def test_each_pipeline_says_what_it_reads(small):
    s = dataclasses.asdict(settings(small))
    folder = stores.of("torch-pil", s, None)
    size = sum(p.stat().st_size for p in small.folder.rglob("*.JPEG"))
    assert folder == {"format": "image folder", "files": 12, "convert_seconds": None,
                      "mib": round(size / (1 << 20), 1)}  # fmt: skip
    assert stores.of("dali-ram", s, None) == folder
    store = stores.of("loader-cpu", s, None)
    assert store["format"] == "imfeed store (jpeg)" and store == stores.of("torch-lmdb", s, None)
    # The bench built the store and noted how long it took, beside it.
    assert store["convert_seconds"] == stores.build_seconds(small.store) > 0
    made = {"format": "x", "mib": 1.0, "convert_seconds": 2.0, "files": 1, "reused": True}
    assert stores.of("wds", s, made) == made and stores.of("synthetic", s, None) is None


def test_the_machine_busy_time_of_other_processes():
    stat = "cpu  100 20 30 5000 40 5 5 7 0 0\ncpu0 50 10 15 2500 20 2 3 3 0 0\n"
    tick = os.sysconf("SC_CLK_TCK")
    assert busy.busy_seconds(stat) == 167 / tick  # user, nice, system, irq, softirq, steal
    assert busy.busy_seconds("cpu  100 20 30 5000 40 5 5\n") == 160 / tick  # no steal field
    assert busy.busy_seconds("intr 5\n") is None
    assert busy.others(10.0, 13.0, 1.25) == 1.75 and busy.others(10.0, 10.5, 1.0) == 0.0
    assert busy.others(None, 3.0, 1.0) is None
    passes = [{"seconds": 2.0, "other_cpu_seconds": x} for x in (0.2, 1.5)]
    assert busy.other_cores(passes) == 0.75 and busy.other_cores([{"seconds": 1.0}]) is None
    results = {"a": {"status": "ok", "other_cores_busy": 0.75},
               "b": {"status": "ok", "other_cores_busy": 0.1},
               "c": {"status": "skipped"}}  # fmt: skip
    assert busy.busy(results) == {"a": 0.75}
    assert busy.warning({}) is None
    assert busy.warning({"a": 0.75, "b": 1.5}) == (
        "Warning: the machine was busy: other processes (or a hypervisor's other machines) "
        "kept more than 0.25 cores busy during "
        "the timed passes of b (1.50), a (0.75); absolute figures mean little, run it again "
        "on a quiet machine"
    )


class Sleepy:
    """A pipeline that idles for a second and gives one batch of 4."""

    def epoch(self):
        time.sleep(1.0)
        yield torch.zeros(4, 3, 2, 2), torch.zeros(4, dtype=torch.int64)


def test_a_pass_counts_what_other_processes_took_beside_it():
    # A process that is no descendant of this one (its parent shell exits at once) spins.
    spin = f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"
    pid = int(subprocess.run(["sh", "-c", spin], capture_output=True, text=True).stdout)
    try:
        s = Settings(folder=None, store=None, batch_size=4, workers=0, dtype="float32",
                     channels_last=False, eval=False, device="cpu")  # fmt: skip
        answer = runner.timed_pass(Sleepy(), s)
    finally:
        os.kill(pid, signal.SIGKILL)
    assert answer["images"] == 4 and answer["cpu_seconds"] < 0.5
    assert answer["other_cpu_seconds"] >= 0.6 * answer["seconds"]  # about a core, or more
    assert rounds._others(answer).startswith("  (the machine was busy: others took ")


def _result(name: str, side: str, rate: float, store: dict | None) -> dict:
    return {"label": name, "side": side, "status": "ok", "img_per_s": rate,
            "spread": [rate, rate], "cpu_cores_busy": 1.5, "memory_mib": 100.0,
            "gpu_memory_mib": None, "other_cores_busy": 0.6 if name == "mds" else 0.0,
            "passes": [], "store": store}  # fmt: skip


def ten(spread: float) -> dict:
    """Ten pipelines, the fastest ``spread`` times the slowest."""
    names = ["torch-pil", "torch-lmdb", "loader-cpu", "dali-file", "dali-crop", "dali-ram",
             "ffcv", "mds", "litdata", "wds"]  # fmt: skip
    out = {}
    for i, n in enumerate(names):
        side = "ours" if n == "loader-cpu" else "baseline" if n == "torch-pil" else "peer"
        rate = 100.0 * spread if side == "ours" else 100.0 + 10 * i
        store = {"format": f"{n} data", "mib": 10.0 + i, "convert_seconds": i or None}
        out[n] = _result(n, side, rate, store)
    return out


def test_the_table_has_each_formats_size_and_conversion_and_warns_of_a_busy_machine():
    results = ten(4.0)
    results["ffcv-raw"] = {"label": "x", "side": "peer", "status": "skipped", "reason": "why"}
    done = report.finish({"results": results, "train_ceiling": None})
    summary, lines = done["summary"], done["table"].splitlines()
    assert summary["best_peer"] == "wds" and summary["vs_best_peer"] == round(400 / 190, 3)
    assert summary["vs_peers"]["mds"] == round(400 / 170, 3)
    assert "loader-cpu" not in summary["vs_peers"]
    assert summary["machine_busy"] == {"mds": 0.6}
    assert lines[0] == ("| pipeline | img/s (median) | min-max | vs PIL | cores busy | memory MiB "
                        "| data MiB | made in s |")  # fmt: skip
    assert lines[2] == "| **loader-cpu** | 400.0 | 400-400 | 4.00x | 1.50 | 100 | 12 | 2.0 |"
    assert "| torch-pil | 100.0 | 100-100 | 1.00x | 1.50 | 100 | 10 | - |" in lines
    assert "| mds | 170.0 | 170-170 | 1.70x | 1.50 | 100 | 17 | 7.0 |" in lines
    read = "Data read: loader-cpu: loader-cpu data; wds: wds data; litdata: litdata data;"
    assert any(x.startswith(read) for x in lines)
    each = f"Ours (loader-cpu) against each: {summary['vs_peers']['wds']:.2f}x wds, "
    assert each in done["table"]
    assert "- ffcv-raw: skipped, why" in lines
    assert lines[-1] == busy.warning({"mds": 0.6})


@pytest.mark.parametrize("spread, scale", [(4.0, "linear"), (60.0, "log")])
def test_the_chart_of_ten_pipelines_is_sorted_and_fitted(tmp_path, spread, scale):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = ten(spread)
    report.add_ratios(results)
    ok = sorted(results, key=lambda n: results[n]["img_per_s"])
    fig, ax = plt.subplots(figsize=(9, 6))
    labels = chart._throughput(ax, results, ok, {"loader-cpu"})
    fig.tight_layout()
    chart._fit(ax, *labels)
    fig.canvas.draw()
    assert ax.get_xscale() == scale
    ticks = [t.get_text() for t in ax.get_yticklabels()]
    assert ticks[-1] == "ours: loader-cpu" and ticks[0] == "baseline: torch-pil"  # fastest on top
    right = ax.get_window_extent().x1
    assert all(t.get_window_extent().x1 <= right + 1 for t in labels[2])  # every label fits
    assert max(t.get_window_extent().x1 for t in labels[2]) > right - 20  # and no more room
    plt.close(fig)
    chart.draw(tmp_path / "c.png", results, {"loader-cpu"}, "t", "s")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_peers_leftovers_are_not_warned_of_on_the_terminal(small, tmp_path):
    # Streaming leaves its shared memory and LitData semaphores, which multiprocessing's
    # resource tracker removes at exit, warning "There appear to be 6 leaked shared_memory
    # objects" on the terminal after the run: not the run's to say. (-W default: the
    # tracker takes the parent's -W options, which outrank PYTHONWARNINGS.)
    needs("mds")
    needs("litdata")
    shm = set(os.listdir("/dev/shm"))
    run = subprocess.run(
        [sys.executable, "-W", "default", "-m", "loader.bench", "--data", str(small.folder),
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "out"), "--only",
         "mds,litdata", "--batch-size", "4", "--workers", "1", "--passes", "1",
         "--min-pass-seconds", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "| mds |" in run.stdout and "| litdata |" in run.stdout
    assert "leaked" not in run.stderr + run.stdout
    assert set(os.listdir("/dev/shm")) <= shm  # and removed all the same

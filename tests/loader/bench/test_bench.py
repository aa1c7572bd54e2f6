"""imfeed-bench: one --quick run on a tiny folder lists every pipeline available here with
consistent figures (never speeds), the others as skipped with the reason; a chart is drawn.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import io
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from fixtures import REPO

from loader.bench import chart, machine, report, runner
from loader.bench import data as bench_data
from loader.bench.cli import main
from loader.bench.machine import CoreClock, cores_mhz
from loader.bench.pipelines import (
    PEERS,
    Settings,
    Spec,
    build,
    share_variant,
    specs,
    unavailable,
)
from loader.bench.run import choose
from loader.bench.synth import make_image_folder
from loader.decode import decoders
from loader.store import Store

IMAGES = 24  # 3 classes x 8
PASSES = 2


def has_dali() -> bool:
    try:
        return importlib.util.find_spec("nvidia.dali") is not None
    except ModuleNotFoundError:
        return False


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[dict, Path, str]:
    """One ``imfeed-bench --quick`` in a subprocess: (the JSON, the out dir, stdout)."""
    root = tmp_path_factory.mktemp("bench")
    make_image_folder(root / "images", 3, 8, seed=3)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    args = ["--quick", "--data", root / "images", "--workdir", root / "work", "--out",
            root / "out", "--batch-size", "8", "--workers", "1", "--name", "t",
            "--device", "cpu"]  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "loader.bench", *map(str, args)],
        env=env, cwd=root, capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / "out" / "t.json").read_text()), root / "out", done.stdout


def expected_ok() -> set[str]:
    ok = {"torch-pil", "torch-lmdb", "loader-cpu"}
    return ok | ({"dali-file", "dali-crop", "dali-ram"} if has_dali() else set())


def test_every_known_pipeline_is_listed(run):
    report, _, _ = run
    assert set(report["results"]) == {s.name for s in specs()}
    ok = {n for n, r in report["results"].items() if r["status"] == "ok"}
    assert expected_ok() <= ok
    for name, r in report["results"].items():
        if r["status"] != "ok":
            assert r["status"] == "skipped" and r["reason"], name
    if not has_dali():
        assert report["results"]["dali-ram"]["reason"] == (
            "DALI is not installed (pip install 'imfeed[dali]')"
        )
    # Our GPU decoders, where the lead's backends are present, run or say why not.
    assert {f"loader-{d}" for d in decoders()} <= set(report["results"])
    assert report["results"]["loader-nvjpeg"]["reason"] == (
        "decodes on a CUDA device, and this run delivers to the CPU"
    )
    # The peer formats installed here ran on their conversions (ffcv-raw needs --encoding).
    installed = {n for n, p in PEERS.items() if importlib.util.find_spec(p.package)}
    assert installed - {"ffcv-raw"} <= ok
    for name in installed - {"ffcv-raw"}:
        store = report["results"][name]["store"]
        assert store["mib"] > 0 and store["convert_seconds"] >= 0 and not store["reused"]
    assert report["results"]["ffcv-raw"]["status"] == "skipped"


def test_each_pass_reads_the_whole_epoch_and_figures_agree(run):
    report, _, _ = run
    for name, r in report["results"].items():
        if r["status"] != "ok":
            continue
        assert len(r["passes"]) == PASSES + 1, name  # the warm-up first
        assert [p["images"] for p in r["passes"]] == [IMAGES] * (PASSES + 1), name
        rates = [p["images"] / p["seconds"] for p in r["passes"][1:]]
        assert r["rates"] == [round(x, 2) for x in rates]
        assert r["img_per_s"] == round(statistics.median(rates), 1) > 0
        assert r["spread"] == [round(min(rates), 1), round(max(rates), 1)]
        assert r["cpu_cores_busy"] > 0 and r["memory_mib"] > 0
        assert r["vs_pil"] == round(r["img_per_s"] / report["results"]["torch-pil"]["img_per_s"], 3)
        # Ours say where their time went in each pass; the peers have no such figures.
        spent = [p.get("loader_us_per_image") for p in r["passes"]]
        if r["side"] != "ours":
            assert spent == [None] * (PASSES + 1), name
            assert "decode_share" not in r and "decoded" not in r["passes"][0], name
            continue
        # Which decoder took which samples: here the workers, every delivered sample.
        assert [p["decoded"] for p in r["passes"]] == [{"gpu": 0, "cpu": IMAGES}] * (PASSES + 1)
        assert r["decode_share"] == {"gpu": 0.0, "cpu": 1.0}
        for pass_, us in zip(r["passes"], spent, strict=True):
            assert us["wait"] >= 0 and us["cpu_decode"] > 0, name  # the CPU decoder's time
            # Worker time adds up over workers; one worker here, so within the pass's.
            assert us["cpu_decode"] <= pass_["seconds"] / pass_["images"] * 1e6, name


def test_summary(run):
    report, _, _ = run
    results, summary = report["results"], report["summary"]
    ours = [n for n in results if n.startswith("loader-") and results[n]["status"] == "ok"]
    assert summary["ours"] == max(ours, key=lambda n: results[n]["img_per_s"])
    assert summary["vs_pil"] == results[summary["ours"]]["vs_pil"]
    best_peer = max((n for n in results if results[n]["status"] == "ok" and n not in ours),
                    key=lambda n: results[n]["img_per_s"])  # fmt: skip
    assert summary["best_peer"] == best_peer
    assert summary["vs_best_peer"] == round(
        results[summary["ours"]]["img_per_s"] / results[best_peer]["img_per_s"], 3
    )
    assert summary["cpu_cores_busy"]["ours"] == results[summary["ours"]]["cpu_cores_busy"]
    for name in expected_ok():
        assert summary["cpu_cores_busy"][name] == results[name]["cpu_cores_busy"]
    if has_dali():
        dali = [n for n in results if n.startswith("dali-") and results[n]["status"] == "ok"]
        assert summary["best_dali"] == max(dali, key=lambda n: results[n]["img_per_s"])
        vs = results[summary["ours"]]["img_per_s"] / results[summary["best_dali"]]["img_per_s"]
        assert summary["vs_dali"] == round(vs, 3)
    else:
        assert summary["vs_dali"] is None
    assert "resnet50_share" not in summary  # no --train-check
    assert summary["decode_share"] == {n: results[n]["decode_share"] for n in ours}


def test_fingerprint_and_settings(run):
    report, _, _ = run
    m = report["machine"]
    assert m["cpus"] == os.cpu_count() and m["cpu"]
    assert m["torch"] == torch.__version__
    for key in ("gpu", "driver", "cuda", "torchvision", "dali", "opencv", "python"):
        assert key in m
    s = report["settings"]
    assert (s["batch_size"], s["workers"], s["passes"], s["device"]) == (8, 1, PASSES, "cpu")
    assert report["data"]["images"] == report["data"]["kept"] == IMAGES


def test_the_subtitle_says_how_many_images_the_store_kept():
    """A folder with files the build rejects: the store pipelines read fewer images than
    the folder holds, and the run's one line said only the folder's count."""
    from loader.bench.cli import subtitle

    report = {
        "machine": {"cpu": "CPU", "cpus": 2, "gpu": None}, "date": "today",
        "settings": {"batch_size": 8, "workers": 1, "dtype": "float32", "channels_last": False,
                     "eval": False, "device": "cpu"},
        "data": {"images": 204, "kept": 202},
    }  # fmt: skip
    assert subtitle(report) == (
        "CPU, 2 cores, no GPU; 204 images (202 kept in the store), batch 8, 1 workers, "
        "float32, train augmentation, on cpu; today"
    )
    report["data"] = {"images": 204}  # a report from before "kept"
    assert "; 204 images, batch 8" in subtitle(report)


def test_table_chart_and_stdout(run):
    report, out, stdout = run
    assert (out / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["chart"] == "t.png"
    table = (out / "t.md").read_text()
    assert table.startswith("AMD") or "cores" in table.splitlines()[0]
    for name, r in report["results"].items():
        if r["status"] == "ok":
            assert f"| {r['img_per_s']:.1f} |" in table, name
        else:
            assert f"- {name}: skipped, {r['reason']}" in table
    assert "Decoded (timed passes): loader-cpu: 0% on the GPU, 100% by the workers" in table
    assert report["table"] in stdout
    logs = {p.name for p in (out / "logs").glob("*")} if (out / "logs").exists() else set()
    assert all((out / "logs" / name).stat().st_size > 0 for name in logs)  # empty ones go


def test_unavailable_reasons():
    s = Settings(folder=None, store="x", batch_size=8, workers=1, dtype="float32",
                 channels_last=False, eval=True, device="cpu")  # fmt: skip
    by_name = {spec.name: unavailable(spec, s) for spec in specs()}
    assert by_name["torch-pil"] == "needs an image folder: give --data a folder rather than a store"
    assert by_name["torch-lmdb"] is None and by_name["loader-cpu"] is None


def test_a_fixed_cpu_share_is_a_pipeline_named_by_its_share():
    spec = share_variant("loader-nvjpeg-0.25")
    label = "loader.DataLoader, decoder='nvjpeg', cpu_share=0.25"
    assert spec == Spec("loader-nvjpeg-0.25", label, "ours")
    # Not a GPU decoder, not a share in (0, 1), not a number: not such a pipeline.
    for name in ("loader-cpu-0.25", "loader-nvjpeg-1.5", "loader-nvjpeg-0", "loader-nvjpeg-auto",
                 "loader-nvjpeg", "dali-crop-0.2", "loader-nope-0.2"):  # fmt: skip
        assert share_variant(name) is None, name
    s = Settings(folder=None, store="x", batch_size=8, workers=1, dtype="float32",
                 channels_last=False, eval=False, device="cpu")  # fmt: skip
    known, skipped = choose(argparse.Namespace(only="loader-cpu,loader-nvjpeg-0.25"), s)
    assert known[-1].name == "loader-nvjpeg-0.25"
    reason = "decodes on a CUDA device, and this run delivers to the CPU"
    assert skipped["loader-nvjpeg-0.25"] == reason
    assert "loader-cpu" not in skipped and skipped["loader-nvjpeg"] == "not in --only"
    with pytest.raises(SystemExit, match="unknown name"):
        choose(argparse.Namespace(only="loader-nvjpeg-2"), s)


def test_a_worker_nice_is_a_pipeline_named_by_its_niceness():
    for name, label in [
        ("loader-dali-auto-nice10", "decoder='dali', cpu_share='auto', worker_nice=10"),
        ("loader-nvjpeg-0.2-nice0", "decoder='nvjpeg', cpu_share=0.2, worker_nice=0"),
    ]:
        assert share_variant(name) == Spec(name, f"loader.DataLoader, {label}", "ours")
    # Not one of ours, a niceness past 19 or none at all: not such a pipeline.
    for name in ("torch-pil-nice3", "dali-ram-nice3", "loader-cpu-nice20", "loader-cpu-nice",
                 "loader-cpu-nicex", "loader-nope-nice3", "loader-cpu-nice07",
                 "loader-cpu-nice\u00b2"):  # fmt: skip
        assert share_variant(name) is None, name
    s = Settings(folder=None, store="x", batch_size=8, workers=1, dtype="float32",
                 channels_last=False, eval=False, device="cpu")  # fmt: skip
    known, skipped = choose(argparse.Namespace(only="loader-cpu,loader-cpu-nice5"), s)
    assert known[-1].name == "loader-cpu-nice5" and "loader-cpu-nice5" not in skipped


def test_ours_on_the_jpeg_store_is_a_pipeline_named_at_jpeg():
    # With --encoding, ``<ours>@jpeg`` reads the store of JPEGs built beside the encoded one.
    for name, label in [
        ("loader-cpu@jpeg", "decoder='cpu'"),
        ("loader-nvjpeg-0.2@jpeg", "decoder='nvjpeg', cpu_share=0.2"),
        ("loader-dali-auto@jpeg", "decoder='dali', cpu_share='auto'"),
    ]:
        want = Spec(name, f"loader.DataLoader, {label}, on the store of JPEGs", "reference")
        assert share_variant(name) == want
    for name in ("torch-pil@jpeg", "dali-ram@jpeg", "loader-nope@jpeg", "loader-cpu@png"):
        assert share_variant(name) is None, name
    s = Settings(folder=None, store="x", batch_size=8, workers=1, dtype="float32",
                 channels_last=False, eval=False, device="cpu")  # fmt: skip
    _, skipped = choose(argparse.Namespace(only="loader-cpu,loader-cpu@jpeg"), s)
    assert skipped["loader-cpu@jpeg"].startswith("needs --encoding")
    paired = dataclasses.replace(s, jpeg_store="y")
    _, skipped = choose(argparse.Namespace(only="loader-cpu@jpeg,loader-nvjpeg@jpeg"), paired)
    assert "loader-cpu@jpeg" not in skipped
    assert (
        skipped["loader-nvjpeg@jpeg"]
        == "decodes on a CUDA device, and this run delivers to the CPU"
    )


def test_a_pipeline_that_fails_to_start_is_skipped_with_the_reason(tmp_path):
    s = Settings(folder=None, store=str(tmp_path / "missing"), batch_size=8, workers=0,
                 dtype="float32", channels_last=False, eval=False, device="cpu")  # fmt: skip
    servers, failed = runner.start(["loader-cpu", "no-such"], s, tmp_path, lambda m: None)
    assert servers == {}
    assert failed["no-such"].startswith("ValueError: unknown pipeline 'no-such'; known: torch-pil")
    assert failed["loader-cpu"].startswith("StoreError: ")
    assert "no such store directory" in failed["loader-cpu"]
    assert failed["loader-cpu"].endswith(f"(see {tmp_path / 'loader-cpu.log'})")
    # The traceback went to the pipeline's log, not to the terminal.
    assert "ValueError: unknown pipeline 'no-such'" in (tmp_path / "no-such.log").read_text()


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="forkserver is Python's default there")
def test_a_torch_dataloader_in_a_pipeline_process_forks_its_workers_there(small, tmp_path):
    """The pipeline's process is a child of the bench's fork server and inherited its start
    method: its torch DataLoader started a fork server of its own, with nothing imported,
    and its workers came from there, each importing torch anew."""
    from loader.telemetry.proctree import descendants

    s = Settings(folder=str(small.folder), store=str(small.store), batch_size=5, workers=2,
                 dtype="float32", channels_last=False, eval=False, device="cpu")  # fmt: skip
    servers, failed = runner.start(["torch-pil"], s, tmp_path, lambda m: None)
    assert failed == {}
    server = servers["torch-pil"]
    try:
        answer = server.ask(("warm-up",), 120)
        assert answer["images"] == 10  # 12 images, batches of 5, whole batches only
        # persistent workers, alive after the pass, each a child of the pipeline's process
        workers = descendants(server.proc.pid)
        assert [parent(pid) for pid in workers] == [server.proc.pid] * 2
    finally:
        runner.stop_all(servers)


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("PPid:"))


def test_a_worker_error_is_told_by_its_last_line():
    """A torch DataLoader worker's error is its traceback under "Caught ... in DataLoader
    worker process 1.": the bench showed only that first line."""
    worker = OSError(
        "Caught OSError in DataLoader worker process 1.\nOriginal Traceback (most recent "
        'call last):\n  File "x.py", line 1, in f\nOSError: image file is truncated '
        "(2 bytes not processed)\n"
    )
    assert runner._reason(worker) == (
        "OSError: Caught OSError in DataLoader worker process 1. ... OSError: image file is "
        "truncated (2 bytes not processed)"
    )
    assert runner._reason(ValueError("one line")) == "ValueError: one line"
    assert runner._reason(RuntimeError()) == "RuntimeError: "


def test_data_is_made_once_and_reused(tmp_path):
    said = []
    first = bench_data.prepare(None, 20, tmp_path, None, said.append)
    assert first.images == first.kept == 20 and first.origin == "generated"
    assert len(list(first.folder.glob("class_*"))) == 10
    assert first.store is not None and (first.store / "manifest.json").is_file()
    again = bench_data.prepare(None, 20, tmp_path, None, said.append)
    assert again == first
    assert said[-2:] == [f"reusing 20 images in {first.folder}",
                         f"reusing the store {first.store} (delete it to rebuild)"]  # fmt: skip
    store_only = bench_data.prepare(first.store, 0, tmp_path, None, said.append)
    assert (store_only.folder, store_only.images) == (None, 20)


def test_bad_arguments_say_what_to_do(tmp_path):
    where = ["--workdir", str(tmp_path), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit, match=r"--data .*nothing: neither an image folder"):
        main(["--data", str(tmp_path / "nothing"), *where])
    for flag in ("--batch-size", "--passes", "--images"):
        with pytest.raises(SystemExit, match=rf"{flag} must be at least 1"):
            main([flag, "0", *where])
    with pytest.raises(SystemExit, match=r"--min-pass-seconds must be between 0 and 3600"):
        main(["--min-pass-seconds", "-1", *where])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match=r"--train-check needs a CUDA device"):
            main(["--train-check", *where])
    assert not (tmp_path / "out").exists()


def test_training_check_counts_steps_and_shares(tmp_path):
    """The --train-check path (on the CPU here, on CUDA in the tool): exact steps and images,
    each loader's share of the synthetic ceiling computed from the figures it lists."""
    made = bench_data.prepare(None, 20, tmp_path, None, lambda m: None)
    s = Settings(
        folder=None,
        store=str(made.store),
        batch_size=2,
        workers=0,
        dtype="float32",
        channels_last=True,
        eval=True,
        device="cpu",
        train_steps=2,
        train_warmup=1,
    )
    servers, failed = runner.start(["synthetic", "loader-cpu"], s, tmp_path, lambda m: None)
    try:
        assert failed == {}
        trained, failed = runner.train(servers, ("resnet18",), lambda m: None)
    finally:
        runner.stop_all(servers)
    assert failed == {}
    for name in ("synthetic", "loader-cpu"):
        t = trained[name]["resnet18"]
        assert (t["steps"], t["images"]) == (2, 4), name
        assert 0.0 <= t["wait_share"] <= 1.0 and t["img_per_s"] > 0
    results = {"loader-cpu": {"train": trained["loader-cpu"]}}
    report.add_shares(results, trained["synthetic"])
    t = results["loader-cpu"]["train"]["resnet18"]
    assert t["share"] == round(t["img_per_s"] / trained["synthetic"]["resnet18"]["img_per_s"], 3)


def test_replot_draws_the_chart_of_a_finished_run(run, tmp_path, capsys):
    report, out, _ = run
    copy = tmp_path / "copy.json"
    copy.write_text((out / "t.json").read_text())
    assert main(["--replot", str(copy)]) == 0
    assert (tmp_path / "copy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "copy.md").read_text() == (out / "t.md").read_text()
    # The same figures derived again; only the chart's name differs.
    assert json.loads(copy.read_text()) == report | {"chart": "copy.png"}
    assert report["table"] in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text('{"results": {}}')
    with pytest.raises(SystemExit, match=r"--replot .*other.json: not a result of imfeed-bench"):
        main(["--replot", str(other)])


def _trained(img18: float, wait18: float, img50: float, wait50: float) -> dict:
    return {"resnet18": {"img_per_s": img18, "wait_share": wait18},
            "resnet50": {"img_per_s": img50, "wait_share": wait50}}  # fmt: skip


def _ok(side: str, img: float, busy: float, train: dict) -> dict:
    return {"side": side, "status": "ok", "img_per_s": img, "spread": [img, img],
            "cpu_cores_busy": busy, "memory_mib": 1.0, "train": train}  # fmt: skip


def test_summary_of_a_training_check(tmp_path):
    """The keys a GPU run writes, from given figures (no GPU needed)."""
    results = {
        "torch-pil": _ok("baseline", 1000.0, 15.0, _trained(500, 0.5, 400, 0.2)),
        "loader-cpu": _ok("ours", 4000.0, 14.0, _trained(800, 0.3, 450, 0.1)),
        "loader-gpu": _ok("ours", 8000.0, 3.0, _trained(900, 0.05, 490, 0.0)),
        "dali-ram": _ok("peer", 10000.0, 5.0, _trained(700, 0.1, 480, 0.0)),
        "dali-file": {"side": "peer", "status": "skipped", "reason": "DALI is not installed"},
    }
    ceiling = {"resnet18": {"img_per_s": 1000.0}, "resnet50": {"img_per_s": 500.0}}
    done = report.finish({"results": results, "train_ceiling": ceiling})
    assert done["summary"] == {
        "ours": "loader-gpu", "best_dali": "dali-ram", "best_peer": "dali-ram",
        "vs_pil": 8.0, "vs_dali": 0.8, "vs_best_peer": 0.8,
        "vs_peers": {"torch-pil": 8.0, "dali-ram": 0.8}, "machine_busy": {},
        "cpu_cores_busy": {"torch-pil": 15.0, "loader-cpu": 14.0, "loader-gpu": 3.0,
                           "dali-ram": 5.0, "ours": 3.0},
        "resnet18_share": 0.9, "resnet18_wait_share": 0.05, "resnet18_fed_by": "loader-gpu",
        "resnet50_share": 0.98, "resnet50_wait_share": 0.0, "resnet50_fed_by": "loader-gpu",
    }  # fmt: skip
    assert results["torch-pil"]["train"]["resnet50"]["share"] == 0.8
    lines = done["table"].splitlines()
    assert lines[0].endswith(
        "| resnet18: % of 1000 img/s (waiting) | resnet50: % of 500 img/s (waiting) |"
    )
    assert (
        lines[2]
        == "| dali-ram | 10000.0 | 10000-10000 | 10.00x | 5.00 | 1 | 70% (10%) | 96% (0%) |"
    )
    assert lines[-1] == "- dali-file: skipped, DALI is not installed"
    assert done["headline"] == (
        "loader-gpu: 8000 img/s, 8.00x the torch + PIL baseline, 0.80x DALI's best (dali-ram), "
        "ResNet-50 trains at 98% of its ceiling"
    )
    chart.draw(tmp_path / "c.png", results, {"loader-cpu", "loader-gpu"}, "t", "s")
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> bench_data.Data:
    root = tmp_path_factory.mktemp("bench-small")
    make_image_folder(root / "images", 3, 4, seed=5)
    return bench_data.prepare(root / "images", 0, root / "work", None, lambda m: None)


@pytest.mark.parametrize("dtype, channels_last, eval_", [("float16", True, True),
                                                         ("float32", False, False)])  # fmt: skip
@pytest.mark.parametrize("name", sorted(expected_ok()))
def test_every_pipeline_delivers_the_same_kind_of_batch(small, name, dtype, channels_last, eval_):
    s = Settings(folder=str(small.folder), store=str(small.store), batch_size=5, workers=0,
                 dtype=dtype, channels_last=channels_last, eval=eval_, device="cpu")  # fmt: skip
    if name == "dali-crop" and eval_:
        assert unavailable(next(x for x in specs() if x.name == name), s) == (
            "same as dali-file with --eval (no random crop to decode)"
        )
        return
    pipe = build(name, s)
    try:
        batches = list(pipe.epoch())
    finally:
        pipe.close()
    # drop_last everywhere: one batch shape (a new shape re-tunes cuDNN in a training check)
    assert [len(labels) for _, labels in batches] == [5, 5]
    for images, labels in batches:
        assert images.shape[1:] == (3, 224, 224) and images.dtype == getattr(torch, dtype)
        assert images.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert labels.dtype == torch.int64 and set(labels.tolist()) <= {0, 1, 2}
    labels = [x for _, lab in batches for x in lab.tolist()]
    assert all(labels.count(c) <= 4 for c in (0, 1, 2))  # no image twice in an epoch


def test_a_nice_variant_builds_its_loader_with_that_worker_nice(small):
    s = Settings(folder=str(small.folder), store=str(small.store), batch_size=5, workers=1,
                 dtype="float32", channels_last=False, eval=True, device="cpu")  # fmt: skip
    pipe, plain = build("loader-cpu-nice5", s), build("loader-cpu", s)
    own = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        assert [len(labels) for _, labels in pipe.epoch()] == [5, 5]
        assert [len(labels) for _, labels in plain.epoch()] == [5, 5]
        niceness = [os.getpriority(os.PRIO_PROCESS, p.dl.worker_pids[0]) for p in (pipe, plain)]
        assert niceness == [min(own + 5, 19), own]
    finally:
        pipe.close()
        plain.close()


def test_import_loader_leaves_the_bench_alone():
    code = (
        "import loader, sys\n"
        "print(sorted(m for m in sys.modules if m.startswith(('loader.bench', 'matplotlib'))))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "[]"


def test_max_size_caps_the_store_and_the_folder_the_peers_read(tmp_path):
    make_image_folder(tmp_path / "images", 2, 3, seed=7)  # short side 300-450 px
    said = []
    data = bench_data.prepare(tmp_path / "images", 0, tmp_path / "work", None, said.append, 96)
    st = Store(data.store)
    assert len(st) == data.images == 6 and data.origin == "folder given, capped at 96 px"
    assert int(np.maximum(st.index["height"], st.index["width"]).max()) == 96
    files = sorted(p for p in data.folder.rglob("*") if p.is_file() and p.name[0] != ".")
    assert sorted({p.parent.name for p in files}) == st.classes
    stored = sorted(st.image(i)[0] for i in range(len(st)))
    assert sorted(p.read_bytes() for p in files) == stored  # the same bytes, every one
    assert max(max(cv2.imread(str(p)).shape[:2]) for p in files) == 96
    again = bench_data.prepare(tmp_path / "images", 0, tmp_path / "work", None, said.append, 96)
    assert again == data and any(s.startswith("reusing the images of") for s in said)
    with pytest.raises(ValueError, match=r"--max-size 96 builds a store from images: give"):
        bench_data.prepare(data.store, 0, tmp_path / "work", None, said.append, 96)


def test_training_warmup_drains_what_a_pipeline_holds_ready():
    """A torch DataLoader idle before a training check holds 2 batches per worker ready:
    timed steps served from those would flatter it (on the H200, ResNet-50 "fed" by PIL at
    95% of its ceiling, where that pipeline reads only 72% of what ResNet-50 consumes)."""
    from loader.bench.run import train_warmup

    for workers in (0, 4, 16):
        assert train_warmup(30, workers) >= 2 * workers + 2
    assert train_warmup(30, 0) == 6 and train_warmup(100, 0) == 20


def test_short_side_makes_larger_images_that_max_size_caps(tmp_path, capsys):
    said = []
    data = bench_data.prepare(
        None, 20, tmp_path, None, said.append, max_size=160, short_side=(200, 240)
    )
    assert data.origin == "generated, short side 200-240 px, capped at 160 px"
    made = sorted(p for p in (tmp_path / "images-10x2-short200-240").rglob("*.JPEG"))
    assert len(made) == data.images == 20
    assert all(200 <= min(cv2.imread(str(p)).shape[:2]) <= 240 for p in made)
    st = Store(data.store)
    assert int(np.maximum(st.index["height"], st.index["width"]).max()) == 160
    default = bench_data.prepare(None, 20, tmp_path, None, said.append)
    assert default.folder == tmp_path / "images-10x2" and default.origin == "generated"
    with pytest.raises(SystemExit) as bad:
        main(["--short-side", "800", "--prepare-only", "--workdir", str(tmp_path)])
    assert bad.value.code == 2
    assert "'800': give two sizes in px as LO-HI" in capsys.readouterr().err


class Settling:
    """A pipeline of ours whose DALI stage is trying its ways (``dl.stats()``'s
    ``way_trialing``) until it has served ``until`` batches; epochs of ``per_epoch``."""

    def __init__(self, until: int, per_epoch: int = 3) -> None:
        self.until, self.per_epoch, self.served = until, per_epoch, 0
        self.dl = self
        self.batch = torch.zeros(2, 3, 64, 64), torch.tensor([0, 1])

    def stats(self) -> dict:
        return {"way_trials": 1, "way_trialing": self.served < self.until}

    def epoch(self):
        for _ in range(self.per_epoch):
            self.served += 1
            yield self.batch

    def close(self) -> None:
        pass


def on_the_cpu() -> Settings:
    """Bench settings for ``Settling``: on the CPU, 2 untimed training steps, 3 timed."""
    return Settings(folder=None, store=None, batch_size=2, workers=0, dtype="float32",
                    channels_last=True, eval=True, device="cpu", train_steps=3,
                    train_warmup=2)  # fmt: skip


class Conn:
    """The runner's end of a pipe: hands ``requests`` over in turn, keeps what is sent."""

    def __init__(self, *requests) -> None:
        self.requests, self.sent = list(requests), []

    def recv(self):
        return self.requests.pop(0)

    def send(self, message) -> None:
        self.sent.append(message)


@pytest.mark.parametrize(("until", "served"), [(0, 3), (7, 9), (100, 3 * runner.WARMUP_PASSES)])
def test_the_warm_up_lasts_until_our_ways_are_tried(monkeypatch, until, served):
    """Round 0 goes on, pass by pass (an epoch each here), while our DALI stage's trial is
    under way (on the H200 its first one ran into a timed pass: 11.8k img/s against 30.0k
    in the next)."""
    pipe = Settling(until)
    monkeypatch.setattr(runner, "build", lambda name, s: pipe)
    monkeypatch.setattr(runner, "_to_log", lambda path: None)
    conn = Conn(("warm-up",), ("pass",), ("stop",))
    runner.serve("loader-dali", on_the_cpu(), conn, "unused.log")
    assert conn.sent[0] == {"ready": True} and pipe.served == served + 3
    assert [m["images"] for m in conn.sent[1:]] == [6, 6]  # the last warm-up epoch, the pass


class Ticking(Settling):
    """``Settling`` (not trying) on a clock of its own that each epoch moves on by
    ``seconds``: the runner's ``time`` in a test."""

    def __init__(self, seconds: float) -> None:
        super().__init__(0)
        self.now, self.seconds = 0.0, seconds

    def perf_counter(self) -> float:
        return self.now

    def epoch(self):
        yield from super().epoch()
        self.now += self.seconds


@pytest.mark.parametrize(("least", "epochs"), [(0.0, 1), (1.0, 3), (1.2, 3), (1.21, 4)])
def test_a_pass_reads_whole_epochs_until_its_least_seconds(monkeypatch, least, epochs):
    """A fast pipeline is timed over more than a fraction of a second: whole epochs, each
    counted, until ``min_pass_seconds`` have passed (epochs of 0.4 s here)."""
    pipe = Ticking(0.4)
    monkeypatch.setattr(runner, "time", pipe)
    p = runner.timed_pass(pipe, dataclasses.replace(on_the_cpu(), min_pass_seconds=least))
    assert (p["epochs"], p["images"]) == (epochs, 6 * epochs)
    assert p["seconds"] == round(0.4 * epochs, 4) and pipe.served == 3 * epochs


@pytest.mark.parametrize(("until", "untimed"), [(0, 2), (5, 5), (1000, 2 + 4)])
def test_a_training_check_times_no_trial_of_our_ways(monkeypatch, until, untimed):
    """Untimed steps past the warm-up while the stage tries its ways, at most SETTLE_STEPS."""
    from loader.bench import train

    monkeypatch.setattr(train, "SETTLE_STEPS", 4)
    pipe = Settling(until)
    t = train.train_check(train.forever(pipe), "resnet18", on_the_cpu(), pipe)
    assert (t["untimed_steps"], t["steps"], t["images"]) == (untimed, 3, 6)
    assert pipe.served == untimed + 3


def test_the_two_gpu_script_runs_two_ranks_on_the_cpu(tmp_path):
    """``benchmarks/ddp_two_gpus.py`` under ``torchrun --nproc_per_node=2`` (gloo here, NCCL
    on the GPUs): each rank reads its half of the store, and its loader serves exactly the
    batches asked (an untimed epoch, the timed ones, then the warm-up and timed steps)."""
    from gpu_path_data import NUM_SAMPLES, make_small_store

    store = make_small_store(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         str(REPO / "benchmarks" / "ddp_two_gpus.py"), str(store), "--steps", "2",
         "--warmup", "1", "--batch-size", "4", "--size", "64", "--loader-images", "1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    per_epoch = NUM_SAMPLES // 2 // 4  # batches of 4 a rank, the last short one dropped
    assert out["world_size"] == 2 and [r["rank"] for r in out["ranks"]] == [0, 1]
    for r in out["ranks"]:
        assert r["epoch_images"] == 4 * per_epoch and r["loader_epochs"] == 2  # the least
        assert r["alone"]["wait_us_per_image"] > 0
        # One untimed epoch: on the CPU the stage has no ways to try, no trial to wait for.
        assert r["warm_epochs"] == 1
        assert r["stats"]["batches"] == (1 + r["loader_epochs"]) * per_epoch + 1 + 2
        # Both ranks may run on all of this machine's cores: each takes half as workers.
        assert r["cores"] == sorted(os.sched_getaffinity(0))
        with open("/proc/cpuinfo") as f:  # each phase's clock, where the kernel gives one
            told = cores_mhz(f.read(), r["cores"]) is not None
        assert {k: v is not None for k, v in r["cpu_mhz"].items()} == dict.fromkeys(
            ("ceiling", "alone", "fed"), told
        )
        assert r["workers"] == max(1, len(r["cores"]) // 2)
        assert r["fed_img_s"] > 0 and r["ceiling_img_s"] > 0
        assert 0 < r["wait_share"] < 1 and r["ddp"] and r["cudnn_benchmark"]
        for times in (r["step_ms"], r["wait_ms"]):  # median, 90th percentile, largest
            assert len(times) == 3 and 0 < times[0] <= times[1] <= times[2]
        # What the loader did while fed to the model; no CUDA stream to run dry here.
        assert r["beside"]["wait_us_per_image"] > 0
        assert r["beside"]["starved_handoffs"] == r["beside"]["pending_handoffs"] == 0
        # Both epochs fed began with batches made during the one before (persistent
        # workers): the first after the loader's timed epochs, the second in the steps.
        assert (r["beside"]["epochs_carried"], r["beside"]["carries_dropped"]) == (2, 0)
        assert r["dry_share"] == r["ceiling_dry_share"] == r["starved_share"] == 0.0
        # Epochs of 2 batches, 1 untimed step: the second timed step starts an epoch.
        starts = r["epoch_starts"]
        assert starts["steps"] == len(starts["wait_ms"]) == 1 and starts["starved"] == 0


CPUINFO = """processor\t: 0
model name\t: Some CPU
cpu MHz\t\t: 2000.000

processor\t: 1
cpu MHz\t\t: 3000.500

processor\t: 2
"""


def test_the_clock_of_some_cores_from_cpuinfo():
    assert cores_mhz(CPUINFO, [0, 1]) == 2500.2  # the mean, rounded to 0.1 MHz
    assert cores_mhz(CPUINFO, [1]) == 3000.5
    assert cores_mhz(CPUINFO, [2, 7]) is None  # no clock given for these
    assert cores_mhz("", [0]) is None


def test_the_core_clock_samples_while_in_its_block(monkeypatch):
    texts = iter([f"processor: 0\ncpu MHz: {mhz}" for mhz in (1800.0, 1000.0, 1200.0)])
    monkeypatch.setattr(machine, "open", lambda path: io.StringIO(next(texts, "")), raising=False)
    with CoreClock([0], every=0.001) as clock:
        clock._thread.join(5)  # it stops by itself at the first text without a clock
    assert clock.samples == [1800.0, 1000.0, 1200.0] and clock.mhz == 1200.0  # the median

    def unreadable(path):
        raise PermissionError(path)

    monkeypatch.setattr(machine, "open", unreadable, raising=False)
    with CoreClock([0]) as clock:
        pass
    assert clock.samples == [] and clock.mhz is None


def soak_module():
    spec = importlib.util.spec_from_file_location("soak", REPO / "benchmarks" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_soak(tmp_path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """``benchmarks/<script>`` on the small store, on the CPU with 2 workers: the finished
    process (status 0) and its report."""
    from gpu_path_data import make_small_store

    store = make_small_store(tmp_path)
    out = tmp_path / "soak.json"
    # The checkout first: soak_stand_ins.py puts tests/ on its path, whose loader/ folder
    # would otherwise stand in for the package where it is installed in editable mode.
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / script), str(store), "--device", "cpu",
         "--workers", "2", *args, "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_the_soak_script_checks_every_epoch_across_a_preemption(tmp_path):
    """``benchmarks/soak.py``: 3 epochs of the small store (PNG, progressive, grayscale
    among them) with a model trained on each batch, the second epoch cut halfway by a
    preemption (checkpoint through JSON, a new loader, resumed): every sample once, with
    its label, in every epoch, and nothing on fd 2."""
    from gpu_path_data import NUM_SAMPLES

    done, report = run_soak(tmp_path, "soak.py", "--epochs", "3", "--model", "resnet18",
                            "--batch-size", "4", "--resume-every", "2")  # fmt: skip
    s = report["summary"]
    assert (s["epochs"], s["resumes"], s["bad_epochs"], s["stderr_lines"]) == (3, 1, [], 0)
    assert s["ok"] and s["stderr"] == [] and json.loads(done.stdout) == s
    assert report["images"] == NUM_SAMPLES
    assert [e["preempted"] for e in report["epochs"]] == [False, True, False]
    for e in report["epochs"]:
        assert e["exactly_once"] and e["missing"] == e["repeated"] == 0
        assert e["mislabelled"] == e["nonfinite"] == 0 and e["pss_anon_mib"] > 0
        parts = e["pss_anon_mib"] + e["pss_mapped_mib"]  # the store's pages mapped
        assert e["pss_mapped_mib"] > 0 and abs(e["pss_mib"] - parts) <= 0.2  # rounding
        assert e["children"] == 2  # the workers; those of the loader closed are gone


def test_the_soak_verdict_names_the_bad_epochs_and_the_trend():
    """A sample repeated fails the run and names its epoch; memory growth is the median of
    the last quarter of the epochs less that of the first past the warm ones."""
    soak = soak_module()
    ok = {"missing": 0, "repeated": 0, "mislabelled": 0, "nonfinite": 0}
    pss = [500, 600, 610, 640, 600, 620, 630, 700, 660, 650]  # 8 past the 2 warm epochs
    epochs = [{"epoch": i, "pss_mib": p, "device_mib": None, "way": None, "way_trials": None,
               "stderr_lines": 0} | ok for i, p in enumerate(pss)]  # fmt: skip
    epochs[5]["repeated"] = 1
    s = soak.summary({"epochs": epochs}, resumes=2, seconds=1.0)
    assert (s["bad_epochs"], s["ok"], s["epochs"], s["resumes"]) == ([5], False, 10, 2)
    assert s["pss_growth_mib"] == 655 - 625 and s["device_growth_mib"] is s["fds_growth"] is None
    assert s["torch_reserved_growth_mib"] is None  # not recorded (off CUDA)
    assert s["pss_anon_growth_mib"] is None  # not in these records
    epochs[5]["repeated"] = 0
    assert soak.summary({"epochs": epochs}, resumes=2, seconds=1.0)["ok"]
    epochs[-1]["stderr_lines"] = 1  # a line reached fd 2
    assert not soak.summary({"epochs": epochs}, resumes=2, seconds=1.0)["ok"]


def test_the_soak_counts_the_lines_that_reach_fd_2():
    soak = soak_module()
    err = soak.Stderr()
    try:
        os.write(2, b"Corrupt JPEG data: 12 extraneous bytes\nsecond\n")
    finally:
        err.close()
    assert (err.count, err.lines) == (2, ["Corrupt JPEG data: 12 extraneous bytes", "second"])


def test_the_soak_runs_the_gpu_path_on_its_cpu_stand_ins(tmp_path):
    """``benchmarks/soak_stand_ins.py``: the GPU path's own code (prefetch thread, stage,
    the picker with ``cpu_share="auto"``, close and rebuild) under the soak on the CPU."""
    from gpu_path_data import NUM_SAMPLES

    _, report = run_soak(tmp_path, "soak_stand_ins.py", "--epochs", "4", "--decoder", "tvcpu",
                         "--cpu-share", "auto", "--model", "none", "--batch-size", "8",
                         "--size", "16", "--dtype", "float16", "--resume-every", "2")  # fmt: skip
    s = report["summary"]
    assert (s["epochs"], s["resumes"], s["bad_epochs"], s["stderr_lines"]) == (4, 2, [], 0)
    assert s["ways"] == ["gpu"] and report["images"] == NUM_SAMPLES
    for e in report["epochs"]:
        assert e["exactly_once"] and e["mislabelled"] == e["nonfinite"] == 0
        assert e["children"] == 2 and e["planned"] is not None


def test_the_soak_tells_pages_mapped_from_a_file_from_a_leak(tmp_path):
    """A file's pages mapped and read count in PSS as mapped, not anonymous: the store and
    the shm cache, touched by more processes, are not a leak."""
    import mmap

    soak = soak_module()
    path = tmp_path / "store.bin"
    path.write_bytes(os.urandom(64 << 20))
    before = soak.pss_parts()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        checksum = sum(m[k] for k in range(0, len(m), mmap.PAGESIZE))  # every page read
        during = soak.pss_parts()
    assert checksum >= 0
    assert during["pss_mapped_mib"] - before["pss_mapped_mib"] >= 60  # of 64 MiB
    assert during["pss_anon_mib"] - before["pss_anon_mib"] < 8


def test_the_bench_removes_only_its_own_empty_logs(tmp_path: Path):
    logs = tmp_path / "logs"
    logs.mkdir()
    for name in ("torch-pil.log", "loader.log", "mine.log"):
        (logs / name).write_text("")
    (logs / "loader.log").write_text("a pipeline's output")
    runner.drop_empty_logs(logs, ["torch-pil", "loader", "synthetic"])
    assert sorted(p.name for p in logs.iterdir()) == ["loader.log", "mine.log"]
    (logs / "loader.log").unlink()
    runner.drop_empty_logs(logs, ["torch-pil"])
    assert [p.name for p in logs.iterdir()] == ["mine.log"]  # the user's, and the folder, kept


def test_the_randaugment_recipe_is_the_same_on_torch_and_ours():
    """``--recipe randaugment``: torch's pipelines get RandAugment(2, 9) after the flip, and
    ours runs that very recipe (recognised), so both do the same work an image."""
    from loader.bench.pipelines import torch_transform
    from loader.bench.settings import Settings
    from loader.ops.autoaugment import RandAugment
    from loader.recipes import recognise

    s = Settings(None, None, 8, 0, "float32", False, False, "cpu", recipe="randaugment")
    steps = [type(t).__name__ for t in torch_transform(s).transforms]
    assert steps == ["RandomResizedCrop", "RandomHorizontalFlip", "RandAugment", "ToTensor",
                     "Normalize"]  # fmt: skip
    assert recognise(torch_transform(s)).steps == (RandAugment(2, 9, 31, "nearest", None),)
    standard = dataclasses.replace(s, recipe="standard")
    assert recognise(torch_transform(standard)).steps == ()


@pytest.mark.parametrize("dtype", ["uint8", "float16"])
def test_our_pipeline_runs_the_recipe_whatever_the_dtype(monkeypatch, dtype):
    import loader
    from loader.bench.pipelines import OurPipeline
    from loader.bench.settings import Settings
    from loader.ops.autoaugment import RandAugment

    seen = {}
    monkeypatch.setattr(loader, "DataLoader", lambda *a, **k: seen.update(k))
    s = Settings(None, "/nowhere", 8, 0, dtype, False, False, "cpu", recipe="randaugment")
    OurPipeline("cpu", s)
    assert seen["dtype"] == dtype and seen["transform"].kind == "train"
    assert seen["transform"].steps == (RandAugment(2, 9, 31, "nearest", None),)

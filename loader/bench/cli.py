"""``imfeed-bench``: argparse and the run, from the images to the table, JSON and chart."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

from ingest.cli import quiet_pipe
from ingest.cores import usable_cores
from loader.bench.settings import RECIPES

DTYPES = ("float32", "float16", "bfloat16", "uint8")


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "imfeed-bench"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="imfeed-bench",
        description="Loader throughput, side by side: torch DataLoader + ImageFolder (PIL), "
        "torch DataLoader + LMDBDataset, loader.DataLoader on every decoder backend, and "
        "DALI, FFCV, MosaicML Streaming, LitData and WebDataset when installed; same images, "
        "augmentation, batch size and workers. Writes a table, JSON and a PNG chart to --out.",
    )
    a = p.add_argument
    a(
        "--data",
        type=Path,
        help="an image folder (ImageFolder layout) or a store; "
        "default: generate --images ImageNet-shaped JPEGs",
    )
    a("--images", type=int, help="images to generate without --data (default 2560; --quick 200)")
    a("--photos", type=Path, help="photographs to cut images from (default: bundled)")
    a(
        "--workdir",
        type=Path,
        default=_cache_dir(),
        help="where generated images, stores and the peers' conversions are kept and reused "
        "(default %(default)s)",
    )
    a("--out", type=Path, default=Path("imfeed-bench-results"), help="results directory")
    a("--name", help="base name of the result files (default: gpu-/cpu-<cores>cpu[-quick])")
    a("--quick", action="store_true", help="a small run, under a minute on 2 cores")
    a("--batch-size", type=int, help="default 128 (--quick 32)")
    a("--workers", type=int, help="workers (DALI: threads) of every pipeline (default: all cores)")
    a("--dtype", choices=DTYPES, default="float32", help="images dtype delivered")
    a("--channels-last", action="store_true", help="deliver images in channels_last layout")
    a("--eval", action="store_true", help="resize + centre crop instead of train augmentation")
    a("--recipe", choices=RECIPES, default="standard", help="train augmentation: crop + flip, "
      "or RandAugment(2, 9) after them (DALI: its auto_aug.rand_augment)")  # fmt: skip
    a("--passes", type=int, help="timed passes after a warm-up pass (default 3; --quick 2)")
    a("--min-pass-seconds", type=float, help="a pass reads whole epochs until at least this "
      "long has passed (default 2; --quick 0: one epoch), so that a fast pipeline's passes "
      "are not a fraction of a second")  # fmt: skip
    a(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where batches are delivered (default: cuda when available)",
    )
    a(
        "--train-check",
        action="store_true",
        help="GPU only: ResNet-18/50 fed by each pipeline vs synthetic on-GPU data",
    )
    a("--train-steps", type=int, help="timed training steps per check (default 100; --quick 10)")
    a("--train-warmup", type=int, help="untimed training steps first (default: a fifth of "
      "the timed ones, at least what a pipeline holds ready: 2 per worker + 2; ours with "
      "decoder='dali' trains untimed longer while it tries its two ways)")  # fmt: skip
    a("--only", help="comma-separated pipeline names to run (default: all available)")
    a(
        "--max-size",
        type=int,
        metavar="PX",
        help="build the store with `ingest build "
        "--max-size PX`; the folder peers read the same capped images",
    )
    a(
        "--short-side",
        type=_side_range,
        default="300-450",
        metavar="LO-HI",
        help="short side of the generated images, in px (default 300-450, ImageNet's; "
        "e.g. 800-1000 for camera-sized photos, to see what --max-size buys)",
    )
    a("--encoding", type=_encoding, default="jpeg", help="build the store that ours and "
      "torch-lmdb read with `ingest build --encoding E` (raw, mixed:SHARE); the folder "
      "pipelines read the JPEGs, and a name of ours ending @jpeg (e.g. loader-cpu@jpeg) "
      "reads the JPEG store beside it (default: jpeg)")  # fmt: skip
    a("--prepare-only", action="store_true", help="only make the images and the store, then exit")
    a("--logs", type=Path, help="where pipelines' own output goes (default: OUT/logs)")
    a("--replot", type=Path, metavar="JSON", help="only redo the table and chart of a run")
    a("--note", default="", help="free text stored in the JSON (e.g. 'machine not quiet')")
    return p


def _encoding(text: str) -> str:
    from ingest.build.encoding import parse_encoding

    try:
        return parse_encoding(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--encoding ")) from None


def _side_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(v) for v in text.split("-"))
    except ValueError:
        lo = hi = 0
    if not 16 <= lo <= hi:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give two sizes in px as LO-HI, 16 <= LO <= HI (e.g. 800-1000)"
        )
    return lo, hi


def settle(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick and the machine; check the numbers."""
    q = args.quick
    defaults = {"images": (200, 2560), "batch_size": (32, 128), "passes": (2, 3),
                "train_steps": (10, 100), "min_pass_seconds": (0.0, 2.0)}  # fmt: skip
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    args.workers = usable_cores() if args.workers is None else args.workers
    for name in ("images", "batch_size", "passes", "train_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"imfeed-bench: --{name.replace('_', '-')} must be at least 1")
    if args.workers < 0:
        raise SystemExit("imfeed-bench: --workers must be at least 0")
    if not 0 <= args.min_pass_seconds <= 3600:
        raise SystemExit("imfeed-bench: --min-pass-seconds must be between 0 and 3600")
    return args


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("imfeed-bench: --device cuda, but torch sees no CUDA device")
    return choice


@quiet_pipe
def main(argv: list[str] | None = None) -> int:
    args = settle(parser().parse_args(argv))
    if args.replot:
        return replot(args.replot)

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    from loader.bench import data as bench_data
    from loader.bench.run import run

    device = _device(args.device)
    if args.train_check and device == "cpu":
        raise SystemExit("imfeed-bench: --train-check needs a CUDA device (it trains ResNets)")
    try:
        data = bench_data.prepare(
            args.data, args.images, args.workdir, args.photos, say, args.max_size,
            args.short_side, args.encoding,
        )  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"imfeed-bench: {e}") from None
    if args.prepare_only:
        say(f"ready: {data.images} images in {data.folder}, store {data.store}")
        return 0
    t0 = time.time()
    before = signal.signal(signal.SIGTERM, _stop)  # ``timeout``, a scheduler: as Ctrl-C
    try:
        report = run(args, data, device, say)
    except KeyboardInterrupt:
        report = None
    finally:
        signal.signal(signal.SIGTERM, before)
    if report is None:
        say("imfeed-bench: stopped before a timed pass was done; nothing written")
        return 130
    report["wall_seconds"] = round(time.time() - t0, 1)
    print(_write(args, report, device, say))
    return 130 if report.get("stopped") else 0


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt


def _write(args, report: dict, device: str, say) -> str:
    """Write JSON, Markdown table and PNG chart; return the text for stdout."""
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"{'gpu' if device != 'cpu' else 'cpu'}-{usable_cores()}cpu" + (
        "-quick" if args.quick else ""
    )
    base = args.out / name
    report["chart"] = _chart(base.with_suffix(".png"), report, say)
    base.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    text = f"{subtitle(report)}\n\n{report['table']}\n\n{report['headline']}\n"
    base.with_suffix(".md").write_text(text)
    files = ", ".join(str(base.with_suffix(s)) for s in (".json", ".md", ".png"))
    say(f"wrote {files}")
    return text


def subtitle(report: dict) -> str:
    """The machine and the settings of a run, in one line."""
    from loader.bench.report import stopped_words

    m, s, d = report["machine"], report["settings"], report["data"]
    kept = d.get("kept")  # reports before it have none
    kept = f" ({kept} kept in the store)" if kept not in (None, d["images"]) else ""
    return (
        f"{m['cpu']}, {m['cpus']} cores, {m['gpu'] or 'no GPU'}; {d['images']} images{kept}, "
        f"batch {s['batch_size']}, {s['workers']} workers, {s['dtype']}"
        f"{', channels_last' if s['channels_last'] else ''}, "
        f"{'eval' if s['eval'] else _recipe(s)} augmentation, on {s['device']}; {report['date']}"
        + (f"; {words}" if (words := stopped_words(report)) else "")
    )


def _recipe(settings: dict) -> str:
    recipe = settings.get("recipe", "standard")  # reports before it have none
    return "train" if recipe == "standard" else f"train + {recipe}"


def _chart(path: Path, report: dict, say) -> str | None:
    """Draw the chart of ``report`` at ``path``; its file name, or None without matplotlib."""
    from loader.bench import chart

    ours = {n for n, r in report["results"].items() if r["side"] == "ours"}
    try:
        chart.draw(path, report["results"], ours, f"imfeed-bench: {report['headline']}",
                   subtitle(report))  # fmt: skip
    except ImportError as e:
        say(f"no chart: {e}")
        return None
    return path.name


def replot(path: Path) -> int:
    """``--replot FILE.json``: recompute the derived figures of a finished run from its
    measured ones, redraw its chart beside it (e.g. for a run made on a machine without
    matplotlib) and print its table."""
    from loader.bench.report import finish

    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"imfeed-bench: --replot {path}: cannot read it ({e})") from None
    if not isinstance(report, dict) or report.get("tool") != "imfeed-bench":
        raise SystemExit(f"imfeed-bench: --replot {path}: not a result of imfeed-bench")
    finish(report)  # derived figures again, as this version computes them
    report["chart"] = _chart(path.with_suffix(".png"), report, lambda m: print(m, file=sys.stderr))
    path.write_text(json.dumps(report, indent=1) + "\n")
    text = f"{subtitle(report)}\n\n{report['table']}\n\n{report['headline']}\n"
    path.with_suffix(".md").write_text(text)
    print(text)
    return 0 if report["chart"] else 1

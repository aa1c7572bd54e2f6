"""One benchmark run: pick the pipelines, run their passes (and training checks), gather
the figures into the report that the table, JSON and chart are made from."""

from __future__ import annotations

import time
from dataclasses import asdict

from loader.bench import report as rep
from loader.bench import runner, stores
from loader.bench.data import Data
from loader.bench.machine import fingerprint
from loader.bench.pipelines import share_variant, specs, unavailable
from loader.bench.rounds import rounds
from loader.bench.settings import Settings
from loader.bench.train import MODELS


def settings(args, data: Data, device: str) -> Settings:
    return Settings(
        folder=str(data.folder) if data.folder else None,
        store=str(data.store) if data.store else None,
        batch_size=args.batch_size,
        workers=args.workers,
        dtype=args.dtype,
        channels_last=args.channels_last,
        eval=args.eval,
        device=device,
        train_steps=args.train_steps,
        train_warmup=max(args.train_warmup or 0, train_warmup(args.train_steps, args.workers)),
        min_pass_seconds=args.min_pass_seconds,
        jpeg_store=str(data.jpeg_store) if data.jpeg_store else None,
        recipe=args.recipe,
        workdir=str(args.workdir),
    )


def train_warmup(train_steps: int, workers: int) -> int:
    """Untimed steps before a training check: at least what a pipeline may hold ready
    while it waits for the check to start (torch's DataLoader: 2 batches per worker),
    so that no pipeline is timed on batches it made beforehand."""
    return max(2, train_steps // 5, 2 * workers + 2)


def choose(args, s: Settings) -> tuple[list, dict]:
    """The pipelines to run and, for the others, why not."""
    only = {n.strip() for n in args.only.split(",")} if args.only else None
    known = specs() + [v for n in sorted(only or ()) if (v := share_variant(n))]
    if only and only - {k.name for k in known}:
        names = ", ".join(k.name for k in known)
        raise SystemExit(f"imfeed-bench: --only {args.only}: unknown name; known: {names}")
    skipped = {}
    for spec in known:
        reason = "not in --only" if only and spec.name not in only else unavailable(spec, s)
        if reason:
            skipped[spec.name] = reason
    return known, skipped


def run(args, data: Data, device: str, say) -> dict | None:
    """Run every available pipeline; return the report (figures, summary, table), or None
    when stopped before a timed pass was done."""
    s = settings(args, data, device)
    known, skipped = choose(args, s)
    names = [k.name for k in known if k.name not in skipped]
    say(f"{data.images} images ({data.mean_kib:.0f} KiB each), batch {s.batch_size}, "
        f"{s.workers} workers, {s.dtype} on {device}; starting {', '.join(names)} ...")  # fmt: skip
    log_dir = args.logs or args.out / "logs"
    extra = ["synthetic"] if args.train_check else []
    servers, failed, passes, done = {}, {}, {}, 0
    trained, ceiling, train_failed, stopped = {}, {}, {}, None
    try:
        servers, failed = runner.start(names + extra, s, log_dir, say)
        timed = {n: sv for n, sv in servers.items() if n != "synthetic"}
        passes, failed_passes, done = rounds(timed, args.passes, say)
        failed |= failed_passes
        if 0 < done < args.passes:
            stopped = {"timed_passes": done, "in_training": False}
        elif done and args.train_check:
            alive = {n: sv for n, sv in servers.items() if n not in failed}
            try:
                trained, train_failed = runner.train(alive, MODELS, say)
            except KeyboardInterrupt:
                trained, stopped = {}, {"timed_passes": done, "in_training": True}
            ceiling = trained.pop("synthetic", {})
            if not stopped and ("synthetic" in train_failed or "synthetic" in failed):
                say("  no synthetic ceiling: the training shares cannot be computed")
    finally:
        # stopped: the passes under way are dropped, their processes need not finish them
        runner.stop_all(servers, patience=5.0 if stopped or done < args.passes else 60.0)
        runner.drop_empty_logs(log_dir, names + extra)
    if done == 0:
        return None  # stopped before a timed pass was done: nothing to show
    made = {n: sv.made for n, sv in servers.items()}
    results = _results(known, skipped, failed, passes, trained)
    for name, r in results.items():
        if r["status"] == "ok":
            r["store"] = stores.of(name, asdict(s), made.get(name))
    for name, reason in train_failed.items():
        if name in results:
            results[name]["train_error"] = reason
    report = {
        "tool": "imfeed-bench",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "note": args.note,
        "machine": fingerprint(),
        "settings": asdict(s) | {"passes": args.passes, "quick": args.quick},
        "data": {
            "images": data.images,
            "kept": data.kept,
            "mean_kib": data.mean_kib,
            "origin": data.origin,
            "photos": str(args.photos) if args.photos else "bundled",
        },
        "results": results,
        "train_ceiling": ceiling or None,
        "stopped": stopped,  # a run cut short: the timed passes it finished
    }
    return rep.finish(report)


def _results(known, skipped: dict, failed: dict, passes: dict, trained: dict) -> dict:
    out = {}
    for spec in known:
        r = {"label": spec.label, "side": spec.side}
        reason = skipped.get(spec.name) or failed.get(spec.name)
        if reason:
            out[spec.name] = r | {"status": "skipped", "reason": reason}
            continue
        r |= {"status": "ok"} | rep.pipeline_figures(passes[spec.name])
        if trained.get(spec.name):
            r["train"] = trained[spec.name]
        out[spec.name] = r
    return out

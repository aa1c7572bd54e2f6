"""Figures from the passes: per-pipeline medians and spread, ratios, the summary, the table.

A ratio between two pipelines is the ratio of their median img/s, so that a table or a
chart sorted by img/s is sorted by ratio too; the per-pass rates are kept in the JSON.
"""

from __future__ import annotations

import statistics

from loader.bench import busy
from loader.bench.pipelines import BASELINE


def pipeline_figures(passes: list[dict]) -> dict:
    """img/s (median of the timed passes), spread, cores busy, peak memory of one pipeline."""
    timed = passes[1:]  # pass 0 is the warm-up
    rates = [p["images"] / p["seconds"] for p in timed]
    gpu = [p["gpu_memory_mib"] for p in passes if p.get("gpu_memory_mib") is not None]
    return _decode_share(timed) | {
        "img_per_s": round(statistics.median(rates), 1),
        "rates": [round(r, 2) for r in rates],
        "spread": [round(min(rates), 1), round(max(rates), 1)],
        "cpu_cores_busy": round(
            statistics.median(p["cpu_seconds"] / p["seconds"] for p in timed), 2
        ),
        "memory_mib": max(p["memory_mib"] for p in passes),
        "gpu_memory_mib": max(gpu) if gpu else None,
        "other_cores_busy": busy.other_cores(timed),  # other processes, at most
        "passes": passes,
    }


def _decode_share(timed: list[dict]) -> dict:
    """``{"decode_share": {"gpu": f, "cpu": f}}``: the share of the timed passes' samples
    each side decoded (our loader only; empty for a peer)."""
    counts = [p["decoded"] for p in timed if "decoded" in p]
    total = sum(sum(c.values()) for c in counts)
    if not counts or not total:
        return {}
    return {"decode_share": {s: round(sum(c[s] for c in counts) / total, 4) for s in counts[0]}}


def ratio(results: dict, a: str, b: str) -> float:
    """img/s of ``a`` over img/s of ``b`` (their medians)."""
    return round(results[a]["img_per_s"] / results[b]["img_per_s"], 3)


def _best(results: dict, names: list[str]) -> str | None:
    ok = [n for n in names if results.get(n, {}).get("status") == "ok"]
    return max(ok, key=lambda n: results[n]["img_per_s"]) if ok else None


def summarise(results: dict, trained: bool) -> dict:
    """The run's verdict in numbers: ours against the baseline, DALI and the best peer."""
    side = {name: r["side"] for name, r in results.items()}
    ours = _best(results, [n for n in results if side.get(n) == "ours"])
    dali = _best(results, [n for n in results if n.startswith("dali-")])
    peer = _best(results, [n for n in results if side.get(n) in ("peer", "baseline")])
    ok = [n for n in results if results[n]["status"] == "ok"]
    out = {"ours": ours, "best_dali": dali, "best_peer": peer}
    have_base = results.get(BASELINE, {}).get("status") == "ok"
    out["vs_pil"] = ratio(results, ours, BASELINE) if ours and have_base else None
    out["vs_dali"] = ratio(results, ours, dali) if ours and dali else None
    out["vs_best_peer"] = ratio(results, ours, peer) if ours and peer else None
    others = [n for n in ok if side.get(n) in ("peer", "baseline")]
    out["vs_peers"] = {n: ratio(results, ours, n) for n in others} if ours else {}
    out["machine_busy"] = busy.busy(results)  # pipelines timed beside other busy processes
    cores = {n: results[n]["cpu_cores_busy"] for n in ok}
    out["cpu_cores_busy"] = cores | ({"ours": cores[ours]} if ours else {})
    shares = {n: results[n]["decode_share"] for n in ok if "decode_share" in results[n]}
    if shares:  # which decoder took which share of the samples, per pipeline of ours
        out["decode_share"] = shares
    if trained:
        mine = [n for n in ok if side.get(n) in ("ours", "reference")]
        for model in ("resnet18", "resnet50"):
            out |= _best_share(results, mine, model)
    return out


def _best_share(results: dict, names: list[str], model: str) -> dict:
    """The best training share of ``model`` among our pipelines ``names``: which one fed
    it, the share of the ceiling and the share of step time waiting for data."""
    fed = [(results[n]["train"][model], n) for n in names if results[n].get("train", {}).get(model)]
    fed = [(t, n) for t, n in fed if t.get("share") is not None]
    if not fed:
        return {f"{model}_share": None}
    t, name = max(fed, key=lambda x: x[0]["share"])
    return {
        f"{model}_share": t["share"],
        f"{model}_wait_share": t["wait_share"],
        f"{model}_fed_by": name,
    }


def add_ratios(results: dict) -> None:
    """Each pipeline's ratio to the baseline (None without a baseline)."""
    base = results.get(BASELINE, {}).get("status") == "ok"
    for name, r in results.items():
        if r["status"] == "ok":
            r["vs_pil"] = ratio(results, name, BASELINE) if base else None


def add_shares(results: dict, ceiling: dict) -> None:
    """Each training check's share of the synthetic-data ceiling of its model."""
    for r in results.values():
        for model, t in r.get("train", {}).items():
            top = ceiling.get(model, {}).get("img_per_s")
            t["share"] = round(t["img_per_s"] / top, 3) if top else None


def _fmt(x, spec: str = ".1f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def table(results: dict, summary: dict, ceiling: dict) -> str:
    """A Markdown table, one row per pipeline (skipped ones last, with the reason)."""
    head = ["pipeline", "img/s (median)", "min-max", "vs PIL", "cores busy", "memory MiB"]
    head += ["GPU MiB"] if any(r.get("gpu_memory_mib") for r in results.values()) else []
    stored = any(r.get("store") for r in results.values())
    head += ["data MiB", "made in s"] if stored else []
    models = [m for m in ("resnet18", "resnet50") if m in ceiling]
    head += [f"{m}: % of {ceiling[m]['img_per_s']:.0f} img/s (waiting)" for m in models]
    rows = []
    ok = sorted(
        (n for n in results if results[n]["status"] == "ok"),
        key=lambda n: -results[n]["img_per_s"],
    )
    for n in ok:
        r = results[n]
        name = f"**{n}**" if n == summary.get("ours") else n
        row = [name, _fmt(r["img_per_s"]), f"{r['spread'][0]:.0f}-{r['spread'][1]:.0f}"]
        row += [_fmt(r.get("vs_pil"), ".2f") + ("x" if r.get("vs_pil") else "")]
        row += [_fmt(r["cpu_cores_busy"], ".2f"), _fmt(r["memory_mib"], ".0f")]
        row += [_fmt(r.get("gpu_memory_mib"), ".0f")] if "GPU MiB" in head else []
        if stored:
            store = r.get("store") or {}
            row += [_fmt(store.get("mib"), ".0f"), _fmt(store.get("convert_seconds"), ".1f")]
        for m in models:
            t = r.get("train", {}).get(m)
            row.append(f"{t['share']:.0%} ({t['wait_share']:.0%})" if t and t.get("share") else "-")
        rows.append(row)
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    shares = [
        f"{n}: {d['gpu']:.0%} on the GPU, {d['cpu']:.0%} by the workers"
        for n in ok
        if (d := results[n].get("decode_share"))
    ]
    shares = ["", "Decoded (timed passes): " + "; ".join(shares)] if shares else []
    read = [f"{n}: {r['store']['format']}" for n in ok if (r := results[n]).get("store")]
    notes = ["", "Data read: " + "; ".join(read)] if read else []
    vs = summary.get("vs_peers") or {}
    if vs:  # ours against each of the others, in the same run
        each = ", ".join(f"{x:.2f}x {n}" for n, x in sorted(vs.items(), key=lambda v: v[1]))
        notes += ["", f"Ours ({summary['ours']}) against each: {each}"]
    skipped = [f"- {n}: skipped, {results[n]['reason']}" for n in results if n not in ok]
    warn = busy.warning(summary.get("machine_busy") or {})
    tail = shares + notes + (["", *skipped] if skipped else []) + (["", warn] if warn else [])
    return "\n".join(lines + tail)


def stopped_words(report: dict) -> str:
    """How a run stopped midway ended, in a few words; "" for a whole run."""
    stop = report.get("stopped")
    if not stop:
        return ""
    if stop["in_training"]:
        return "stopped during the training checks"
    return f"stopped after {stop['timed_passes']} of {report['settings']['passes']} timed passes"


def stopped_note(report: dict) -> str:
    """What a run stopped midway holds, in a sentence."""
    held = "no training figures" if report["stopped"]["in_training"] else "the figures of those"
    return f"{stopped_words(report).capitalize()}: {held}."


def headline(summary: dict, results: dict) -> str:
    """One sentence: how much faster ours is than the baseline and the best peer."""
    ours = summary.get("ours")
    if ours is None:
        return "our loader did not run: see the skipped reasons above"
    parts = [f"{ours}: {results[ours]['img_per_s']:.0f} img/s"]
    if summary.get("vs_pil"):
        parts.append(f"{summary['vs_pil']:.2f}x the torch + PIL baseline")
    if summary.get("vs_dali"):
        parts.append(f"{summary['vs_dali']:.2f}x DALI's best ({summary['best_dali']})")
    peer = summary.get("best_peer")
    if summary.get("vs_best_peer") and peer not in (BASELINE, summary.get("best_dali")):
        parts.append(f"{summary['vs_best_peer']:.2f}x the best other pipeline ({peer})")
    if summary.get("resnet50_share"):
        fed_by = summary.get("resnet50_fed_by")
        by = f" fed by {fed_by}" if fed_by and fed_by != ours else ""
        parts.append(f"ResNet-50 trains at {summary['resnet50_share']:.0%} of its ceiling{by}")
    return ", ".join(parts)


def finish(report: dict) -> dict:
    """Fill in what is derived from the measured figures of ``report`` (its "results" and
    "train_ceiling"): ratios, training shares, the summary, the table and the headline."""
    results, ceiling = report["results"], report.get("train_ceiling") or {}
    add_ratios(results)
    add_shares(results, ceiling)
    trained = bool(ceiling) or any(r.get("train") for r in results.values())
    summary = summarise(results, trained)
    report["summary"] = summary
    report["table"] = table(results, summary, ceiling)
    if report.get("stopped"):  # cut short: what it finished, said as such
        report["table"] += "\n\n" + stopped_note(report)
    report["headline"] = headline(summary, results)
    return report

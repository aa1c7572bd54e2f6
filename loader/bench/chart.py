"""The PNG chart: one bar per pipeline, ours in colour, each labelled with img/s and its
ratio to the PIL baseline; with a training check, a second panel of shares of the ceiling.
matplotlib is optional (``pip install 'imfeed[bench]'``)."""

from __future__ import annotations

from pathlib import Path

from loader.bench.pipelines import BASELINE

OURS, BASE, PEER = "#e4572e", "#555555", "#b8b8b8"


def _colour(name: str, ours: set[str]) -> str:
    return OURS if name in ours else BASE if name == BASELINE else PEER


def _name(name: str, ours: set[str]) -> str:
    return f"ours: {name}" if name in ours else f"baseline: {name}" if name == BASELINE else name


def draw(path: Path, results: dict, ours: set[str], title: str, subtitle: str) -> None:
    """Write the chart to ``path``.

    Raises:
        ImportError: matplotlib is not installed (the message says how to install it).
    """
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the chart needs matplotlib: pip install 'imfeed[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted((n for n in results if results[n]["status"] == "ok"),
                key=lambda n: results[n]["img_per_s"])  # fmt: skip
    trained = any(results[n].get("train") for n in ok)
    fig, axes = plt.subplots(
        1, 2 if trained else 1, figsize=(13 if trained else 9, 1.2 + 0.55 * len(ok)),
        squeeze=False, gridspec_kw={"width_ratios": [3, 2]} if trained else None,
    )  # fmt: skip
    _throughput(axes[0][0], results, ok, ours)
    if trained:
        _training(axes[0][1], results, ok, ours)
    fig.suptitle(f"{title}\n{subtitle}", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _throughput(ax, results: dict, ok: list[str], ours: set[str]) -> None:
    rates = [results[n]["img_per_s"] for n in ok]
    lo = [r - results[n]["spread"][0] for n, r in zip(ok, rates, strict=True)]
    hi = [results[n]["spread"][1] - r for n, r in zip(ok, rates, strict=True)]
    colours = [_colour(n, ours) for n in ok]
    names = [_name(n, ours) for n in ok]
    ax.barh(names, rates, color=colours, xerr=[lo, hi], ecolor="#333333", capsize=3)
    top = max((r + h for r, h in zip(rates, hi, strict=True)), default=1)
    for i, n in enumerate(ok):
        vs = results[n].get("vs_pil")
        ratio = "   baseline" if n == BASELINE else f"   {vs:.2f}x torch + PIL" if vs else ""
        label = f" {rates[i]:,.0f} img/s{ratio}"
        bold = n in ours
        ax.text(rates[i] + hi[i], i, label, va="center", fontsize=9 if not bold else 10,
                fontweight="bold" if bold else "normal")  # fmt: skip
    ax.set_xlim(0, top * 1.6)  # room for the labels right of the whiskers
    ax.set_xlabel("images/s delivered (median of timed passes; whiskers: min-max)")
    for tick in ax.get_yticklabels():
        if tick.get_text().startswith("ours: "):
            tick.set_fontweight("bold")
            tick.set_color(OURS)
    ax.spines[["top", "right"]].set_visible(False)


def _training(ax, results: dict, ok: list[str], ours: set[str]) -> None:
    height = 0.38
    for j, (model, alpha) in enumerate((("resnet18", 0.55), ("resnet50", 1.0))):
        shares = [(results[n].get("train", {}).get(model) or {}).get("share") or 0 for n in ok]
        ys = [i + (j - 0.5) * height for i in range(len(ok))]
        ax.barh(ys, [100 * s for s in shares], height=height, alpha=alpha, label=model,
                color=[_colour(n, ours) for n in ok])  # fmt: skip
        for y, s in zip(ys, shares, strict=True):
            if s:
                ax.text(100 * s + 1, y, f"{model[6:]}: {s:.0%}", va="center", fontsize=7)
    ax.set_yticks(range(len(ok)), [""] * len(ok))
    ax.set_xlim(0, 125)
    ax.axvline(100, color="#333333", lw=0.8, ls="--")
    ax.set_xlabel("training speed, % of synthetic-data ceiling (ResNet-18 / -50)")
    ax.spines[["top", "right"]].set_visible(False)

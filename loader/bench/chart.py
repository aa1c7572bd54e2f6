"""The PNG chart: one bar per pipeline, ours in colour, each labelled with img/s and its
ratio to the PIL baseline; with a training check, a second panel of shares of the ceiling.
matplotlib is optional (``pip install 'imfeed[bench]'``)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

from loader.bench.pipelines import BASELINE

OURS, BASE, PEER = "#e4572e", "#555555", "#b8b8b8"
LOG_SPAN = 20  # bars spanning more than this many times: a log axis


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
        1, 2 if trained else 1, figsize=(13 if trained else 9, 1.4 + 0.45 * len(ok)),
        squeeze=False, gridspec_kw={"width_ratios": [3, 2]} if trained else None,
    )  # fmt: skip
    labels = _throughput(axes[0][0], results, ok, ours)
    if trained:
        _training(axes[0][1], results, ok, ours)
    width = int(fig.get_figwidth() * 15)  # characters of a 10 pt line across the figure
    lines = [*textwrap.wrap(title, width), *textwrap.wrap(subtitle, width)]
    fig.suptitle("\n".join(lines), fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    _fit(axes[0][0], *labels)  # once the layout has given the axes their width
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _throughput(ax, results: dict, ok: list[str], ours: set[str]) -> tuple[list, list, list]:
    """The bars, whiskers and labels; (bar starts, label anchors, labels) for ``_fit``."""
    rates = [results[n]["img_per_s"] for n in ok]
    low = [results[n]["spread"][0] for n in ok]
    high = [results[n]["spread"][1] for n in ok]
    whiskers = [[r - x for r, x in zip(rates, low, strict=True)],
                [x - r for r, x in zip(rates, high, strict=True)]]  # fmt: skip
    colours = [_colour(n, ours) for n in ok]
    ax.barh([_name(n, ours) for n in ok], rates, color=colours, xerr=whiskers,
            ecolor="#333333", capsize=3)  # fmt: skip
    texts = []
    for i, n in enumerate(ok):
        vs = results[n].get("vs_pil")
        ratio = "   baseline" if n == BASELINE else f"   {vs:.2f}x torch + PIL" if vs else ""
        style = {"fontsize": 10, "fontweight": "bold"} if n in ours else {"fontsize": 9}
        text = ax.text(high[i], i, f" {rates[i]:,.0f} img/s{ratio}", va="center", **style)
        text.set_in_layout(False)  # ``_fit`` makes room for it inside the axes
        texts.append(text)
    ax.set_xlabel("images/s delivered (median of timed passes; whiskers: min-max)")
    for tick in ax.get_yticklabels():
        if tick.get_text().startswith("ours: "):
            tick.set_fontweight("bold")
            tick.set_color(OURS)
    ax.spines[["top", "right"]].set_visible(False)
    return low, high, texts


def _fit(ax, starts: list[float], anchors: list[float], texts: list) -> None:
    """The x axis fitted to the bars: from 0, or on a log scale where they span more than
    ``LOG_SPAN`` times (the slowest would be a sliver); on the right, just room for each
    label, which starts at its anchor and is as wide as its text."""
    top = max(anchors, default=1.0)
    low = min((x for x in starts if x > 0), default=top)
    log = top / max(low, 1e-9) > LOG_SPAN
    left = low / 1.5 if log else 0.0
    if log:
        ax.set_xscale("log")
        ax.set_xlabel(ax.get_xlabel() + "; log scale")
    renderer = ax.figure.canvas.get_renderer()
    width = ax.get_window_extent(renderer).width

    def position(x: float) -> float:  # where x falls, as the axis's share of the right end
        return math.log(x / left) if log else x

    need = max(
        position(x) / max(0.3, 1 - t.get_window_extent(renderer).width / width)
        for x, t in zip(anchors, texts, strict=True)
    ) if texts else 1.0  # fmt: skip
    right = left * math.exp(need * 1.02) if log else need * 1.02
    ax.set_xlim(left, right)


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

"""Charts of benchmark runs: ``pkgd bench … --plot FILE.png``.

A run is a `Series`: a label, throughput figures (``requests/s``, ``output tokens/s`` …) and
latency figures (``TTFT`` → median / mean / p99 in seconds). `series_from_figures` reads them
from the figures a bench command prints and writes with ``--output-json`` (keys
``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``,
``single_stream_decode_tokens_per_s``, and ``ttft_s``, ``tpot_s``, ``itl_s``, ``latency_s`` as
``{"median", "mean", "p99"}``), so any bench command with such figures (throughput, serve, a
latency bench) can be plotted, and a file an earlier run wrote can be drawn beside this one.

`plot_runs` draws one panel per figure that any run has: throughput as one bar per run, each
latency as its median, mean and p99 bars per run; each panel has its own scale (requests/s
and tokens/s differ a thousandfold). The first run is the one measured now; the others are
its baseline (transformers' generate() in the same run) or earlier runs.

matplotlib is an optional dependency (``pip install 'pkgd[plot]'``); it is imported only to
draw, with the file-only Agg backend.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pkgd.benchmarks.stats import PERCENTILES

THROUGHPUT_KEYS = {
    "requests_per_s": "requests/s",
    "output_tokens_per_s": "output tokens/s",
    "total_tokens_per_s": "total tokens/s",
    "single_stream_decode_tokens_per_s": "single-stream decode tokens/s",
}
LATENCY_KEYS = {"ttft_s": "TTFT", "tpot_s": "TPOT", "itl_s": "ITL", "latency_s": "request latency"}
INSTALL_HINT = "--plot needs matplotlib: pip install 'pkgd[plot]'"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed (the message says how to install it)."""


@dataclasses.dataclass
class Series:
    """One run: ``throughput`` label → value; ``latency`` label → {percentile → seconds}."""

    label: str
    throughput: dict[str, float] = dataclasses.field(default_factory=dict)
    latency: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def series_from_figures(figures: dict[str, Any], label: str, *, prefix: str = "") -> Series:
    """The `Series` of a bench command's figures; ``prefix`` selects a baseline's keys stored
    beside them (``hf_`` for ``hf_output_tokens_per_s`` …). Missing and NaN figures are left out."""
    series = Series(label)
    for key, name in THROUGHPUT_KEYS.items():
        value = figures.get(prefix + key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            series.throughput[name] = float(value)
    for key, name in LATENCY_KEYS.items():
        stats = figures.get(prefix + key)
        if isinstance(stats, dict):
            kept = {
                p: float(stats[p])
                for p in PERCENTILES
                if isinstance(stats.get(p), (int, float)) and math.isfinite(stats[p])
            }
            if kept:
                series.latency[name] = kept
    return series


def load_previous(path: str | Path) -> Series:
    """The run an earlier ``--output-json`` wrote, labelled with its file name.

    Raises:
        ValueError: the file cannot be read or holds no figures.
    """
    p = Path(path)
    try:
        figures = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read a previous run ({e})") from e
    series = series_from_figures(figures, p.stem) if isinstance(figures, dict) else Series(p.stem)
    if not series.throughput and not series.latency:
        raise ValueError(f"{path}: no benchmark figures (expected a file written by --output-json)")
    return series


def check_available() -> None:
    """Raise `PlotUnavailable` when matplotlib is missing (call before a long run)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailable(INSTALL_HINT)


def plot_runs(runs: Sequence[Series], path: str | Path, *, title: str) -> Path:
    """Draw ``runs`` (see the module docstring) into the PNG ``path``; returns it.

    Raises:
        PlotUnavailable: matplotlib is not installed.
        ValueError: no run has any figure.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable(INSTALL_HINT) from e
    throughput = list(dict.fromkeys(k for r in runs for k in r.throughput))
    latency = list(dict.fromkeys(k for r in runs for k in r.latency))
    panels = [("throughput", k) for k in throughput] + [("latency", k) for k in latency]
    if not panels:
        raise ValueError("nothing to plot: no run has throughput or latency figures")
    cols = min(4, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows + 0.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (kind, name) in zip(axes.flat, panels):
        if kind == "throughput":
            _throughput_panel(ax, runs, name, colors)
        else:
            _latency_panel(ax, runs, name, colors)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[i % len(colors)]) for i in range(len(runs))]
    fig.legend(handles, [r.label for r in runs], loc="upper right", ncol=min(len(runs), 4), frameon=False)
    fig.suptitle(title, x=0.01, ha="left", fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / (3.6 * rows + 0.6)))
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _throughput_panel(ax: Any, runs: Sequence[Series], name: str, colors: list[str]) -> None:
    for i, run in enumerate(runs):
        value = run.throughput.get(name)
        if value is None:
            continue
        ax.bar(i, value, color=colors[i % len(colors)])
        ax.annotate(_short(value), (i, value), ha="center", va="bottom", fontsize=8)
    ax.set_title(name, fontsize=10)
    ax.set_xticks(range(len(runs)), [r.label for r in runs], fontsize=8, rotation=15)
    ax.margins(y=0.15)


def _latency_panel(ax: Any, runs: Sequence[Series], name: str, colors: list[str]) -> None:
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        stats = run.latency.get(name, {})
        xs = [j + (i - (len(runs) - 1) / 2) * width for j, p in enumerate(PERCENTILES) if p in stats]
        ys = [stats[p] * 1e3 for p in PERCENTILES if p in stats]
        ax.bar(xs, ys, width=width * 0.95, color=colors[i % len(colors)])
    ax.set_title(f"{name} (ms)", fontsize=10)
    ax.set_xticks(range(len(PERCENTILES)), list(PERCENTILES), fontsize=8)


def _short(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def compare_lines(runs: Sequence[Series]) -> list[str]:
    """``this / other`` ratios of each throughput figure, one line per other run (what the
    text report adds to a plot)."""
    if len(runs) < 2:
        return []
    this, lines = runs[0], []
    for other in runs[1:]:
        ratios = [
            f"{name} {this.throughput[name] / value:.2f}x"
            for name, value in other.throughput.items()
            if name in this.throughput and value > 0
        ]
        if ratios:
            lines.append(f"{this.label} / {other.label}: " + ", ".join(ratios))
    return lines


def add_plot_args(parser: Any) -> None:
    """``--plot FILE.png`` and ``--compare RUN.json`` (repeatable) on a bench command's parser."""
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw throughput and latency percentiles of this run (and of the runs compared) into a PNG "
        "(needs pkgd[plot])",
    )
    parser.add_argument(
        "--compare",
        metavar="RUN.json",
        action="append",
        default=None,
        help="an earlier run's --output-json file to compare with (repeatable): printed as ratios, "
        "drawn beside this run with --plot",
    )


def check_plot_args(args: Any) -> list[Series]:
    """Check ``--plot`` / ``--compare`` before a run starts; returns the earlier runs.

    Raises:
        PlotUnavailable: ``--plot`` without matplotlib.
        ValueError: a ``--compare`` file that is no earlier run.
    """
    if getattr(args, "plot", None):
        check_available()
    return [load_previous(p) for p in getattr(args, "compare", None) or []]


def report(runs: Sequence[Series], plot_path: str | None, *, title: str) -> None:
    """Print the ratios of ``runs[0]`` to the others; draw them all into ``plot_path`` if given."""
    for line in compare_lines(runs):
        print(line)
    if plot_path:
        print(f"plot: {plot_runs(runs, plot_path, title=title)}")

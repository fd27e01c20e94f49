"""The latency-vs-throughput curve of a sweep, drawn with matplotlib's Agg backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenyard.bench.stats import DEFAULT_PERCENTILES, percentile_key

PANELS = (
    ("ttft_ms", "time to first token"),
    ("itl_ms", "inter-token latency"),
    ("e2e_ms", "end-to-end latency"),
)


def _load_label(load: dict[str, Any]) -> str:
    return f"{load['rate']:g}/s" if load["mode"] == "open" else f"c={load['concurrency']}"


def plot_sweep(
    levels: Sequence[dict[str, Any]],
    path: Path,
    *,
    title: str = "latency vs throughput",
    x: str = "requests_per_s",
) -> Path:
    """Latency percentiles of each level against its achieved throughput, saved as an image.

    `x` is a throughput field: `requests_per_s` or `output_tokens_per_s`.
    """
    try:
        # Figure and the Agg canvas directly: no pyplot global state, no display needed
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # an optional dependency: the `bench` extra
        raise RuntimeError("--plot needs matplotlib: pip install 'tokenyard[bench]'") from exc
    points = sorted(levels, key=lambda level: float(level["throughput"][x]))
    xs = [float(level["throughput"][x]) for level in points]
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(PANELS), sharex=True)
    for ax, (key, name) in zip(axes, PANELS, strict=True):
        for q in DEFAULT_PERCENTILES:
            label = percentile_key(q)
            ys = [level[key].get(label) for level in points]
            pairs = [(a, b) for a, b in zip(xs, ys, strict=True) if b is not None]
            if pairs:
                ax.plot([a for a, _ in pairs], [b for _, b in pairs], marker="o", label=label)
        for level, at in zip(points, xs, strict=True):
            top = level[key].get(percentile_key(DEFAULT_PERCENTILES[-1]))
            if top is not None:
                ax.annotate(
                    _load_label(level["load"]),
                    (at, top),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=8,
                )
        ax.set_title(name)
        ax.set_xlabel("achieved " + ("requests/s" if x == "requests_per_s" else "output tokens/s"))
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.margins(x=0.08, y=0.12)  # room for the load labels at the top right
        ax.legend()
    figure.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path

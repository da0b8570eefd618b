"""Charts for probe and bench reports (matplotlib is an optional extra: shardkit[plot])."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import require

if TYPE_CHECKING:
    from ..packing.probe import ProbeReport


def _pyplot() -> Any:
    require("matplotlib", "plot").use("Agg")  # before pyplot is imported: no display needed
    return require("matplotlib.pyplot", "plot")


def plot_formats() -> tuple[str, ...]:
    """File suffixes a plot can be written as (MissingDependencyError without matplotlib)."""
    plt = _pyplot()
    figure = plt.figure()
    try:
        return tuple(sorted(f".{suffix}" for suffix in figure.canvas.get_supported_filetypes()))
    finally:
        plt.close(figure)


def plot_probe(report: ProbeReport, path: Path) -> None:
    plt = _pyplot()
    widths = [w for w, _, _ in report.size_counts]
    heights = [h for _, h, _ in report.size_counts]
    counts = [n for _, _, n in report.size_counts]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    left.hist([min(w, h) for w, h in zip(widths, heights, strict=True)], bins=50, weights=counts, color="#3b7dd8")
    rec = report.recommendation
    if rec is not None and rec.resize is not None:
        left.axvline(rec.resize, color="#d83b3b", linestyle="--", label=f"--resize {rec.resize}")
        left.legend()
    left.set_xlabel("short side (px)")
    left.set_ylabel("images")
    left.set_title("short side distribution")
    # one point per distinct size, its area growing with how many images have it
    right.scatter(widths, heights, s=[4 + 2 * n**0.5 for n in counts], alpha=0.4, color="#3b7dd8")
    right.set_xlabel("width (px)")
    right.set_ylabel("height (px)")
    right.set_title(f"{sum(counts):,} images")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_bars(
    labels: list[str], values: list[float], title: str, unit: str, path: Path, apart: Sequence[str] = ()
) -> None:
    """Horizontal bars, each with its value. The bars named in `apart` go on a panel of their own,
    with its own scale: bench's bytes-only pass runs ~10x the decoders and flattened them all."""
    plt = _pyplot()
    groups = [[(label, value) for label, value in zip(labels, values, strict=True) if (label in apart) == side]
              for side in (False, True)]  # fmt: skip
    groups = [group for group in groups if group]
    figure, axes = plt.subplots(
        len(groups), 1, figsize=(9, 0.5 * len(labels) + 1.5 + len(groups) - 1), squeeze=False,
        gridspec_kw={"height_ratios": [len(group) for group in groups]},
    )  # fmt: skip
    for axis, group in zip(axes[:, 0], groups, strict=True):
        names, numbers = [name for name, _ in group][::-1], [number for _, number in group][::-1]
        bars = axis.barh(names, numbers, color="#3b7dd8")
        axis.bar_label(bars, labels=[f"{number:,.0f}" for number in numbers], padding=3, fontsize=8)
        axis.set_xlim(0, max(numbers, default=0) * 1.15 or 1)
        axis.set_xlabel(unit)
    axes[0, 0].set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)

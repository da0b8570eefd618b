"""Charts for probe and bench reports (matplotlib is an optional extra: shardkit[plot])."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.errors import require

if TYPE_CHECKING:
    from ..packing.probe import ProbeReport
    from ..packing.video_probe import VideoReport


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


def plot_videos(report: VideoReport, path: Path) -> None:
    """The videos' census: histograms of duration, frame rate and short side (as displayed), and a
    point per size; the recommended short side and fps marked where there is one."""
    plt = _pyplot()
    good = [row for row in report.rows if row.error is None]
    figure, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    durations, rates = [row.duration for row in good], [row.fps for row in good]
    shorts = [min(row.width, row.height) for row in good]
    advice = report.recommendation
    panels = (
        (axes[0], durations, "duration (s)", None),
        (axes[1], rates, "frames per second", None if advice is None else advice.fps),
        (axes[2], shorts, "short side (px, as displayed)", None if advice is None else advice.resize),
    )
    for axis, values, label, mark in panels:
        axis.hist(values, bins=min(50, max(1, len(set(values)))), color="#3b7dd8")
        if mark is not None:
            axis.axvline(mark, color="#d83b3b", linestyle="--", label=f"advice: {mark:g}")
            axis.legend()
        axis.set_xlabel(label)
        axis.set_ylabel("videos")
    sizes: dict[tuple[int, int], int] = {}
    for row in good:
        sizes[(row.width, row.height)] = sizes.get((row.width, row.height), 0) + 1
    axes[3].scatter([w for w, _ in sizes], [h for _, h in sizes], s=[4 + 2 * n**0.5 for n in sizes.values()],
                    alpha=0.4, color="#3b7dd8")  # fmt: skip
    axes[3].set_xlabel("width (px)")
    axes[3].set_ylabel("height (px)")
    unreadable = report.files - report.videos
    axes[3].set_title(f"{report.videos:,} videos" + (f" ({unreadable:,} not readable)" if unreadable else ""))
    axes[0].set_title(f"{report.total_seconds:,.1f} s of video")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_bars(
    labels: list[str], values: list[float], title: str, unit: str, path: Path, apart: Sequence[str] = ()
) -> None:
    """Horizontal bars, each with its value. The bars named in `apart` go on a panel of their own,
    with its own scale: bench's bytes-only pass runs far faster than the decoders, and on one scale
    would flatten their bars."""
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

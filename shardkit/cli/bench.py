"""`shardkit bench`: decode speed of shards against the raw folder, side by side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

if TYPE_CHECKING:
    from ..checks.bench_report import BenchReport
    from ..checks.explain import Explanation

from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    check_plot_path,
    console,
    progress_bar,
    storage_options,
    user_errors,
    write_json_report,
)


def bench(
    output: Annotated[str, typer.Argument(help="A shardkit output folder, or its URL (s3://..., https://...).")],
    against: Annotated[Optional[Path], typer.Option(help="The raw image folder the shards were packed from.")] = None,
    workers: Annotated[int, typer.Option(help="Processes per pass.")] = 1,
    repeat: Annotated[int, typer.Option(help="Timed runs per pass (median reported).")] = 3,
    cold: Annotated[bool, typer.Option(help="Evict files from the page cache before each run.")] = False,
    train: Annotated[
        Optional[int],
        typer.Option(help="Also the training input at this crop size: the batch loader vs torchvision on --against."),
    ] = None,
    device: Annotated[
        Optional[str],
        typer.Option(help="With --train: also the loader's device path on this device (cuda, cuda:N; cpu to try it)."),
    ] = None,
    explain: Annotated[
        bool, typer.Option(help="With --train: where the loader's time goes, stage by stage, and what would help.")
    ] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Bar chart of images/s (needs matplotlib).")] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
    cache_dir: Annotated[
        Optional[Path], typer.Option(help="For a URL: the local shard cache. \\[default: ~/.cache/shardkit]")
    ] = None,
    cache_limit: Annotated[
        Optional[str], typer.Option(help="For a URL: the cache's size limit, e.g. 50GB. \\[default: 50GB]")
    ] = None,
) -> None:
    """Measure decode throughput of shards against the raw JPEG folder, on the same images."""
    from ..checks.bench import bench as run_bench  # here, not at the top: every command would pay for it

    with user_errors():
        check_json_path(json_path)
        check_plot_path(plot)
        with progress_bar(unit="passes") as bar:
            task = bar.add_task("measuring", total=None, rate="")
            report = run_bench(
                output, against=against, workers=workers, repeat=repeat, cold=cold, train=train, device=device,
                explain=explain, storage_options=storage_options(storage_option), cache_dir=cache_dir,
                cache_limit=cache_limit,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
        render(report)
        if json_path is not None:
            write_json_report(json_path, report.to_json())
        if plot is not None:
            from ..checks.bench_report import IO_ONLY
            from ..checks.plots import plot_bars

            plot_bars(
                [row.name for row in report.rows], [row.images_per_second for row in report.rows],
                f"decode throughput, {report.workers} process(es), {'cold' if report.cold else 'warm'} cache",
                f"{report.unit}/s", plot, apart=[row.name for row in report.rows if row.name == IO_ONLY],
            )  # fmt: skip


def render(report: BenchReport) -> None:
    from ..checks.bench_report import BASELINE, MEMORY

    cache = "cold cache (evicted before each run)" if report.cold else "warm cache"
    table = Table(
        title=f"{report.images:,} {report.unit}, {report.format} shards, {report.workers} process(es), {cache}, "
        f"median of {report.repeat}",
        title_justify="left",
    )
    against = "vs folder PIL" if report.baseline == BASELINE else "vs the videos"
    for column in ("pass", f"{report.unit}/s", "spread", "MB/s", "per core", against):
        table.add_column(column, justify="left" if column == "pass" else "right")
    for row in report.rows:
        fastest, slowest = row.images / min(row.seconds), row.images / max(row.seconds)
        ratio = report.ratio(row.name)
        table.add_row(
            row.name, f"{row.images_per_second:,.0f}", f"{slowest:,.0f}-{fastest:,.0f}",
            f"{row.megabytes_per_second:,.1f}", f"{row.per_core:,.0f}", f"{ratio:.2f}x" if ratio else "",
        )  # fmt: skip
    console.print(table)
    overhead = report.reader_overhead()
    if overhead is not None:
        how = (
            f"paired every 25 records, median of {len(report.paired_overhead)} rounds "
            f"[{min(report.paired_overhead):+.1%} .. {max(report.paired_overhead):+.1%}]"
            if report.paired_overhead
            else f"{MEMORY} pass"
        )
        console.print(f"shard reader overhead over decoding the same bytes from memory: {overhead:+.1%} ({how})")
    training = [row.name for row in report.rows if row.name.startswith("train ")]
    if len(training) >= 2 and "torchvision" in training[0]:
        for loader in training[1:]:
            console.print(
                f"training input: {loader.split(': ', 1)[1]} is {report.ratio(loader, training[0]):.2f}x "
                "torchvision's RandomResizedCrop on the raw folder (median of the per-round ratios)"
            )
    if report.ratio("shards: libjpeg-turbo") is None and not any(r.name == report.baseline for r in report.rows):
        console.print("[dim]pass --against SRC to compare with the raw folder[/]")
    if report.explained is not None:
        render_explained(report.explained)


def render_explained(explained: Explanation) -> None:
    """The loader's epoch, stage by stage, then the advice drawn from it."""
    stats = explained.stats
    table = Table(
        title=f"where the training input's time goes ({explained.train} px crops, {stats.threads} thread(s), "
        f"{stats.seconds:.2f} s): {stats.verdict}, {stats.dominant} dominates",
        title_justify="left",
    )
    for column in ("stage", "seconds", "share", "what"):
        table.add_column(column, justify="left" if column in ("stage", "what") else "right")
    for name, seconds, what in stats.table():
        share = seconds / stats.seconds if stats.seconds and not name.startswith("threads") else None
        table.add_row(name, f"{seconds:.3f}", "" if share is None else f"{share:.0%}", what)
    console.print(table)
    for line in explained.advice:
        console.print(f"- {line}")

"""`shardkit probe`: the resolution census of an image folder."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..core.config import TableConfig, WebConfig, check_train_size, check_workers
from ..core.errors import ConfigError, ShardkitError, SourceError, describe
from ..core.pack_options import PROBE_OPTIONS, options

if TYPE_CHECKING:
    from ..packing.probe import ProbeChunk, ProbeReport
    from ..packing.sources.labelling import Labelling
    from ..packing.video_probe import VideoReport

from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    check_plot_path,
    check_report_path,
    console,
    human_bytes,
    progress_bar,
    rated,
    source_path,
    storage_options,
    user_errors,
    write_json_report,
)


def probe(
    source: Annotated[
        str,
        typer.Argument(
            help="Image folder (with or without a metadata table), a list file, a bucket's prefix (s3://...), "
            "or a table of image URLs (.parquet, .csv, .jsonl; gzipped text too).",
            show_default=False,
        ),
    ],
    train_size: Annotated[
        Optional[int],
        typer.Option(help=f"Training size the recommendation aims at. \\[default: {PROBE_OPTIONS['train_size']}]"),
    ] = None,
    workers: Annotated[
        Optional[int], typer.Option(help="Threads (compiled scanner) or processes to use. \\[default: one per core]")
    ] = None,
    max_pixels: Annotated[Optional[int], typer.Option(help="Flag images with more pixels as bombs.")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the full report as JSON.")] = None,
    records_path: Annotated[
        Optional[Path], typer.Option("--records", help="Write one row per file (.jsonl or .csv).")
    ] = None,
    plot: Annotated[Optional[Path], typer.Option(help="Draw the distribution to a PNG (needs matplotlib).")] = None,
    config: Annotated[
        Optional[Path], typer.Option(help="TOML preset file, or a named preset (imagenet-256); flags override it.")
    ] = None,
    metadata: Annotated[
        Optional[str], typer.Option(help="A table of samples, as for pack. \\[default: SOURCE/metadata.*]")
    ] = None,
    path_column: Annotated[str, typer.Option(help="The table's column of image paths.")] = "file_name",
    caption_column: Annotated[Optional[str], typer.Option(help="The caption column.")] = None,
    sidecars: Annotated[
        bool, typer.Option("--sidecars", help="Files sharing a name are one sample, as for pack.")
    ] = False,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
    url_column: Annotated[str, typer.Option(help="A table of URLs: the column that holds them.")] = "url",
    retries: Annotated[int, typer.Option(help="A table of URLs: tries again after a transient failure.")] = 5,
    timeout: Annotated[float, typer.Option(help="A table of URLs: one request's deadline in seconds.")] = 30.0,
) -> None:
    """Read only image headers and report sizes, formats, problems and a recommended pre-resize."""
    with user_errors():
        settings = options(PROBE_OPTIONS, config, train_size=train_size, workers=workers, max_pixels=max_pixels)
        check_train_size(settings["train_size"])
        if settings["max_pixels"] < 1:
            raise ConfigError(f"max pixels must be positive, not {settings['max_pixels']}")
        check_workers(settings["workers"])  # before the walk, as every other refusal
        check_json_path(json_path)
        check_report_path(records_path, (".jsonl", ".csv"), what="records")
        check_plot_path(plot)
        with _records_writer(records_path) as write_rows:
            table = TableConfig(
                path=None if metadata is None else source_path(metadata), path_column=path_column,
                caption_column=caption_column,
            )  # fmt: skip
            web = WebConfig(url_column=url_column, retries=retries, timeout=timeout)
            where = source_path(source)
            videos = _run_videos(where, settings) if metadata is None and not sidecars else None
            try:
                report = _run(where, settings, write_rows, table, sidecars, storage_options(storage_option), web)
            except SourceError:
                if videos is None:
                    raise
                report = None  # a folder of videos only
        if report is not None:
            render(report)
        if videos is not None:
            render_videos(videos)
        if json_path is not None:
            whole = report.to_json() if report is not None else {"root": where}
            write_json_report(json_path, {**whole, **({"videos": videos.to_json()} if videos is not None else {})})
        if plot is not None:
            _plot(plot, report, videos)


def _plot(path: Path, report: ProbeReport | None, videos: VideoReport | None) -> None:
    """The images' census drawn to `path`, the videos' too (to `path` where there are no images,
    else beside it: NAME.videos.png)."""
    from ..checks.plots import plot_probe, plot_videos

    if report is not None:
        plot_probe(report, path)
        console.print(f"plot written to {escape(str(path))}", soft_wrap=True)
    if videos is not None:
        where = path if report is None else path.with_name(f"{path.stem}.videos{path.suffix}")
        plot_videos(videos, where)
        console.print(f"plot of the videos written to {escape(str(where))}", soft_wrap=True)


def _render_labels(labels: Labelling | None) -> None:
    if labels is None:
        return
    console.print(f"labels: {escape(labels.said)}", soft_wrap=True)
    for warning in labels.warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)


def _run_videos(source: str, settings: dict[str, Any]) -> VideoReport | None:
    """The census of a local folder's videos, or None where it holds none."""
    from ..packing.sources.video import holds_videos

    if not holds_videos(source):
        return None
    from ..packing.video_probe import probe_videos

    with progress_bar() as bar:
        advance = rated(bar, "probing videos")
        return probe_videos(
            source, workers=settings["workers"], max_pixels=settings["max_pixels"],
            train_size=settings["train_size"], progress=advance,
        )  # fmt: skip


def render_videos(report: VideoReport) -> None:
    from ..packing.sources import display

    rate = report.files / report.seconds if report.seconds else 0
    console.print(
        f"[bold]{escape(display(report.root))}[/]: {report.videos:,} readable videos, {report.files - report.videos:,}"
        f" not, {human_bytes(report.bytes)}, {report.total_seconds:,.1f} s of video, probed in {report.seconds:.2f}s"
        f" ({rate:,.0f} files/s on {report.workers} process{'es' if report.workers > 1 else ''})"
    )
    if report.videos:
        table = Table(title="videos", title_justify="left")
        table.add_column("")
        for name in ("p0", "p5", "p50", "p95", "p100"):
            table.add_column(name, justify="right")
        for what, values in report.distributions.items():
            table.add_row(what, *(f"{values[name]:g}" for name in ("p0", "p5", "p50", "p95", "p100")))
        console.print(table)
        shown = ", ".join(f"{name} {count:,}" for name, count in report.codecs.items())
        formats = ", ".join(f"{name} {count:,}" for name, count in report.pix_fmts.items())
        console.print(f"codecs: {shown}; pixel formats: {formats}")
        console.print(
            f"variable frame rate: {report.vfr:,}; rotated: {report.rotated:,}; mirrored: {report.mirrored:,}; "
            f"with audio: {report.with_audio:,}"
        )
    _render_labels(report.labels)
    for reason, count in report.problems.items():
        examples = ", ".join(escape(name) for name in report.examples.get(reason, []))
        console.print(f"[yellow]{count:,} not readable[/]: {escape(reason)} (e.g. {examples})")
    advice = report.recommendation
    if advice is not None:
        size = f" --resize {advice.resize}" if advice.resize is not None else ""  # (none: the reason says why)
        fps = f" --clip-fps {advice.fps:g}" if advice.fps is not None else ""
        console.print(f"[bold]recommendation[/]: pack --clip-seconds S{size}{fps} ({escape(advice.reason)})")


def _run(
    source: str,
    settings: dict[str, Any],
    on_chunk: Callable[[ProbeChunk], None] | None,
    table: TableConfig | None = None,
    sidecars: bool = False,
    options: dict[str, Any] | None = None,
    web: WebConfig | None = None,
) -> ProbeReport:
    from ..packing.probe import probe as run_probe  # here: `shardkit --help` need not import numpy

    with progress_bar() as bar:
        advance = rated(bar, "probing")

        confirming: list[Any] = []

        def confirmed(done: int, total: int) -> None:  # candidate copies, each read whole
            if not confirming:
                confirming.extend([bar.add_task("copies: reading", total=total, rate=""), time.perf_counter()])
            rate = done / max(time.perf_counter() - confirming[1], 1e-9)
            bar.update(confirming[0], completed=done, rate=f"{rate:,.0f}/s")

        return run_probe(
            source,
            train_size=settings["train_size"],
            workers=settings["workers"],
            max_pixels=settings["max_pixels"],
            progress=advance,
            on_chunk=on_chunk,
            table=table,
            sidecars=sidecars,
            copies_progress=confirmed,
            storage_options=options,
            web=web,
        )


def render(report: ProbeReport) -> None:
    from ..packing.sources import display  # (here: the other commands need no walk)

    rate = report.files / report.seconds if report.seconds else 0
    console.print(
        f"[bold]{display(report.root)}[/]: {report.images:,} readable images, {report.files - report.images:,} not, "
        f"{human_bytes(report.bytes)}, probed in {report.seconds:.2f}s ({rate:,.0f} files/s on {report.workers} "
        f"{report.worker_kind}{('es' if report.worker_kind == 'process' else 's') if report.workers > 1 else ''})"
    )
    if report.header_bytes is not None:
        console.print(f"headers read by range: {human_bytes(report.header_bytes)} of {human_bytes(report.bytes)}")
    if report.images:
        _render_percentiles(report)
        _render_histogram(report)
        counts = ", ".join(f"{name} {n:,}" for name, n in report.formats.items())
        modes = ", ".join(f"{name} {n:,}" for name, n in report.modes.items())
        console.print(f"formats: {counts}   modes: {modes}")
        console.print(f"EXIF-rotated: {report.rotated:,}   progressive JPEG: {report.progressive:,}")
        _render_copies(report)
    _render_labels(report.labels)
    if report.problems:
        table = Table(title="problems", title_justify="left")
        table.add_column("kind")
        table.add_column("files", justify="right")
        table.add_column("examples")
        for kind, summary in report.problems.items():
            table.add_row(kind, f"{summary.count:,}", "\n".join(summary.examples))
        console.print(table)
    if report.table is not None:
        _render_table(report.table)
    elif report.skipped:
        console.print(
            f"[dim]{len(report.skipped):,} other files skipped (not image extensions, links, unreadable folders)[/]"
        )
    rec = report.recommendation
    if rec is not None:
        if rec.resize is None:
            console.print(f"[bold]recommendation[/] for training at {rec.train_size}: no pre-resize ({rec.reason})")
        else:
            console.print(
                f"[bold]recommendation[/] for training at {rec.train_size}: [bold green]--resize {rec.resize}[/] "
                f"({rec.reason}). Shrinks {rec.shrink_share:.0%} of images; bytes "
                f"{human_bytes(rec.bytes_before)} -> ~{human_bytes(rec.bytes_after_estimate)}; "
                f"~{rec.decode_work_saved:.0%} less decode work per epoch."
            )


def _render_copies(report: ProbeReport) -> None:
    copies = report.duplicates
    if copies is None:
        return
    links = f"; {copies.links:,} more names of files already counted (links)" if copies.links else ""
    if not copies.files:
        console.print(f"exact duplicates: none{links}")
        return
    files = f"{copies.files:,} files copy" if copies.files != 1 else "1 file copies"
    groups = f"{copies.groups:,} group{'s' if copies.groups != 1 else ''}"
    console.print(
        f"[bold yellow]exact duplicates[/]: {files} another's bytes ({groups}, {human_bytes(copies.bytes)}){links}; "
        "`shardkit duplicates` lists them, `pack --dedup exact` leaves them out"
    )
    for group in copies.examples:
        console.print("  " + " = ".join(escape(name) for name in group[:4]) + (" = ..." if len(group) > 4 else ""))


def _render_table(table: dict[str, Any]) -> None:
    """A metadata table's census: what pack will take, and what it will list in errors.jsonl."""
    console.print(
        f"[bold]{escape(table['name'])}[/]: {table['rows']:,} rows, {table['rows_without_file']:,} without a file, "
        f"{table['bad_rows']:,} unusable, {table['images_without_row']:,} images without a row"
    )
    shown = ", ".join(escape(name) for name in table["columns"][:30])
    console.print(f"columns: {shown}{', ...' if len(table['columns']) > 30 else ''}")
    chars = table["caption_chars"]
    if chars:
        console.print(
            f"captions: {table['captions']:,}, length in characters: min {chars['min']:.0f}, p50 {chars['p50']:.0f}, "
            f"p95 {chars['p95']:.0f}, p99 {chars['p99']:.0f}, max {chars['max']:.0f}"
        )


def _render_percentiles(report: ProbeReport) -> None:
    table = Table(title="distribution (displayed size, after EXIF orientation)", title_justify="left")
    columns = ("min", "p1", "p5", "p25", "p50", "p75", "p95", "p99", "max")
    table.add_column("")
    for column in columns:
        table.add_column(column, justify="right")
    for name, values in report.percentiles.items():
        digits = 2 if name in ("megapixels", "aspect") else 0
        table.add_row(name, *(f"{values[c]:,.{digits}f}" for c in columns))
    console.print(table)


def _render_histogram(report: ProbeReport) -> None:
    table = Table(title="short side", title_justify="left", show_header=False, box=None)
    peak = max(n for _, _, n in report.short_side_histogram)
    for lo, hi, n in report.short_side_histogram:
        label = f"{lo}-{hi - 1}" if hi is not None else f"{lo}+"
        bar = "█" * max(1, round(40 * n / peak))
        table.add_row(label, f"{n:,}", f"[cyan]{bar}[/]")
    console.print(table)


FIELDS = ("path", "bytes", "format", "width", "height", "displayed_width", "displayed_height", "mode", "bits",
          "progressive", "orientation", "error", "warnings")  # fmt: skip


def _rows(relpaths: list[str], rows: list[tuple[Any, ...]]) -> Iterator[list[Any]]:
    """Each file's row, values in FIELDS order; built from the raw rows (no object per file)."""
    from ..packing.sources import display

    for relpath, (size, h, error, warnings, *_) in zip(relpaths, rows, strict=True):
        if h is None:
            yield [
                display(relpath),
                size,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                None,
                error,
                " ".join(warnings),
            ]
            continue
        shown = (h[2], h[1]) if h[6] >= 5 else (h[1], h[2])  # displayed: EXIF quarter turns swap the sides
        yield [display(relpath), size, h[0], h[1], h[2], *shown, h[3], h[4], h[5], h[6], error, " ".join(warnings)]


def _csv_lines(chunk: ProbeChunk, writer: Any) -> Iterator[str]:
    """CSV lines, byte for byte what csv.writer writes: a clean row is formatted here (faster than
    the writer, and every row of a large folder pays it); a row with an error, or a name that needs
    quoting, goes through the writer itself."""
    for relpath, (size, h, error, warnings, *rest) in zip(chunk.relpaths, chunk.rows, strict=True):
        if h is not None and error is None and not warnings and relpath.isascii() and not _NEEDS_QUOTES.search(relpath):
            shown = f"{h[2]},{h[1]}" if h[6] >= 5 else f"{h[1]},{h[2]}"
            yield f"{relpath},{size},{h[0]},{h[1]},{h[2]},{shown},{h[3]},{h[4]},{h[5]},{h[6]},,\r\n"
        else:
            writer.writerows(_rows([relpath], [(size, h, error, warnings, *rest)]))


_NEEDS_QUOTES = re.compile(r'[,"\r\n]|^\s|\s$')


# JSON lines with sorted keys, as json.dumps(row, sort_keys=True) writes them
_SORTED = sorted(range(len(FIELDS)), key=FIELDS.__getitem__)


def _json_line(values: list[Any]) -> str:
    return json.dumps({FIELDS[i]: values[i] for i in _SORTED}) + "\n"


@contextlib.contextmanager
def _records_writer(path: Path | None) -> Iterator[Callable[[ProbeChunk], None] | None]:
    """Writes the per-file rows as probe produces them (nothing of them stays in memory). The file
    is written under a temporary name and renamed at the end: a stopped probe leaves no half list."""
    if path is None:
        yield None
        return
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with temp.open("w", encoding="utf-8", newline="") as out:
            if path.suffix.lower() == ".csv":
                writer = csv.writer(out)
                writer.writerow(FIELDS)

                def write_rows(chunk: ProbeChunk) -> None:
                    out.writelines(_csv_lines(chunk, writer))
            else:

                def write_rows(chunk: ProbeChunk) -> None:
                    out.writelines(map(_json_line, _rows(chunk.relpaths, chunk.rows)))

            yield write_rows
        os.replace(temp, path)
    except OSError as error:
        raise ShardkitError(f"{path}: cannot write ({describe(error)})") from None
    finally:
        temp.unlink(missing_ok=True)

"""`shardkit verify`: prove shards are whole, match their manifest, and decode."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..core.config import DEFAULT_MAX_PIXELS

if TYPE_CHECKING:
    from ..checks.verify_report import VerifyReport

from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    console,
    progress_bar,
    source_path,
    storage_options,
    user_errors,
    write_json_report,
)

MAX_LINES = 50


def verify(
    output: Annotated[str, typer.Argument(help="A shardkit output folder, or its URL (s3://..., https://...).")],
    deep: Annotated[bool, typer.Option(help="Decode every image and check its size against the metadata.")] = False,
    source: Annotated[
        Optional[str],
        typer.Option(help="Check every source file (or a bucket's object) is packed or in errors.jsonl."),
    ] = None,
    workers: Annotated[Optional[int], typer.Option(help="Processes to use. \\[default: one per core]")] = None,
    max_pixels: Annotated[
        int, typer.Option(help="With --deep: refuse to decode images with more pixels (bombs).")
    ] = DEFAULT_MAX_PIXELS,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the report as JSON.")] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
) -> None:
    """Check an output folder; exit code 0 only when everything holds."""
    from ..checks.verify import verify as run_verify  # here: `shardkit --help` need not import it

    with user_errors():
        check_json_path(json_path, output)
        options = storage_options(storage_option)
        with progress_bar(unit="shards") as bar:
            task = bar.add_task("verifying", total=None, rate="")
            report = run_verify(
                output, deep=deep, source=None if source is None else source_path(source), workers=workers,
                max_pixels=max_pixels, storage_options=options,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
        render(report, deep=deep)
        if json_path is not None:
            write_json_report(json_path, report.to_json())
    if not report.ok:
        raise typer.Exit(1)


def render(report: VerifyReport, deep: bool) -> None:
    decoded = f", {report.decoded:,} decoded" if deep else ""
    summary = (
        f"{escape(report.folder)}: {report.format or '?'}, {report.shards:,} shards, "
        f"{report.records:,} records{decoded} in {report.seconds:.2f}s"
    )
    for note in report.notes[:MAX_LINES]:
        console.print(f"note: {escape(note)}", highlight=False)
    if report.ok:
        console.print(f"[bold green]OK[/] {summary}")
        return
    console.print(f"[bold red]FAILED[/] {summary}: {len(report.problems):,} problems")
    table = Table(show_header=True, header_style="bold")
    for column in ("kind", "shard", "key", "detail"):
        table.add_column(column)
    for problem in report.problems[:MAX_LINES]:
        # names and details come from strangers' files: text, never rich markup ("[gcs]" stays)
        table.add_row(
            *(escape(text) for text in (problem.kind, problem.shard or "", problem.key or "", problem.detail))
        )
    console.print(table)
    if len(report.problems) > MAX_LINES:
        console.print(f"... and {len(report.problems) - MAX_LINES:,} more (use --json for all)")

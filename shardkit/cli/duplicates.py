"""`shardkit duplicates`: exact and near duplicates within and across source folders (leakage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..core.config import DEFAULT_DEDUP_THRESHOLD
from ..core.errors import ConfigError
from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    check_report_path,
    console,
    progress_bar,
    storage_options,
    user_errors,
    write_json_report,
)

SHOWN_GROUPS = 10
SHOWN_FAILURES = 5


def duplicates(
    sources: Annotated[
        list[str],
        typer.Argument(help="Image folders (or list files), or packed outputs (folders or URLs): train, val, test..."),
    ],
    against: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Compare with this folder or packed output (repeatable): only groups holding a file of each side "
            "are reported (what of SOURCES is in it)."
        ),
    ] = None,
    near: Annotated[
        bool, typer.Option(help="Also near duplicates: re-encoded, resized, grey, brighter, slightly cropped.")
    ] = False,
    threshold: Annotated[
        Optional[int],
        typer.Option(
            "--dedup-threshold",  # pack's name for the same setting
            help=f"Near: the largest Hamming distance of two DCT hashes (0-32). \\[default: {DEFAULT_DEDUP_THRESHOLD}]",
        ),
    ] = None,
    old_threshold: Annotated[Optional[int], typer.Option("--threshold", hidden=True)] = None,  # its earlier name
    workers: Annotated[Optional[int], typer.Option(help="Processes to use. \\[default: one per core]")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write every group as JSON.")] = None,
    plot: Annotated[
        Optional[Path], typer.Option(help="A contact sheet (.png or .jpg) of the leakage groups, then the largest.")
    ] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
) -> None:
    """Find images that are the same (the same bytes) or, with --near, nearly the same, within and
    across the sources; a group spanning two sources (train and val) is leakage. A packed output's
    records carry their hashes: it is compared without reading or decoding its shards."""
    from ..checks.duplicates import contact_sheet, find_duplicates  # here: --help stays fast

    with user_errors():
        check_json_path(json_path)
        check_report_path(plot, (".png", ".jpg", ".jpeg"), "a contact sheet")
        threshold = threshold if threshold is not None else old_threshold
        if threshold is not None and not near:
            raise ConfigError("--dedup-threshold is for --near")
        with progress_bar(unit="files") as bar:
            task = bar.add_task("hashing", total=None, rate="")
            report = find_duplicates(
                sources, against=against or (), near=near,
                threshold=DEFAULT_DEDUP_THRESHOLD if threshold is None else threshold, workers=workers,
                storage_options=storage_options(storage_option), progress=lambda done: bar.update(task, completed=done),
            )  # fmt: skip
        leaks = [group for group in report.groups if group.leakage]
        how = f"near: DCT hashes within {report.threshold} bits" if report.near else "exact only (--near for more)"
        compared = f" against {report.against}" if report.against else ""
        console.print(
            f"{report.files:,} files in {len(report.sources) - report.against} source(s){compared}, "
            f"{report.seconds:.1f}s; {how}\n"
            f"[bold]{report.count('exact'):,}[/] exact groups (the same bytes), [bold]{report.count('near'):,}[/] near "
            f"groups; [bold red]{len(leaks):,}[/] groups span sources (leakage)",
            highlight=False,
            soft_wrap=True,
        )
        shown = leaks or report.groups
        for group in shown[:SHOWN_GROUPS]:
            tag = " [red]leakage[/]" if group.leakage else ""
            more = f" (+{len(group.files) - 4})" if len(group.files) > 4 else ""
            console.print(
                f"- {group.kind}{tag}: " + escape(", ".join(group.files[:4])) + more, highlight=False, soft_wrap=True
            )
        if len(shown) > SHOWN_GROUPS:
            console.print(f"  and {len(shown) - SHOWN_GROUPS:,} more (every group: --json)", highlight=False)
        if report.failures:
            console.print(
                f"[yellow]{len(report.failures):,} files not hashed[/] (unreadable, undecodable or too small):"
            )
            for failure in report.failures[:SHOWN_FAILURES]:
                console.print(f"- {escape(failure.path)}: {escape(failure.reason)}", highlight=False, soft_wrap=True)
            if len(report.failures) > SHOWN_FAILURES:
                console.print(f"  and {len(report.failures) - SHOWN_FAILURES:,} more (every file: --json)")
        if json_path is not None:
            write_json_report(json_path, report.to_json())
        if plot is not None and report.groups:
            rows = contact_sheet(report, plot)
            console.print(f"contact sheet of {rows} groups: {escape(str(plot))}", highlight=False)

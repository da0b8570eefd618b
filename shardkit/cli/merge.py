"""`shardkit merge`: one output from several packed alike, without decoding or encoding a record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..storage.urls import is_remote
from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    console,
    progress_bar,
    storage_options,
    user_errors,
    write_json_report,
)


def merge(
    outputs: Annotated[list[str], typer.Argument(help="Two or more shardkit outputs, then the folder to make.")],
    prefix_keys: Annotated[
        bool, typer.Option("--prefix-keys", help="Start each output's keys with its folder's name and '/'.")
    ] = False,
    relabel: Annotated[
        bool,
        typer.Option("--relabel", help="Number labels by the merged class list where an output's would differ."),
    ] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Finish a merge that was interrupted.")] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write a summary as JSON.")] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
) -> None:
    """Merge OUT_A OUT_B ... into the new folder OUT (the last argument): their shards one after
    another, hard-linked (copied across file systems), their index rows and errors.jsonl rows
    joined. Outputs in buckets of one store merge into a new prefix there, their shards copied
    server-side (a local output's uploaded); one in a bucket merged into a local folder is
    downloaded first. Outputs packed otherwise, keys two outputs share (see --prefix-keys) and class
    numbers that would change meaning (see --relabel) are refused before any work. Safe to kill:
    --resume finishes."""
    from ..changes.merge import merge as merge_outputs  # here: `shardkit --help` need not import it

    *sources, output = outputs if len(outputs) > 1 else [*outputs, ""]
    with user_errors(on_stop="run the same merge with --resume to finish"):
        if not output:
            from ..core.errors import ConfigError

            raise ConfigError("merge needs two or more outputs to merge, then the folder to make")
        check_json_path(json_path, output)
        with progress_bar(unit="shards") as bar:
            task = bar.add_task("merging", total=None, rate="")
            result = merge_outputs(
                sources, output, prefix_keys=prefix_keys, relabel=relabel, resume=resume,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
                storage_options=storage_options(storage_option),
            )  # fmt: skip
        if result.already_complete:
            console.print(
                f"{escape(result.output)}: already this merge, finished ({result.records:,} records in "
                f"{result.shards:,} shards); nothing to do",
                highlight=False,
            )
            if json_path is not None:
                write_json_report(json_path, result.to_json())
            return
        rewritten = f", {result.rewritten:,} written again" if result.rewritten else ""
        remote = [is_remote(source) for source in result.sources]
        if is_remote(result.output):
            placed = "copied server-side" if all(remote) else "copied server-side or uploaded"
        else:
            placed = "linked or downloaded" if any(remote) else "linked"
        console.print(
            f"[bold green]merged[/] {len(result.sources)} outputs into {escape(result.output)}: {result.records:,} "
            f"records in {result.shards:,} shards ({result.linked:,} {placed}{rewritten}; "
            f"{result.bytes_written / 1e6:,.1f} MB written) in {result.seconds:.1f}s",
            highlight=False,
        )
        if json_path is not None:
            write_json_report(json_path, result.to_json())

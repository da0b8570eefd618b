"""`shardkit compact`: join small shards into full ones without decoding or encoding a record."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    console,
    progress_bar,
    storage_options,
    user_errors,
    write_json_report,
)


def compact(
    output: Annotated[str, typer.Argument(help="A shardkit output folder, or its bucket's URL (s3://bucket/prefix).")],
    shard_size: Annotated[Optional[int], typer.Option(help="Records a shard, at most.")] = None,
    shard_bytes: Annotated[Optional[str], typer.Option(help="Or: bytes a shard, at most, e.g. 256MB.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Finish a compact that was interrupted.")] = False,
    keep_versions: Annotated[
        bool,
        typer.Option(
            "--keep-versions", help="Keep the version before whole in OUT/versions/vN (hard links; a bucket copies it)."
        ),
    ] = False,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write a summary as JSON.")] = None,
) -> None:
    """Join consecutive small shards of OUT (left by removes, or packed small) into shards of at most
    --shard-size records or --shard-bytes bytes: the same records in the same order, byte for byte,
    from fewer shards. Shards that stay alone are kept as they are. Safe to kill at any point: the
    output is at the version before or after, and --resume finishes."""
    from ..changes.compact import compact as compact_shards  # here: `shardkit --help` need not import it

    with user_errors(on_stop=f"run `shardkit compact {output} --resume` to finish"):
        check_json_path(json_path, output)
        with progress_bar(unit="shards") as bar:
            task = bar.add_task("joining", total=None, rate="")
            result = compact_shards(
                output, shard_size=shard_size, shard_bytes=shard_bytes, resume=resume, keep_versions=keep_versions,
                storage_options=storage_options(storage_option),
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
        if not result.joined:
            said = "nothing to finish" if resume else "no two consecutive shards fit the target together"
            console.print(f"{escape(result.output)} unchanged: {said}", highlight=False)
        else:
            console.print(
                f"[bold green]compacted[/] {escape(result.output)}, now version {result.version}: "
                f"{result.shards_before:,} shards into {result.shards_after:,} "
                f"({result.bytes_written / 1e6:,.1f} MB written) in {result.seconds:.1f}s",
                highlight=False,
            )
        if json_path is not None:
            write_json_report(json_path, result.to_json())

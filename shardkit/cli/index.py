"""`shardkit index`: adopt WebDataset tars someone else wrote as a shardkit output."""

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


def index(
    folder: Annotated[str, typer.Argument(help="A folder (or URL: s3://..., gs://...) holding .tar files.")],
    workers: Annotated[Optional[int], typer.Option(help="Processes to use. \\[default: one per core]")] = None,
    overwrite: Annotated[
        bool, typer.Option(help="Index again where a manifest is (only index's own files are replaced).")
    ] = False,
    folder_labels: Annotated[
        bool,
        typer.Option(
            "--folder-labels",
            help="Tars of a class-folder tree (`tar --sort=name -cf x.tar -C train .`) with no .cls members: "
            "each record's class is its key's first folder.",
        ),
    ] = False,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write a summary as JSON.")] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
) -> None:
    """Adopt tars someone else wrote (img2dataset, `tar` of a folder): scan each once and write
    manifest.json, errors.jsonl and the indexes beside them, never touching the tars. Then verify,
    open_shards, the loader and bench work on them."""
    from ..packing.adopt import adopt_tars  # here: `shardkit --help` need not import it

    with user_errors():
        check_json_path(json_path, folder)
        options = storage_options(storage_option)
        with progress_bar(unit="tars") as bar:
            task = bar.add_task("indexing", total=None, rate="")
            result = adopt_tars(
                folder, workers=workers, overwrite=overwrite, folder_labels=folder_labels, storage_options=options,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
        gigabytes = result.bytes / 1e9
        console.print(
            f"[bold green]indexed[/] {escape(result.folder)}: {result.adopted:,} of {result.tars:,} tars, "
            f"{result.records:,} records, {gigabytes:.2f} GB in {result.seconds:.1f}s "
            f"({gigabytes / max(result.seconds, 1e-9):.2f} GB/s)",
            highlight=False,
        )
        members = ", ".join(f".{ext} {count:,}" for ext, count in result.extensions.items())
        if result.other_extensions:
            members += f", and {result.other_extensions['members']:,} of {result.other_extensions['kinds']:,} others"
        console.print(f"members: {escape(members)}", highlight=False)
        if folder_labels:
            console.print(f"labels: {len(result.manifest.classes):,} classes from the keys' folders")
        if result.unnamed_labels is not None:
            console.print(f"labels up to {result.unnamed_labels:,}: too many to name classes; the manifest lists none")
        if result.errors:
            console.print(f"[yellow]{result.errors:,} listed in errors.jsonl[/] (left out, or a key in two tars)")
        if json_path is not None:
            write_json_report(
                json_path,
                {
                    "folder": result.folder, "tars": result.tars, "adopted": result.adopted,
                    "records": result.records, "errors": result.errors, "bytes": result.bytes,
                    "seconds": result.seconds, "extensions": result.extensions,
                },
            )  # fmt: skip

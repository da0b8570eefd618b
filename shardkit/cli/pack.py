"""`shardkit pack`: resize, re-encode and write shards."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from ..core.config import DEFAULT_SHARD_SIZE, PACK_OPTIONS, PackConfig, TableConfig
from ..core.config import pack_config as make_pack_config
from ..formats import available_formats

if TYPE_CHECKING:
    from rich.progress import TaskID

    from ..packing.pack import PackResult

from .common import STORAGE_OPTION_HELP, console, human_bytes, progress_bar, storage_options, user_errors

FormatName = Enum("FormatName", {name: name for name in available_formats()}, type=str)  # type: ignore[misc]


class ResizeMode(str, Enum):
    short = "short"
    long = "long"
    center_crop = "center-crop"


class Encoding(str, Enum):
    jpeg = "jpeg"
    raw = "raw"
    original = "original"


class Dedup(str, Enum):
    none = "none"
    exact = "exact"
    near = "near"


class Executor(str, Enum):
    local = "local"
    ray = "ray"


D = PACK_OPTIONS  # the defaults shown in --help come from the one place they are set


def pack(
    source: Annotated[
        Path,
        typer.Argument(
            help="Image folder (class sub-folders, flat, or with a metadata.jsonl|csv|parquet table) or a list file."
        ),
    ],
    output: Annotated[
        str,
        typer.Argument(help="Output folder for shards, manifest.json and errors.jsonl, or a URL (s3://bucket/prefix)."),
    ],
    format: Annotated[
        Optional[FormatName], typer.Option("--format", "-f", help=f"Shard format. \\[default: {D['format']}]")
    ] = None,
    resize: Annotated[
        Optional[str],
        typer.Option(
            help=f"Target size in pixels, 'auto' (probe's advice) or 'none'. \\[default: {str(D['resize']).lower()}]"
        ),
    ] = None,
    resize_mode: Annotated[
        Optional[ResizeMode], typer.Option(help=f"Which side --resize sets. \\[default: {D['resize_mode']}]")
    ] = None,
    upscale: Annotated[
        Optional[bool], typer.Option("--upscale/--no-upscale", help="Allow enlarging small images.")
    ] = None,
    max_aspect: Annotated[
        Optional[float], typer.Option(help=f"Cap the long side at resize x this. \\[default: {D['max_aspect']:g}]")
    ] = None,
    resample: Annotated[
        Optional[str], typer.Option(help=f"bilinear, bicubic or lanczos. \\[default: {D['resample']}]")
    ] = None,
    quality: Annotated[Optional[int], typer.Option(help=f"JPEG quality 1-100. \\[default: {D['quality']}]")] = None,
    encode: Annotated[
        Optional[Encoding],
        typer.Option(help=f"jpeg, original (keep untouched JPEGs) or raw pixels. \\[default: {D['encode']}]"),
    ] = None,
    shard_size: Annotated[
        Optional[int], typer.Option(help=f"Records per shard. \\[default: {DEFAULT_SHARD_SIZE}, unless --shard-bytes]")
    ] = None,
    shard_bytes: Annotated[Optional[str], typer.Option(help="Or: source bytes per shard, e.g. 256MB.")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Writer processes. \\[default: one per core]")] = None,
    shuffle: Annotated[
        Optional[bool], typer.Option("--shuffle/--no-shuffle", help="Seeded shuffle before sharding.")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help=f"Seed for --shuffle. \\[default: {D['seed']}]")] = None,
    labels: Annotated[Optional[str], typer.Option(help=f"auto, folders or none. \\[default: {D['labels']}]")] = None,
    train_size: Annotated[
        Optional[int], typer.Option(help=f"Training size that --resize auto aims at. \\[default: {D['train_size']}]")
    ] = None,
    max_pixels: Annotated[Optional[int], typer.Option(help="Refuse images with more pixels (bombs).")] = None,
    executor: Annotated[
        Optional[Executor], typer.Option(help=f"local processes or a ray cluster. \\[default: {D['executor']}]")
    ] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster: auto or ray://host:port.")] = None,
    dedup: Annotated[
        Optional[Dedup],
        typer.Option(
            help="Pack the first of each set of copies (in the source's order) and list the others in errors.jsonl: "
            f"exact (the same bytes) or near (re-encoded, resized, grey, brighter...). \\[default: {D['dedup']}]"
        ),
    ] = None,
    dedup_threshold: Annotated[
        Optional[int],
        typer.Option(
            help=f"--dedup near: the largest Hamming distance of two DCT hashes (0-32). "
            f"\\[default: {D['dedup_threshold']}]"
        ),
    ] = None,
    config: Annotated[
        Optional[Path], typer.Option(help="TOML preset file, or a named preset (imagenet-256); flags override it.")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Finish an interrupted pack, reusing complete shards.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier shardkit output in OUTPUT.")] = False,
    metadata: Annotated[
        Optional[Path],
        typer.Option(
            help="A table of samples (CSV, TSV, JSONL or parquet), one row per image. "
            "\\[default: SOURCE/metadata.jsonl|csv|parquet when there is one]"
        ),
    ] = None,
    path_column: Annotated[
        str, typer.Option(help="The table's column holding each image's path, relative to SOURCE.")
    ] = "file_name",
    caption_column: Annotated[
        Optional[str], typer.Option(help="The caption column. \\[default: caption, else text, when present]")
    ] = None,
    label_column: Annotated[Optional[str], typer.Option(help="A column of class names or whole numbers.")] = None,
    sidecars: Annotated[
        bool,
        typer.Option(
            "--sidecars",
            help="Files sharing a name are one sample: x.jpg, x.txt (caption), x.json, x.cls, x.seg.png...",
        ),
    ] = False,
    columns: Annotated[
        Optional[str], typer.Option(help="Keep only these columns (comma-separated). \\[default: all of them]")
    ] = None,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
    staging: Annotated[
        Optional[Path],
        typer.Option(
            help="For an OUTPUT URL: the local folder shards are written to before upload. "
            "\\[default: under ~/.cache/shardkit/staging]"
        ),
    ] = None,
) -> None:
    """Pre-resize, re-encode and pack images into WebDataset, LMDB or HDF5 shards."""
    with user_errors(on_stop="run the same command with --resume to finish"):
        flags = {key: value for key, value in locals().items() if key in PACK_OPTIONS}
        given = {key: (value.value if isinstance(value, Enum) else value) for key, value in flags.items()}
        table = TableConfig(
            path=None if metadata is None else str(metadata), path_column=path_column, caption_column=caption_column,
            label_column=label_column,
            columns=None if columns is None else tuple(name.strip() for name in columns.split(",") if name.strip()),
        )  # fmt: skip
        pack_config = make_pack_config(
            source, output, config, resume=resume, overwrite=overwrite, storage_options=storage_options(storage_option),
            staging=staging, table=table, sidecars=sidecars, **given,
        )  # fmt: skip
        if dedup_threshold is not None and pack_config.dedup != "near":
            raise typer.BadParameter("--dedup-threshold is for --dedup near")
        result = _run(pack_config)
        render(result)


def _run(config: PackConfig) -> PackResult:
    from ..packing.pack import pack as run_pack  # here: `shardkit --help` need not import imaging

    with progress_bar(unit="images") as bar:
        task = bar.add_task("packing", total=None, rate="")
        started = [time.perf_counter()]
        hashing: list[TaskID] = []

        def advance(done: int, total: int | None, errors: int) -> None:
            if hashing:  # the hashing is over: the pack's own rate starts now
                bar.remove_task(hashing.pop())
                started[0] = time.perf_counter()
            rate = done / max(time.perf_counter() - started[0], 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} img/s, {errors:,} errors")

        def hashed(done: int, total: int) -> None:
            if not hashing:
                hashing.append(bar.add_task("dedup: hashing", total=total, rate=""))
            rate = done / max(time.perf_counter() - started[0], 1e-9)
            bar.update(hashing[0], completed=done, rate=f"{rate:,.0f} files/s")

        return run_pack(config, progress=advance, dedup_progress=hashed)


def render(result: PackResult) -> None:
    if result.already_complete:
        console.print(
            f"{result.output}: already complete ({result.shards:,} {result.manifest.format} shards, "
            f"{result.records:,} of {result.inputs:,} inputs packed, every shard intact); nothing to do",
            soft_wrap=True,
        )
        return
    table = Table(title=f"packed into {result.output}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("images packed", f"{result.records:,} of {result.inputs:,} inputs")
    table.add_row("errors (errors.jsonl)", f"{result.errors:,}")
    if result.duplicates:
        table.add_row("  of which duplicates", f"{result.duplicates:,} (left out by --dedup)")
    reused = f" ({result.reused_shards} reused from the earlier run)" if result.reused_shards else ""
    table.add_row("shards", f"{result.shards:,} {result.manifest.format}{reused}")
    if result.nodes > 1:
        table.add_row("nodes", f"{result.nodes} (Ray)")
    table.add_row("resize", f"{result.resize or 'none'}")
    table.add_row("bytes in -> out", f"{human_bytes(result.input_bytes)} -> {human_bytes(result.output_bytes)}")
    table.add_row("time", f"{result.seconds:.2f}s ({result.images_per_second:,.0f} images/s)")
    busy = sum(result.stage_seconds.values())
    if busy:
        split = "  ".join(f"{stage} {seconds / busy:.0%}" for stage, seconds in result.stage_seconds.items())
        table.add_row("worker time split", split)
    console.print(table)

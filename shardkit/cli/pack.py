"""`shardkit pack`: resize, re-encode and write shards."""

from __future__ import annotations

import inspect
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..core.config import PackConfig, TableConfig
from ..core.errors import ConfigError, ShardkitError
from ..core.pack_options import PACK_OPTION_TABLE, PackOption
from ..core.pack_options import pack_config as make_pack_config
from ..formats import available_formats

if TYPE_CHECKING:
    from rich.progress import TaskID

    from ..changes.append import AppendResult
    from ..packing.pack import PackResult

from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    console,
    human_bytes,
    progress_bar,
    source_path,
    storage_options,
    user_errors,
    write_json_report,
)


def _choice(name: str, choices: tuple[str, ...] | list[str]) -> Any:
    return Enum(name, {choice: choice for choice in choices}, type=str)


def _flag(option: PackOption) -> inspect.Parameter:
    """The CLI parameter of one pack option, from its row in PACK_OPTION_TABLE (None: not given, so
    a preset or the dataclass's default applies)."""
    choices = available_formats() if option.name == "format" else option.choices
    kind: Any = option.types[0] if isinstance(option.types, tuple) else option.types
    if choices is not None:  # typer offers an Enum's values as the choices
        kind = _choice(option.name.title().replace("_", ""), choices)
    shown = str(option.default) if option.default_help is None else option.default_help
    text = f"{option.help} \\[default: {shown}]" if shown else option.help
    flag = typer.Option(*option.flags, help=text)
    return inspect.Parameter(
        option.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[Optional[kind], flag]
    )


def pack(
    source: Annotated[
        str,
        typer.Argument(
            help="Image folder (class sub-folders, flat, or with a metadata.jsonl|csv|parquet table), a list file, "
            "or a bucket's prefix (s3://bucket/prefix) laid out as a folder."
        ),
    ],
    output: Annotated[
        str,
        typer.Argument(help="Output folder for shards, manifest.json and errors.jsonl, or a URL (s3://bucket/prefix)."),
    ],
    *,
    config: Annotated[
        Optional[Path], typer.Option(help="TOML preset file, or a named preset (imagenet-256); flags override it.")
    ] = None,
    resume: Annotated[bool, typer.Option(help="Finish an interrupted pack, reusing complete shards.")] = False,
    append: Annotated[
        bool,
        typer.Option(
            help="Add SOURCE's new inputs to the packed OUTPUT as new shards, with its settings; "
            "what it holds already is skipped."
        ),
    ] = False,
    key_prefix: Annotated[
        Optional[str], typer.Option(help="With --append: a prefix for the new keys (e.g. 2026-11/).")
    ] = None,
    keep_versions: Annotated[
        bool,
        typer.Option("--keep-versions", help="With --append: keep the version before whole in OUTPUT/versions/vN."),
    ] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier shardkit output in OUTPUT.")] = False,
    metadata: Annotated[
        Optional[str],
        typer.Option(
            help="A table of samples (CSV, TSV, JSONL or parquet), one row per image. "
            "\\[default: SOURCE/metadata.jsonl|csv|parquet when there is one]"
        ),
    ] = None,
    path_column: Annotated[
        str, typer.Option(help="The table's column holding each image's path, relative to SOURCE.")
    ] = "file_name",
    caption_column: Annotated[
        Optional[str],
        typer.Option(help="The caption column. \\[default: caption, else captions, else text, when present]"),
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
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write the summary as JSON.")] = None,
    **flags: Any,  # one per row of PACK_OPTION_TABLE: the signature below names them for typer
) -> None:
    """Pre-resize, re-encode and pack images into WebDataset, LMDB or HDF5 shards."""
    with user_errors(on_stop="run the same command with --resume to finish"):
        given = {key: (value.value if isinstance(value, Enum) else value) for key, value in flags.items()}
        table = TableConfig(
            path=None if metadata is None else source_path(metadata), path_column=path_column,
            caption_column=caption_column, label_column=label_column,
            columns=None if columns is None else tuple(name.strip() for name in columns.split(",") if name.strip()),
        )  # fmt: skip
        pack_config = make_pack_config(
            source_path(source), output, config, resume=resume, overwrite=overwrite,
            storage_options=storage_options(storage_option), staging=staging, table=table, sidecars=sidecars, **given,
        )  # fmt: skip
        if given.get("dedup_threshold") is not None and pack_config.dedup != "near":
            raise ConfigError("--dedup-threshold is for --dedup near")
        check_json_path(json_path, output)
        if key_prefix is not None and not append:
            raise ConfigError("--key-prefix is for --append")
        if keep_versions and not append:
            raise ConfigError("--keep-versions is for --append (and remove, compact)")
        if append:
            if config is not None:
                raise ConfigError("--append packs with the output's own settings: leave --config out")
            if overwrite:
                raise ConfigError("--append adds to the output: --overwrite would replace it (give one of them)")
            appended = _run_append(
                source_path(source), output, key_prefix or "", keep_versions=keep_versions, table=table,
                sidecars=sidecars, storage_options=storage_options(storage_option), resume=resume, staging=staging,
                **given,
            )  # fmt: skip
            render_append(appended)
            if json_path is not None:
                write_json_report(json_path, appended.to_json())
            return
        result = _run(pack_config)
        render(result)
        if json_path is not None:
            write_json_report(json_path, result.to_json())
        if result.records == 0 and result.inputs > 0:  # (an output to read, but nothing to train on)
            nothing = f"{result.output}: none of the {result.inputs:,} inputs was packed"
            raise ShardkitError(nothing + _first_error(result))


def _first_error(result: PackResult) -> str:
    """The first row of a local output's errors.jsonl, as `; the first: PATH: REASON` (or nothing)."""
    from ..core.manifest import ERRORS_NAME, error_lines

    try:
        with open(Path(result.output) / ERRORS_NAME, "rb") as log:
            row = next(error_lines(log, ERRORS_NAME, most=1), None)
    except (OSError, ShardkitError):  # (a bucket's output, or a log that is not one: the count says enough)
        return ""
    if row is None:
        return ""
    return f"; the first: {row.get('path', '?')}: {row.get('reason', '?')} (each is in {ERRORS_NAME})"


def _signature() -> inspect.Signature:
    """pack's parameters as typer reads them: SOURCE and OUTPUT, the table's options in its order,
    then the command's own."""
    written = list(inspect.signature(pack, eval_str=True).parameters.values())
    own = [parameter for parameter in written if parameter.kind != inspect.Parameter.VAR_KEYWORD]
    return inspect.Signature([*own[:2], *(_flag(option) for option in PACK_OPTION_TABLE), *own[2:]])


pack.__signature__ = _signature()  # type: ignore[attr-defined]


def _run(config: PackConfig) -> PackResult:
    from ..packing.pack import Tally
    from ..packing.pack import pack as run_pack  # here: `shardkit --help` need not import imaging

    with progress_bar(unit="images") as bar:
        task = bar.add_task("packing", total=None, rate="")
        started = [time.perf_counter()]
        hashing: list[TaskID] = []
        tally = Tally()

        def advance(done: int, total: int | None, errors: int) -> None:
            if hashing:  # the hashing is over: the pack's own rate starts now
                bar.remove_task(hashing.pop())
                started[0] = time.perf_counter()
            seconds = max(time.perf_counter() - started[0], 1e-9)
            rate = f"{done / seconds:,.0f} img/s, {errors:,} errors"
            if tally.causes or tally.input_bytes:  # a table of URLs: what the downloads do
                ok = (done - errors) / done if done else 1.0
                top = ", ".join(f"{cause} {count:,}" for cause, count in tally.top())
                rate += f", {ok:.1%} ok, {tally.input_bytes / seconds / 1e6:,.1f} MB/s" + (f" ({top})" if top else "")
                rate += f", {tally.waiting:,} waiting to retry" if tally.waiting else ""
            bar.update(task, completed=done, total=total, rate=rate)

        def hashed(done: int, total: int) -> None:
            if not hashing:
                hashing.append(bar.add_task("dedup: hashing", total=total, rate=""))
            rate = done / max(time.perf_counter() - started[0], 1e-9)
            bar.update(hashing[0], completed=done, rate=f"{rate:,.0f} files/s")

        return run_pack(config, progress=advance, dedup_progress=hashed, tally=tally)


def _run_append(source: str, output: str, key_prefix: str, **options: Any) -> AppendResult:
    from ..changes.append import append

    with progress_bar(unit="images") as bar:
        task = bar.add_task("appending", total=None, rate="")
        started = time.perf_counter()

        def advance(done: int, total: int | None, errors: int) -> None:
            rate = f"{done / max(time.perf_counter() - started, 1e-9):,.0f} img/s, {errors:,} errors"
            bar.update(task, completed=done, total=total, rate=rate)

        return append(source, output, key_prefix=key_prefix, progress=advance, **options)


def render_append(result: AppendResult) -> None:
    from ..packing.sources.labelling import class_names

    if result.inputs == 0:
        gone = f", {result.taken_down:,} removed from it earlier" if result.taken_down else ""
        console.print(
            f"{escape(result.output)}: nothing new in {escape(result.source)} ({result.already:,} "
            f"input{'s' if result.already != 1 else ''} in the output already{gone}); still version {result.version}",
            soft_wrap=True, highlight=False,
        )  # fmt: skip
        return
    table = Table(title=f"appended to {escape(result.output)}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    table.add_row("version", f"{result.version}" + (" (an interrupted append finished)" if result.resumed else ""))
    if result.clips:
        table.add_row("clips packed", f"{result.records:,} from {result.inputs:,} new inputs")
    else:
        table.add_row("images packed", f"{result.records:,} of {result.inputs:,} new inputs")
    table.add_row("errors (errors.jsonl)", f"{result.errors:,}")
    table.add_row("already in the output", f"{result.already:,} (skipped)")
    if result.taken_down:
        table.add_row("removed earlier", f"{result.taken_down:,} (left out: `shardkit remove` took them out)")
    reused = f" ({result.reused_shards} reused from the earlier run)" if result.reused_shards else ""
    table.add_row("shards added", f"{result.shards:,}{reused}")
    if result.classes_added:
        table.add_row("classes added", escape(class_names(result.classes_added)))
    table.add_row("bytes written", f"{human_bytes(result.bytes_written)} of {human_bytes(result.output_bytes)}")
    table.add_row("time", f"{result.seconds:.2f}s")
    console.print(table)


def render(result: PackResult) -> None:
    if result.already_complete:
        console.print(
            f"{result.output}: already complete ({result.shards:,} {result.manifest.format} shards, "
            f"{result.records:,} of {result.inputs:,} inputs packed, every shard intact); nothing to do",
            soft_wrap=True,
        )
        _render_warnings(result.warnings)
        return
    table = Table(title=f"packed into {result.output}", title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    videos = result.manifest.totals.get("videos")
    if videos is not None:  # a pack of videos: a record is a clip
        table.add_row("clips packed", f"{result.records:,} from {videos:,} of {result.inputs:,} inputs")
    else:
        table.add_row("images packed", f"{result.records:,} of {result.inputs:,} inputs")
    table.add_row("errors (errors.jsonl)", f"{result.errors:,}")
    if result.labels is not None:
        table.add_row("labels", escape(result.labels.said))
    if result.duplicates:
        table.add_row("  of which duplicates", f"{result.duplicates:,} (left out by --dedup)")
    causes = {key: count for key, count in result.manifest.totals.items() if key.startswith("download:")}
    if causes:  # a table of URLs: the failed downloads per cause, most first
        shown = ", ".join(f"{key.removeprefix('download:')} {count:,}" for key, count in list(causes.items())[:6])
        table.add_row("  of which downloads", f"{sum(causes.values()):,} ({shown})")
    transient = result.manifest.totals.get("transient", 0)
    if transient:
        table.add_row("  of which transient", f"{transient:,}: pack again with --resume to try them again")
    reused = f" ({result.reused_shards} reused from the earlier run)" if result.reused_shards else ""
    table.add_row("shards", f"{result.shards:,} {result.manifest.format}{reused}")
    if result.nodes > 1:
        table.add_row("nodes", f"{result.nodes} (Ray)")
    table.add_row("resize", f"{result.resize or 'none'}")
    totals = result.manifest.totals
    if totals.get("alpha_flattened"):
        background = ",".join(map(str, result.manifest.settings.get("encode", {}).get("background", ())))
        table.add_row("transparency", f"{_images(totals['alpha_flattened'])} flattened onto {background}")
    if totals.get("single_colour"):
        table.add_row("single colour", f"{_images(totals['single_colour'])} (every pixel alike)")
    table.add_row("bytes in -> out", f"{human_bytes(result.input_bytes)} -> {human_bytes(result.output_bytes)}")
    unit = "clips" if "videos" in result.manifest.totals else "images"
    table.add_row("time", f"{result.seconds:.2f}s ({result.images_per_second:,.0f} {unit}/s)")
    busy = sum(result.stage_seconds.values())
    if busy:
        split = "  ".join(f"{stage} {seconds / busy:.0%}" for stage, seconds in result.stage_seconds.items())
        table.add_row("worker time split", split)
    console.print(table)
    _render_warnings(result.warnings)


def _images(count: int) -> str:
    return f"{count:,} image{'s' if count != 1 else ''}"


def _render_warnings(warnings: list[str]) -> None:
    for warning in warnings:
        console.print(f"[yellow]warning:[/] {escape(warning)}", soft_wrap=True)

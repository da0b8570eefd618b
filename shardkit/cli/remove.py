"""`shardkit remove`: take records out of a finished output (a takedown) without packing it again."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from ..core.config import DEFAULT_DEDUP_THRESHOLD
from ..core.errors import ConfigError, describe
from .common import (
    STORAGE_OPTION_HELP,
    check_json_path,
    console,
    progress_bar,
    storage_options,
    user_errors,
    write_json_report,
)

MAX_KEYS_FILE = 1 << 30  # a list of keys larger than this is not a takedown list


def remove(
    output: Annotated[str, typer.Argument(help="A shardkit output folder, or its bucket's URL (s3://bucket/prefix).")],
    keys: Annotated[
        Optional[Path],
        typer.Option(help="A file of the keys to take out, one a line (index.parquet's `key`); - reads stdin."),
    ] = None,
    where: Annotated[
        Optional[str],
        typer.Option(
            help="Or: a condition over index.parquet's columns, e.g. \"source startswith 'artist-118/'\" "
            'or "label == 3 and width < 64" (==, !=, <, <=, >, >=, in (...), startswith, endswith, '
            "contains, is null; and, or, not)."
        ),
    ] = None,
    like: Annotated[
        Optional[list[Path]],
        typer.Option(
            help="Or: a picture (a file, or a folder of them; the flag may repeat) whose records go: those packed "
            "from the same bytes, and with --near its near copies."
        ),
    ] = None,
    near: Annotated[
        bool, typer.Option("--near", help="With --like: also records of the picture resized, re-encoded, saved again.")
    ] = False,
    threshold: Annotated[
        int, typer.Option("--dedup-threshold", help="With --near: how many bits of the DCT hash may differ.")
    ] = DEFAULT_DEDUP_THRESHOLD,
    reason: Annotated[
        str, typer.Option(help="Why (a takedown request, its ticket): kept in the manifest and errors.jsonl.")
    ] = "",
    missing_ok: Annotated[
        bool, typer.Option("--missing-ok", help="Go on when some keys are not in the output (counted, not removed).")
    ] = False,
    resume: Annotated[bool, typer.Option("--resume", help="Finish a remove that was interrupted.")] = False,
    keep_versions: Annotated[
        bool,
        typer.Option(
            "--keep-versions",
            help=(
                "Keep the version before whole in OUT/versions/vN (hard links; a bucket copies it): "
                "the removed records stay there."
            ),
        ),
    ] = False,
    storage_option: Annotated[Optional[list[str]], typer.Option(help=STORAGE_OPTION_HELP)] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Write a summary as JSON.")] = None,
) -> None:
    """Take records out of OUT: the shards holding them are written again without them and the old
    ones deleted (their bytes are in no file afterwards, unless --keep-versions); every other shard
    stays byte for byte. The records go by key (--keys), by a condition (--where), or by content
    (--like: those packed from a picture, with --near its near copies). The manifest's history and
    errors.jsonl say what was removed and why. Safe to kill at any point: the output is at the
    version before or after, and --resume finishes."""
    from ..changes.remove import remove as remove_records  # here: `shardkit --help` need not import it

    with user_errors(on_stop=f"run `shardkit remove {output} --resume` to finish"):
        check_json_path(json_path, output)
        if sum(asked is not None for asked in (keys, where, like)) > 1:
            raise ConfigError("remove takes one of --keys, --where and --like")
        if near and like is None:
            raise ConfigError("--near finds near copies of the pictures --like names; give --like")
        wanted = None if keys is None else _read_keys(keys)
        condition = None
        if where is not None:
            from ..readers.where import parse_where

            condition = parse_where(where)
        with progress_bar(unit="shards") as bar:
            task = bar.add_task("rewriting", total=None, rate="")
            result = remove_records(
                output, wanted, where=condition, reason=reason, missing_ok=missing_ok, resume=resume,
                keep_versions=keep_versions, like=like, near=near, threshold=threshold,
                storage_options=storage_options(storage_option),
                progress=lambda done, total: bar.update(task, completed=done, total=total),
            )  # fmt: skip
        if resume and not result.removed:
            console.print(f"no interrupted remove in {escape(result.output)}: nothing to finish", highlight=False)
        elif not result.removed:
            said = "no record meets the condition" if where is not None else "none of the keys is in it"
            said = "none of the pictures is in it" if like is not None else said
            console.print(f"nothing removed from {escape(result.output)}: {said}", highlight=False)
        else:
            megabytes = result.bytes_written / 1e6
            console.print(
                f"[bold green]removed[/] {_count(result.removed, 'record')} from {escape(result.output)}, now version "
                f"{result.version}: {_count(result.rewritten, 'shard')} written again ({megabytes:,.1f} MB of "
                f"{result.output_bytes / 1e6:,.1f} MB), {result.dropped:,} deleted, in {result.seconds:.1f}s",
                highlight=False,
            )
        if result.missing:
            missing = _count(result.missing, "picture" if like is not None else "key")
            console.print(f"[yellow]{missing} not in the output[/] (nothing to remove for them)")
        if json_path is not None:
            write_json_report(json_path, result.to_json())


def _count(number: int, thing: str) -> str:
    return f"{number:,} {thing}{'' if number == 1 else 's'}"


def _read_keys(path: Path) -> list[str]:
    """The keys of a file (or stdin for -), one a line; blank lines are skipped."""
    import sys

    try:
        if str(path) == "-":
            text = sys.stdin.read(MAX_KEYS_FILE + 1)
        else:
            with open(path, encoding="utf-8") as lines:
                text = lines.read(MAX_KEYS_FILE + 1)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read the keys ({describe(error)})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: the keys are not UTF-8 text") from None
    if len(text) > MAX_KEYS_FILE:
        raise ConfigError(f"{path}: over {MAX_KEYS_FILE >> 20:,} MiB of keys")
    text = text.removeprefix("\ufeff")  # (a byte order mark, as some editors save UTF-8)
    keys = [line.rstrip("\r") for line in text.split("\n") if line.strip()]  # (a key may hold spaces)
    if not keys:
        raise ConfigError(f"{path}: holds no keys")
    return keys

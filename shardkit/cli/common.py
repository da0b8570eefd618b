"""What every command shares: consoles, turning library errors into one line, presets and flags."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..config import load_preset
from ..errors import ShardkitError

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Library errors become one red line and exit code 1; Ctrl-C exits 130 without a traceback."""
    try:
        yield
    except ShardkitError as error:
        err_console.print(f"[bold red]error:[/] {_escape(str(error))}", soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        raise typer.Exit(130) from None


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def merged(flags: dict[str, Any], config: Path | None, defaults: dict[str, Any]) -> dict[str, Any]:
    """Flags given on the command line win over the preset file, which wins over the defaults."""
    preset = load_preset(config) if config is not None else {}
    values = dict(defaults)
    values.update({key: value for key, value in preset.items() if key in defaults})
    values.update({key: value for key, value in flags.items() if value is not None})
    return values


def progress_bar(label: str, unit: str = "files") -> Progress:
    """A live bar on a terminal; on a pipe or in CI it stays silent (disable=True)."""
    return Progress(
        TextColumn(f"[bold]{label}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"{unit}"),
        TextColumn("[cyan]{task.fields[rate]}[/]"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )


def write_report(path: Path, text: str, encoding: str = "utf-8") -> None:
    try:
        path.write_text(text, encoding=encoding)
    except OSError as error:
        raise ShardkitError(f"{path}: cannot write ({error.strerror or error})") from None


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"

"""What every command shares: consoles, turning library errors into one line, presets and flags."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..core.errors import ConfigError, ShardkitError, StoreUnreachable, describe
from ..runtime.processes import quiet_unretrieved_task_errors
from ..runtime.stops import Stopped, arm_stops, exit_on_stop, raise_swallowed_stop, stopped_by

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


@contextlib.contextmanager
def user_errors(on_stop: str = "") -> Iterator[None]:
    """Library errors become one red line and exit code 1; a store out of reach (StoreUnreachable)
    says `on_stop` too, since the work carries on as after a stop once the store answers. Ctrl-C
    exits 130, SIGTERM 143 and SIGHUP 129, the same way (workers stopped, no traceback); `on_stop`
    says how to carry on. The stop handlers stay until the process ends: once the work is over (the
    block left, by any way), a signal ends the process at once with its code.

    A stop signal is handled at every instant, here too: one that lands while the handlers are
    being armed, or after the work but before `exit_on_stop`, still raises Stopped, and the outer
    handler turns it into the exit code (left to click, it would be "Aborted." and exit code 1)."""
    try:
        try:
            arm_stops()
            quiet_unretrieved_task_errors()
            yield
            raise_swallowed_stop()  # (a stop whose Stopped a weakref callback swallowed is still a stop)
        finally:
            exit_on_stop()  # from here on a stop signal exits at once: the handlers below run whole
            console.stderr = False  # (`--json -` gave stdout to the JSON for this command only)
    except Exception as error:
        signum = stopped_by()
        if signum is not None:  # a failure after a stop signal (a worker or pipe it killed) is the stop
            _stopped(signum, on_stop)
        if not isinstance(error, ShardkitError):
            raise  # a bug: the traceback is wanted
        said = str(error)
        if isinstance(error, StoreUnreachable) and on_stop:
            said += f"; once the store answers, {on_stop}"
        err_console.print(f"[bold red]error:[/] {_escape(said)}", soft_wrap=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt as stopped:
        # A library may catch our Stopped and raise a plain KeyboardInterrupt in its place (Ray's
        # waits do, and a SIGTERM would then read as Ctrl-C, exit 130): the signal that came is
        # the one to exit with.
        _stopped(stopped.signum if isinstance(stopped, Stopped) else stopped_by() or signal.SIGINT, on_stop)


def _stopped(signum: int, on_stop: str) -> NoReturn:
    what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    err_console.print(f"[yellow]{what}[/]{f'; {on_stop}' if on_stop else ''}")
    raise typer.Exit(128 + signum) from None


def check_json_path(path: Path | None, output: str | None = None) -> None:
    """A --json path, checked before any work: `-` is standard output, which then holds the JSON
    alone (the summary goes to stderr, so `| jq` reads it); a file inside the output folder a
    command writes is refused, since it would be a stray file in that folder."""
    if path is None:
        return
    if str(path) == "-":
        console.stderr = True
        return
    from ..storage.urls import is_remote

    if output is not None and not is_remote(output):
        inside = path.absolute().resolve().is_relative_to(Path(output).absolute().resolve())
        if inside:
            raise ConfigError(f"{path}: inside the output folder {output}; write the report beside it")
    check_report_path(path)


def check_report_path(path: Path | None, suffixes: tuple[str, ...] = (), what: str = "the file") -> None:
    """Refuse, before any work, a report path that could not be written once the work is done."""
    if path is None:
        return
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder; give a file name")
    if not path.absolute().parent.is_dir():
        raise ConfigError(f"{path}: its folder does not exist")
    if not os.access(path.absolute().parent, os.W_OK):
        raise ConfigError(f"{path}: its folder is not writable")
    if suffixes and path.suffix.lower() not in suffixes:
        names = ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
        raise ConfigError(f"{path}: {what} must be {names}")


def check_plot_path(path: Path | None) -> None:
    """A --plot file: a format matplotlib writes, and matplotlib installed (checked before the work)."""
    if path is None:
        return
    from ..checks.plots import plot_formats

    check_report_path(path, plot_formats(), what="a plot")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def progress_bar(unit: str = "files") -> Progress:
    """Live bars on a terminal, each labelled by its task's description (a command's second stage,
    such as pack's hashing, shows as its own line); on a pipe or in CI it stays silent."""
    return Progress(
        TextColumn("[bold]{task.description}[/]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(f"{unit}"),
        TextColumn("[cyan]{task.fields[rate]}[/]"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    )


def rated(bar: Progress, description: str) -> Callable[[int, int | None], None]:
    """A task on `bar` and its progress callback, which shows the rate since the task began."""
    task = bar.add_task(description, total=None, rate="")
    started = time.perf_counter()

    def advance(done: int, total: int | None) -> None:
        rate = done / max(time.perf_counter() - started, 1e-9)
        bar.update(task, completed=done, total=total, rate=f"{rate:,.0f}/s")

    return advance


def write_json_report(path: Path, data: Any) -> None:
    """A JSON report: sorted keys, and never NaN or infinity (JSON has neither): those become null."""
    text = json.dumps(_finite(data), indent=2, sort_keys=True, allow_nan=False) + "\n"
    if str(path) == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as error:
        raise ShardkitError(f"{path}: cannot write ({describe(error)})") from None


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


STORAGE_OPTION_HELP = (
    "For s3://, gs://, https://... paths: an fsspec option as key=value (JSON values; dotted keys nest, "
    "e.g. client_kwargs.region_name=eu-west-1). Repeatable. Credentials otherwise come the standard way "
    "(AWS_* variables, AWS_ENDPOINT_URL, profiles)."
)


def source_path(text: str) -> str:
    """A source as given: a URL kept whole (a Path would fold its '//'), a local path normalized as
    a Path argument normalizes it (`dir/` is `dir`)."""
    from ..storage.urls import is_remote

    return text if is_remote(text) else str(Path(text))


def storage_options(pairs: list[str] | None) -> dict[str, Any] | None:
    """--storage-option pairs as fsspec keywords (None when there are none)."""
    if not pairs:
        return None
    from ..storage.urls import parse_storage_options

    return parse_storage_options(pairs)

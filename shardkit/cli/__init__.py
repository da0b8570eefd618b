"""The `shardkit` command: a thin typer shell over the library."""

from __future__ import annotations

from typing import Annotated

import typer

from ..core.version import __version__
from .bench import bench
from .common import console
from .compact import compact
from .doctor import doctor
from .duplicates import duplicates
from .index import index
from .merge import merge
from .pack import pack
from .probe import probe
from .remove import remove
from .verify import verify

app = typer.Typer(
    name="shardkit",
    help="Pack images into fast training shards: probe, pack, verify, bench, index, duplicates; "
    "remove, compact, merge.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        console.print(f"shardkit {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Pack image folders into fast training shards: probe, pack, verify, bench."""


app.command()(probe)
app.command()(pack)
app.command()(verify)
app.command()(index)
app.command()(bench)
app.command()(duplicates)
app.command()(remove)
app.command()(compact)
app.command()(merge)
app.command()(doctor)

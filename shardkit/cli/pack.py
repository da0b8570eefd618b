"""`shardkit pack`: resize, re-encode and write shards."""

from __future__ import annotations

import re
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table

from ..config import DEFAULT_MAX_PIXELS, EncodeConfig, PackConfig, ResizeConfig, parse_bytes
from ..errors import ConfigError
from ..formats import available_formats

if TYPE_CHECKING:
    from ..pack import PackResult

from .common import console, human_bytes, merged, progress_bar, user_errors

FormatName = Enum("FormatName", {name: name for name in available_formats()}, type=str)  # type: ignore[misc]


class ResizeMode(str, Enum):
    short = "short"
    long = "long"
    center_crop = "center-crop"


class Encoding(str, Enum):
    jpeg = "jpeg"
    raw = "raw"
    original = "original"


class Executor(str, Enum):
    local = "local"
    ray = "ray"


DEFAULTS = {
    "format": "webdataset", "resize": "none", "resize_mode": "short", "upscale": False, "max_aspect": 4.0,
    "resample": "bicubic", "quality": 90, "encode": "jpeg", "shard_size": None, "shard_bytes": None,
    "workers": None, "shuffle": False, "seed": 0, "labels": "auto", "train_size": 224,
    "max_pixels": DEFAULT_MAX_PIXELS, "executor": "local", "ray_address": None,
}  # fmt: skip


def pack(
    source: Annotated[Path, typer.Argument(help="Image folder (class sub-folders or flat) or a list file.")],
    output: Annotated[Path, typer.Argument(help="Output folder for shards, manifest.json and errors.jsonl.")],
    format: Annotated[
        Optional[FormatName], typer.Option("--format", "-f", help="Shard format. [default: webdataset]")
    ] = None,
    resize: Annotated[
        Optional[str], typer.Option(help="Target size in pixels, 'auto' (probe's advice) or 'none'. [default: none]")
    ] = None,
    resize_mode: Annotated[
        Optional[ResizeMode], typer.Option(help="Which side --resize sets. [default: short]")
    ] = None,
    upscale: Annotated[
        Optional[bool], typer.Option("--upscale/--no-upscale", help="Allow enlarging small images.")
    ] = None,
    max_aspect: Annotated[
        Optional[float], typer.Option(help="Cap the long side at resize x this. [default: 4]")
    ] = None,
    resample: Annotated[Optional[str], typer.Option(help="bilinear, bicubic or lanczos. [default: bicubic]")] = None,
    quality: Annotated[Optional[int], typer.Option(help="JPEG quality 1-100. [default: 90]")] = None,
    encode: Annotated[
        Optional[Encoding], typer.Option(help="jpeg, original (keep untouched JPEGs) or raw pixels. [default: jpeg]")
    ] = None,
    shard_size: Annotated[Optional[int], typer.Option(help="Records per shard. [default: 1000]")] = None,
    shard_bytes: Annotated[Optional[str], typer.Option(help="Or: source bytes per shard, e.g. 256MB.")] = None,
    workers: Annotated[Optional[int], typer.Option(help="Writer processes. [default: one per core]")] = None,
    shuffle: Annotated[
        Optional[bool], typer.Option("--shuffle/--no-shuffle", help="Seeded shuffle before sharding.")
    ] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed for --shuffle. [default: 0]")] = None,
    labels: Annotated[Optional[str], typer.Option(help="auto, folders or none. [default: auto]")] = None,
    train_size: Annotated[
        Optional[int], typer.Option(help="Training size that --resize auto aims at. [default: 224]")
    ] = None,
    max_pixels: Annotated[Optional[int], typer.Option(help="Refuse images with more pixels (bombs).")] = None,
    executor: Annotated[
        Optional[Executor], typer.Option(help="local processes or a ray cluster. [default: local]")
    ] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster: auto or ray://host:port.")] = None,
    config: Annotated[Optional[Path], typer.Option(help="TOML preset; flags override it.")] = None,
    resume: Annotated[bool, typer.Option(help="Finish an interrupted pack, reusing complete shards.")] = False,
    overwrite: Annotated[bool, typer.Option(help="Replace an earlier shardkit output in OUTPUT.")] = False,
) -> None:
    """Pre-resize, re-encode and pack images into WebDataset, LMDB or HDF5 shards."""
    with user_errors(on_stop="run the same command with --resume to finish"):
        flags = {key: value for key, value in locals().items() if key in DEFAULTS}
        values = merged({k: (v.value if isinstance(v, Enum) else v) for k, v in flags.items()}, config, DEFAULTS)
        pack_config, auto = build_config(source, output, values, resume=resume, overwrite=overwrite)
        result = _run(pack_config, auto, values["train_size"])
        render(result)


def build_config(source: Path, output: Path, values: dict, *, resume: bool, overwrite: bool) -> tuple[PackConfig, bool]:
    """Flags and preset values to a validated PackConfig; refuses bad values before any work."""
    size_text = str(values["resize"]).strip().lower()
    auto = size_text == "auto"
    if auto or size_text in ("none", "0", ""):
        size = None
    elif re.fullmatch(r"[0-9]+", size_text):
        size = int(size_text)
    else:
        raise ConfigError(f"--resize takes a number of pixels, 'auto' or 'none', not {values['resize']!r}")
    shard_bytes = parse_bytes(values["shard_bytes"]) if values["shard_bytes"] is not None else None
    shard_size = values["shard_size"] if values["shard_size"] is not None or shard_bytes else 1000
    if auto and values["resize_mode"] != "short":
        raise ConfigError("--resize auto picks a short side; use --resize-mode short")
    if values["ray_address"] is not None and values["executor"] != "ray":
        raise ConfigError("--ray-address is only used with --executor ray")
    if auto and not 8 <= values["train_size"] <= 16384:
        raise ConfigError(f"train size must be between 8 and 16384 pixels, not {values['train_size']}")
    resize = ResizeConfig(
        size=size if not auto else None,
        mode=values["resize_mode"],
        upscale=values["upscale"],
        max_aspect=float(values["max_aspect"]),
        resample=values["resample"],
    )
    encode = EncodeConfig(encode=values["encode"], quality=values["quality"], max_pixels=values["max_pixels"])
    config = PackConfig(
        source=str(source),
        output=str(output),
        format=values["format"],
        resize=resize,
        encode=encode,
        shard_size=shard_size,
        shard_bytes=shard_bytes,
        workers=values["workers"],
        shuffle=values["shuffle"],
        seed=values["seed"],
        labels=values["labels"],
        resume=resume,
        overwrite=overwrite,
        executor=values["executor"],
        ray_address=values["ray_address"],
    )
    return config, auto


def _run(config: PackConfig, auto: bool, train_size: int) -> PackResult:
    from ..pack import pack as run_pack  # here: `shardkit --help` need not import imaging

    with progress_bar("packing", unit="images") as bar:
        task = bar.add_task("pack", total=None, rate="")
        started = time.perf_counter()

        def advance(done: int, total: int | None, errors: int) -> None:
            rate = done / max(time.perf_counter() - started, 1e-9)
            bar.update(task, completed=done, total=total, rate=f"{rate:,.0f} img/s, {errors:,} errors")

        return run_pack(config, resize_auto=auto, train_size=train_size, progress=advance)


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

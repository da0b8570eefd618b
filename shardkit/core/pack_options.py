"""The flat options of `pack` and probe's few: `PACK_OPTION_TABLE`, one row per option giving its
CLI flag, its preset key and the dataclass field that owns its default; `pack_config`, which turns
flat options into a validated PackConfig; and TOML presets (named ones ship in `shardkit/presets/`).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, fields
from decimal import Decimal
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser from PyPI (a dependency there)
    import tomli as tomllib

from .config import (
    DEDUP_MODES,
    DEFAULT_MAX_PIXELS,
    DEFAULT_SHARD_SIZE,
    DEFAULT_TRAIN_SIZE,
    ENCODINGS,
    EXECUTORS,
    RESIZE_MODES,
    ClipConfig,
    EncodeConfig,
    PackConfig,
    ResizeConfig,
    TableConfig,
    WebConfig,
    check_background,
)
from .errors import ConfigError, describe
from .safeio import read_regular

_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KIB": 1024, "M": 10**6, "MB": 10**6, "MIB": 2**20,
          "G": 10**9, "GB": 10**9, "GIB": 2**30, "T": 10**12, "TB": 10**12, "TIB": 2**40}  # fmt: skip


def parse_bytes(text: str | int) -> int:
    """'256MB' -> 256000000, '1GiB' -> 1073741824, 4096 -> 4096."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*(\d{1,18}(?:\.\d{1,9})?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"not a size: {text!r} (try 256MB or 1GiB)")
    return int(Decimal(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class PackOption:
    """One flat option of `pack`: its CLI flag (`--name`, '_' for '-'), the preset key of the same
    name, and the dataclass field that owns its default. The CLI, `pack_config` and presets are all
    derived from `PACK_OPTION_TABLE`: a new option is one row here, plus its use."""

    name: str
    owner: type  # PackConfig, ResizeConfig, EncodeConfig, WebConfig or ClipConfig
    field: str  # the owner's field: its default is the option's
    types: type | tuple[type, ...]  # what a preset may give (and the CLI's value type: the first)
    help: str
    default_help: str | None = None  # how --help shows the default (None: the default itself; "": not shown)
    choices: tuple[str, ...] | None = None  # offered by the CLI as a choice
    flags: tuple[str, ...] = ()  # the CLI's own spelling, where it is not `--name` (a short flag, --x/--no-x)
    parse: Callable[[Any], Any] | None = None  # flat value (a flag's text, a preset's value) to the field's

    @property
    def default(self) -> Any:
        return next(f.default for f in fields(self.owner) if f.name == self.field)


def _parse_background(value: Any) -> tuple[int, int, int]:
    """--background's text ("0,0,0") or a preset's array ([0, 0, 0]) as an RGB tuple."""
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",")]
        if len(parts) == 3 and all(re.fullmatch(r"[0-9]{1,3}", part) for part in parts):
            return check_background([int(part) for part in parts])
    return check_background(value)


def _parse_resize(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    text = value.strip().lower()
    if text in ("none", "0", ""):
        return None
    if text == "auto":
        return "auto"
    if re.fullmatch(r"[0-9]{1,9}", text):
        return int(text)
    raise ConfigError(f"--resize takes a number of pixels, 'auto' or 'none', not {value!r}")


def _parse_optional_float(value: Any) -> float | None:
    if value is None or isinstance(value, bool):
        return value  # (a bool is refused by ClipConfig, by name)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"not a number of seconds or frames: {value!r}") from None


def _parse_optional_bytes(value: Any) -> int | None:
    return None if value is None else parse_bytes(value)


PACK_OPTION_TABLE: tuple[PackOption, ...] = (
    PackOption("format", PackConfig, "format", str, "Shard format.", flags=("--format", "-f")),
    PackOption("resize", ResizeConfig, "size", (str, int), "Target size in pixels, 'auto' (probe's advice) or 'none'.",
               default_help="none", parse=_parse_resize),
    PackOption("resize_mode", ResizeConfig, "mode", str, "Which side --resize sets.", choices=RESIZE_MODES),
    PackOption("upscale", ResizeConfig, "upscale", bool, "Allow enlarging small images.", default_help="",
               flags=("--upscale/--no-upscale",)),
    PackOption("max_aspect", ResizeConfig, "max_aspect", (float, int), "Cap the long side at resize x this.",
               default_help="4", parse=float),
    PackOption("resample", ResizeConfig, "resample", str, "bilinear, bicubic or lanczos."),
    PackOption("quality", EncodeConfig, "quality", int, "JPEG quality 1-100."),
    PackOption("encode", EncodeConfig, "encode", str, "jpeg, original (keep untouched JPEGs) or raw pixels.",
               choices=ENCODINGS),
    PackOption("background", EncodeConfig, "background", (str, list),
               "R,G,B (0-255 each) that transparent pixels are flattened onto.", default_help="255,255,255 (white)",
               parse=_parse_background),
    PackOption("shard_size", PackConfig, "shard_size", int, "Records per shard.",
               default_help=f"{DEFAULT_SHARD_SIZE}, unless --shard-bytes"),
    PackOption("shard_bytes", PackConfig, "shard_bytes", (str, int), "Or: bytes per shard as written, e.g. 256MB.",
               default_help="", parse=_parse_optional_bytes),
    PackOption("workers", PackConfig, "workers", int, "Writer processes.", default_help="one per core"),
    PackOption("shuffle", PackConfig, "shuffle", bool, "Seeded shuffle before sharding.", default_help="",
               flags=("--shuffle/--no-shuffle",)),
    PackOption("seed", PackConfig, "seed", int, "Seed for --shuffle."),
    PackOption("labels", PackConfig, "labels", str, "auto, folders or none."),
    PackOption("train_size", PackConfig, "train_size", int, "Training size that --resize auto aims at."),
    PackOption("max_pixels", EncodeConfig, "max_pixels", int, "Refuse images with more pixels (bombs).",
               default_help=""),
    PackOption("executor", PackConfig, "executor", str, "local processes or a ray cluster.", choices=EXECUTORS),
    PackOption("ray_address", PackConfig, "ray_address", str, "Ray cluster: auto or ray://host:port.", default_help=""),
    PackOption("dedup", PackConfig, "dedup", str,
               "Pack the first of each set of copies (in the source's order) and list the others in errors.jsonl: "
               "exact (the same bytes) or near (re-encoded, resized, grey, brighter...).", choices=DEDUP_MODES),
    PackOption("dedup_threshold", PackConfig, "dedup_threshold", int,
               "--dedup near: the largest Hamming distance of two DCT hashes (0-32)."),
    PackOption("url_column", WebConfig, "url_column", str, "A table of URLs: the column that holds them."),
    PackOption("retries", WebConfig, "retries", int, "A table of URLs: tries again after a transient failure."),
    PackOption("backoff", WebConfig, "backoff", (float, int), "Seconds before the first retry (doubled each try, "
               "with jitter; Retry-After wins).", parse=float),
    PackOption("timeout", WebConfig, "timeout", (float, int), "One download's deadline in seconds.", parse=float),
    PackOption("max_download", WebConfig, "max_bytes", (str, int), "Refuse a download larger than this.",
               default_help="32MiB", parse=parse_bytes),
    PackOption("download_threads", WebConfig, "threads", int, "Concurrent downloads per worker process."),
    PackOption("per_host", WebConfig, "per_host", int, "Of which at most this many to one host."),
    PackOption("respect_noai", WebConfig, "respect_noai", bool,
               "Skip images served with X-Robots-Tag: noai or noimageai.", default_help="",
               flags=("--respect-noai/--ignore-noai",)),
    PackOption("clip_seconds", ClipConfig, "seconds", (float, int),
               "Pack the source's videos, each cut into clips of this many seconds (one record a clip).",
               default_help="", parse=_parse_optional_float),
    PackOption("clip_stride", ClipConfig, "stride", (float, int), "Seconds from one clip's start to the next.",
               default_help="--clip-seconds", parse=_parse_optional_float),
    PackOption("clip_fps", ClipConfig, "fps", (float, int), "Frames per second of a clip (at most the source's).",
               default_help="the source's", parse=_parse_optional_float),
)  # fmt: skip

# The flat options of `pack` (CLI flags, '_' for '-', and preset keys) and their defaults, and the
# type each preset key must have: both read from the table above.
PACK_OPTIONS: dict[str, Any] = {option.name: option.default for option in PACK_OPTION_TABLE}
PRESET_KEYS: dict[str, type | tuple[type, ...]] = {option.name: option.types for option in PACK_OPTION_TABLE}
PROBE_OPTIONS: dict[str, Any] = {"train_size": DEFAULT_TRAIN_SIZE, "workers": None, "max_pixels": DEFAULT_MAX_PIXELS}


def options(defaults: dict[str, Any], preset: str | Path | None = None, **given: Any) -> dict[str, Any]:
    """Defaults, overridden by a preset (a TOML file or a named preset), overridden by the options
    given (None means not given)."""
    values = dict(defaults)
    if preset is not None:
        values.update({key: value for key, value in load_preset(preset).items() if key in defaults})
    unknown = set(given) - set(defaults)
    if unknown:
        raise ConfigError(f"unknown option {sorted(unknown)[0]!r} (known: {', '.join(sorted(defaults))})")
    values.update({key: value for key, value in given.items() if value is not None})
    return values


def pack_config(
    source: str | Path,
    output: str | Path,
    preset: str | Path | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    staging: str | Path | None = None,
    table: TableConfig | None = None,
    sidecars: bool = False,
    **given: Any,
) -> PackConfig:
    """A validated PackConfig from the flat options (what the CLI and presets say: `resize=256` or
    "auto" or "none", `shard_bytes="256MB"`, ...): what `shardkit pack` runs, for library users too."""
    values = options(PACK_OPTIONS, preset, **given)
    owned: dict[type, dict[str, Any]] = {PackConfig: {}, ResizeConfig: {}, EncodeConfig: {}, WebConfig: {},
                                         ClipConfig: {}}  # fmt: skip
    for option in PACK_OPTION_TABLE:
        value = values[option.name]
        owned[option.owner][option.field] = option.parse(value) if option.parse is not None else value
    return PackConfig(
        source=str(source),
        output=str(output),
        resize=ResizeConfig(**owned[ResizeConfig]),
        encode=EncodeConfig(**owned[EncodeConfig]),
        web=WebConfig(**owned[WebConfig]),
        clips=ClipConfig(**owned[ClipConfig]),
        resume=resume,
        overwrite=overwrite,
        storage_options=storage_options,
        staging=None if staging is None else str(staging),
        table=table or TableConfig(),
        sidecars=sidecars,
        **owned[PackConfig],
    )


def preset_names() -> list[str]:
    """The presets that ship with shardkit (`--config imagenet-256`)."""
    return sorted(path.name.removesuffix(".toml") for path in _PRESETS.iterdir() if path.name.endswith(".toml"))


_PRESETS = Path(__file__).resolve().parent.parent / "presets"


def load_preset(path: str | Path) -> dict[str, Any]:
    """Read a TOML preset: a file, or the name of one that ships with shardkit (`imagenet-256`);
    unknown keys and wrong types are refused with the file's name."""
    name = str(path)
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name) and not name.endswith(".toml") and not Path(name).exists():
        if name not in preset_names():
            raise ConfigError(f"{name}: no such preset file or named preset (named: {', '.join(preset_names())})")
        path = _PRESETS / f"{name}.toml"
    path = Path(path)
    try:
        data = tomllib.loads(read_regular(path, 1 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such preset file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({describe(error)})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: cannot read ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None
    for key, value in data.items():
        if key not in PRESET_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(PRESET_KEYS))})")
        if not isinstance(value, PRESET_KEYS[key]) or (isinstance(value, bool) and PRESET_KEYS[key] is int):
            raise ConfigError(f"{path}: {key} has the wrong type ({type(value).__name__})")
    return dict(data)

"""Settings as frozen dataclasses, validated on construction, and TOML presets from `configs/`.

A bad value fails here, with the reason, before any work starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import tomllib

from .errors import ConfigError
from .safeio import read_regular, reason

RESIZE_MODES = ("short", "long", "center-crop")
ENCODINGS = ("jpeg", "raw", "original")
RESAMPLERS = ("bilinear", "bicubic", "lanczos")
EXECUTORS = ("local", "ray")
LABEL_MODES = ("auto", "folders", "none")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's decompression-bomb limit
# A record larger than this in a shard is refused by readers (shards may come from strangers), so
# pack refuses to write one.
MAX_RECORD_BYTES = 256 * 1024 * 1024
RECORD_META_ALLOWANCE = 1 << 20  # a record's metadata and container overhead, on top of its image


@dataclass(frozen=True)
class ResizeConfig:
    size: int | None = None  # target in pixels; None keeps the original size
    mode: str = "short"  # short: short side = size; long: long side = size; center-crop: size x size
    upscale: bool = False  # center-crop always fills its square, so it may upscale regardless
    max_aspect: float = 4.0  # the long side never exceeds size * max_aspect (thin strips stay sane)
    resample: str = "bicubic"  # antialiased: bilinear, bicubic or lanczos

    def __post_init__(self) -> None:
        if self.size is not None and not 8 <= self.size <= 16384:
            raise ConfigError(f"resize must be between 8 and 16384 pixels, not {self.size}")
        if self.mode not in RESIZE_MODES:
            raise ConfigError(f"resize mode must be one of {', '.join(RESIZE_MODES)}, not {self.mode!r}")
        if not math.isfinite(self.max_aspect) or self.max_aspect < 1:
            raise ConfigError(f"max aspect must be a finite number of at least 1, not {self.max_aspect}")
        if self.resample not in RESAMPLERS:
            raise ConfigError(f"resample must be one of {', '.join(RESAMPLERS)}, not {self.resample!r}")
        if self.mode == "center-crop" and self.size is None:
            raise ConfigError("resize mode center-crop needs a size (--resize N)")


@dataclass(frozen=True)
class EncodeConfig:
    encode: str = "jpeg"  # jpeg: re-encode; original: keep source JPEG bytes when untouched; raw: pixels
    quality: int = 90
    background: tuple[int, int, int] = (255, 255, 255)  # transparent pixels are composited on this
    max_pixels: int = DEFAULT_MAX_PIXELS

    def __post_init__(self) -> None:
        if self.encode not in ENCODINGS:
            raise ConfigError(f"encode must be one of {', '.join(ENCODINGS)}, not {self.encode!r}")
        if not 1 <= self.quality <= 100:
            raise ConfigError(f"quality must be between 1 and 100, not {self.quality}")
        if self.max_pixels < 1:
            raise ConfigError(f"max pixels must be positive, not {self.max_pixels}")
        if len(self.background) != 3 or not all(0 <= c <= 255 for c in self.background):
            raise ConfigError(f"background must be three values 0..255, not {self.background}")


@dataclass(frozen=True)
class PackConfig:
    source: str
    output: str
    format: str = "webdataset"
    resize: ResizeConfig = field(default_factory=ResizeConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    shard_size: int | None = 1000  # records per shard
    shard_bytes: int | None = None  # or: source bytes per shard
    workers: int | None = None  # None: one per core
    shuffle: bool = False
    seed: int = 0
    labels: str = "auto"
    resume: bool = False
    overwrite: bool = False
    executor: str = "local"
    ray_address: str | None = None

    def __post_init__(self) -> None:
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"shard size must be at least 1 record, not {self.shard_size}")
        if self.shard_bytes is not None and self.shard_bytes < 1024:
            raise ConfigError(f"shard bytes must be at least 1KB, not {self.shard_bytes}")
        if self.shard_size is None and self.shard_bytes is None:
            raise ConfigError("give a shard size (records) or shard bytes")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be at least 1, not {self.workers}")
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be between 0 and 2**63-1, not {self.seed}")
        if self.labels not in LABEL_MODES:
            raise ConfigError(f"labels must be one of {', '.join(LABEL_MODES)}, not {self.labels!r}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, not {self.executor!r}")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; pick one")


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


# Keys a preset may set, with the type each must have. They are the CLI flag names, '_' for '-'.
PRESET_KEYS: dict[str, type | tuple[type, ...]] = {
    "format": str, "resize": (int, str), "resize_mode": str, "upscale": bool, "max_aspect": (int, float),
    "resample": str, "quality": int, "encode": str, "shard_size": int, "shard_bytes": (int, str), "workers": int,
    "shuffle": bool, "seed": int, "labels": str, "train_size": int, "max_pixels": int,
    "executor": str, "ray_address": str,
}  # fmt: skip


def load_preset(path: str | Path) -> dict[str, Any]:
    """Read a TOML preset; unknown keys and wrong types are refused with the file's name."""
    path = Path(path)
    try:
        data = tomllib.loads(read_regular(path, 1 << 20).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such preset file") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({reason(error)})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: cannot read ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML ({error})") from None
    for key, value in data.items():
        if key not in PRESET_KEYS:
            raise ConfigError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(PRESET_KEYS))})")
        if not isinstance(value, PRESET_KEYS[key]) or (isinstance(value, bool) and PRESET_KEYS[key] is int):
            raise ConfigError(f"{path}: {key} has the wrong type ({type(value).__name__})")
    return data

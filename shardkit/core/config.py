"""Settings: frozen dataclasses validated on construction and their defaults (the one place they are
written), the size limits and the label rule, and the checks that pack, probe, verify and bench
share. A bad value fails here, with the reason, before any work starts. The flat options the CLI
and presets use, and the presets themselves, are `pack_options`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

RESIZE_MODES = ("short", "long", "center-crop")
ENCODINGS = ("jpeg", "raw", "original")
RESAMPLERS = ("bilinear", "bicubic", "lanczos")
EXECUTORS = ("local", "ray")
LABEL_MODES = ("auto", "folders", "none")
DEFAULT_MAX_PIXELS = 178_956_970  # PIL's decompression-bomb limit
DEFAULT_TRAIN_SIZE = 224  # what probe's recommendation and --resize auto aim at
DEFAULT_SHARD_SIZE = 1000  # records per shard when no shard size or shard bytes is given
MAX_SIDE = 16384  # the largest resize target or training size, in pixels
DEDUP_MODES = ("none", "exact", "near")
# The Hamming distance of two DCT hashes that still counts as a near copy: re-encoded, resized,
# grey and brighter copies and small crops fall within it, distinct photos well outside it
# (tests/test_duplicates.py plants such copies).
DEFAULT_DEDUP_THRESHOLD = 10


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def check_workers(workers: int | None, most: int | None = None) -> None:
    """The one workers check (pack, probe, verify, bench): None means one per core."""
    if workers is None:
        return
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, not {workers}")
    if most is not None and workers > most:
        raise ConfigError(f"workers must be at most {most}, not {workers}")


def check_dedup_threshold(threshold: int) -> None:
    """The one check of a near-duplicate threshold (pack --dedup near, shardkit duplicates --near)."""
    if isinstance(threshold, bool) or not isinstance(threshold, int) or not 0 <= threshold <= 32:
        raise ConfigError(f"the near-duplicate threshold must be 0 to 32 bits, not {threshold}")


def check_train_size(train_size: int) -> None:
    if not 8 <= train_size <= MAX_SIDE:
        raise ConfigError(f"train size must be between 8 and {MAX_SIDE} pixels, not {train_size}")


# A record larger than this in a shard is refused by readers (shards may come from strangers), so
# pack refuses to write one.
MAX_RECORD_BYTES = 256 * 1024 * 1024
RECORD_META_ALLOWANCE = 1 << 20  # a record's metadata and container overhead, on top of its image

# The one label rule of every source convention (a table's column, a list file, a .cls sidecar), of
# adopted tars and of readers: a whole number that an int64 holds, as every format, index.parquet and
# the batch loader's labels store it. A record read with another label is damaged.
MAX_LABEL = 2**63 - 1
LABEL_RULE = "a whole number from 0 to 2**63-1"


@dataclass(frozen=True)
class ResizeConfig:
    size: int | str | None = None  # target in pixels; None keeps the original size; "auto": probe's advice
    mode: str = "short"  # short: short side = size; long: long side = size; center-crop: size x size
    upscale: bool = False  # center-crop always fills its square, so it may upscale regardless
    max_aspect: float = 4.0  # the long side never exceeds size * max_aspect (thin strips stay sane)
    resample: str = "bicubic"  # antialiased: bilinear, bicubic or lanczos

    @property
    def pixels(self) -> int | None:
        """The target size once "auto" is resolved (pack resolves it from probe's advice first)."""
        if isinstance(self.size, str):
            raise ConfigError('resize "auto" must be resolved from the source before images are sized')
        return self.size

    def __post_init__(self) -> None:
        if self.size == "auto":
            if self.mode != "short":
                raise ConfigError("--resize auto picks a short side; use --resize-mode short")
        elif self.size is not None and (not isinstance(self.size, int) or isinstance(self.size, bool)):
            raise ConfigError(f"resize takes a number of pixels, 'auto' or none, not {self.size!r}")
        elif self.size is not None and not 8 <= self.size <= MAX_SIDE:
            raise ConfigError(f"resize must be between 8 and {MAX_SIDE} pixels, not {self.size}")
        if self.mode not in RESIZE_MODES:
            raise ConfigError(f"resize mode must be one of {', '.join(RESIZE_MODES)}, not {self.mode!r}")
        if not math.isfinite(self.max_aspect) or self.max_aspect < 1:
            raise ConfigError(f"max aspect must be a finite number of at least 1, not {self.max_aspect}")
        if self.resample not in RESAMPLERS:
            raise ConfigError(f"resample must be one of {', '.join(RESAMPLERS)}, not {self.resample!r}")
        if self.mode == "center-crop" and self.size is None:
            raise ConfigError("resize mode center-crop needs a size (--resize N)")


def check_background(value: Any) -> tuple[int, int, int]:
    """The colour transparent pixels are flattened onto: three whole numbers 0-255 (R, G, B), as a
    tuple; anything else refused with the form it takes."""
    whole = isinstance(value, (tuple, list)) and len(value) == 3
    if whole and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in value):
        return (value[0], value[1], value[2])
    shown = ",".join(map(str, value)) if isinstance(value, (tuple, list)) else value
    raise ConfigError(f"--background takes R,G,B: three whole numbers 0-255 (0,0,0 is black), not {shown!r}")


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
        object.__setattr__(self, "background", check_background(self.background))


@dataclass(frozen=True)
class TableConfig:
    """How a metadata table becomes samples (--metadata and the column flags). `path` None: the
    source's own metadata.jsonl, .csv or .parquet at its root, when it has one."""

    path: str | None = None
    path_column: str = "file_name"
    caption_column: str | None = None  # None: "caption", else "captions", else "text", when the table has one
    label_column: str | None = None
    columns: tuple[str, ...] | None = None  # None: every column but the path, caption and label ones

    def __post_init__(self) -> None:
        if self.columns is not None:
            object.__setattr__(self, "columns", tuple(self.columns))
        for what, name in (
            ("path column", self.path_column), ("caption column", self.caption_column),
            ("label column", self.label_column), *(("column", name) for name in self.columns or ()),
        ):  # fmt: skip
            if name is not None and (not isinstance(name, str) or not name.strip()):
                raise ConfigError(f"the {what} must be a name, not {name!r}")
        if self.columns is not None and len(set(self.columns)) != len(self.columns):
            raise ConfigError("--columns names a column twice")


@dataclass(frozen=True)
class WebConfig:
    """How the images of a URL table are downloaded (pack and probe of a table of URLs). A
    transient failure (refused or reset connection, timeout, a body cut short, 5xx, 429) is tried
    again `retries` times, waiting `backoff` seconds doubled each try with full jitter (a 429 or
    503's Retry-After instead, up to a minute); anything else is final at once."""

    url_column: str = "url"
    retries: int = 5
    backoff: float = 0.5  # the first retry's mean wait, in seconds
    timeout: float = 30.0  # one request's deadline, connect to last byte, in seconds
    max_bytes: int = 32 << 20  # a larger body is refused (read no further than this)
    threads: int = 32  # concurrent downloads in each worker process
    per_host: int = 16  # of which at most this many to one host
    respect_noai: bool = True  # X-Robots-Tag: noai / noimageai refuses the image (as img2dataset does)

    def __post_init__(self) -> None:
        if not isinstance(self.url_column, str) or not self.url_column.strip():
            raise ConfigError(f"the URL column must be a name, not {self.url_column!r}")
        if not 0 <= self.retries <= 100:
            raise ConfigError(f"retries must be 0 to 100, not {self.retries}")
        if not (math.isfinite(self.backoff) and 0 <= self.backoff <= 600):
            raise ConfigError(f"backoff must be 0 to 600 seconds, not {self.backoff}")
        if not (math.isfinite(self.timeout) and 0 < self.timeout <= 3600):
            raise ConfigError(f"timeout must be more than 0 and at most 3600 seconds, not {self.timeout}")
        if not 1024 <= self.max_bytes <= MAX_RECORD_BYTES:
            raise ConfigError(f"the download size cap must be 1KiB to 256MiB, not {self.max_bytes:,} bytes")
        if not 1 <= self.threads <= 1024:
            raise ConfigError(f"download threads must be 1 to 1024, not {self.threads}")
        if not 1 <= self.per_host <= 1024:
            raise ConfigError(f"downloads per host must be 1 to 1024, not {self.per_host}")


# A clip has at most this many frames: the most of a video that one clip's encoder and a resume's
# plan keep at once, whatever --clip-seconds x --clip-fps asks (10 minutes at 30 fps is 18,000).
MAX_CLIP_FRAMES = 18_000
MAX_CLIP_FPS = 240.0  # the highest clip frame rate asked for or taken from a source


@dataclass(frozen=True)
class ClipConfig:
    """How videos are cut into clips (pack --clip-seconds): `seconds` None packs images, not videos.
    A clip starts every `stride` seconds (default: `seconds`, back to back) on the video's own
    timeline; its frames are picked by timestamp at `fps` (default: the source's, and never more
    than the source's: a frame is never made up)."""

    seconds: float | None = None
    stride: float | None = None
    fps: float | None = None

    def __post_init__(self) -> None:
        for name in ("seconds", "stride", "fps"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"--clip-{name} must be a number of more than 0, not {value!r}")
            object.__setattr__(self, name, float(value))
        if self.seconds is None and (self.stride is not None or self.fps is not None):
            raise ConfigError("--clip-stride and --clip-fps cut videos into clips; give --clip-seconds too")
        if self.fps is not None and self.fps > MAX_CLIP_FPS:
            raise ConfigError(f"--clip-fps must be at most {MAX_CLIP_FPS:g}, not {self.fps:g}")
        if (
            self.seconds is not None
            and self.seconds * (self.fps or MAX_CLIP_FPS) > MAX_CLIP_FRAMES
            and (self.fps is not None or self.seconds > MAX_CLIP_FRAMES / 30)
        ):
            raise ConfigError(
                f"a clip holds at most {MAX_CLIP_FRAMES:,} frames; --clip-seconds {self.seconds:g} is too long"
            )

    @property
    def step(self) -> float:
        """Seconds from one clip's start to the next."""
        assert self.seconds is not None
        return self.stride if self.stride is not None else self.seconds


@dataclass(frozen=True)
class PackConfig:
    source: str
    output: str
    format: str = "webdataset"
    resize: ResizeConfig = field(default_factory=ResizeConfig)
    encode: EncodeConfig = field(default_factory=EncodeConfig)
    shard_size: int | None = None  # records per shard; None: DEFAULT_SHARD_SIZE unless shard_bytes is given
    shard_bytes: int | None = None  # or: bytes per shard as written (each image's output estimated)
    workers: int | None = None  # None: one per core
    shuffle: bool = False
    seed: int = 0
    labels: str = "auto"
    resume: bool = False
    overwrite: bool = False
    executor: str = "local"
    ray_address: str | None = None
    train_size: int = DEFAULT_TRAIN_SIZE  # what resize "auto" aims at
    # an output URL (s3://...): fsspec's options to reach it, and the local folder shards are
    # written to before they are uploaded (default: under the shard cache)
    storage_options: dict[str, Any] | None = None
    staging: str | None = None
    table: TableConfig = field(default_factory=TableConfig)  # a metadata table's columns
    sidecars: bool = False  # files sharing a stem in one folder are one sample (x.jpg, x.txt, x.json...)
    # keep the first of each group of copies (walk order), list the others as duplicates: "none",
    # "exact" (the same bytes) or "near" (DCT hashes within dedup_threshold bits, exact copies too)
    dedup: str = "none"
    dedup_threshold: int = DEFAULT_DEDUP_THRESHOLD
    web: WebConfig = field(default_factory=WebConfig)  # a URL table's downloads
    clips: ClipConfig = field(default_factory=ClipConfig)  # videos cut into clips (--clip-seconds)

    def __post_init__(self) -> None:
        if self.dedup not in DEDUP_MODES:
            raise ConfigError(f"dedup must be one of {', '.join(DEDUP_MODES)}, not {self.dedup!r}")
        check_dedup_threshold(self.dedup_threshold)
        if self.shard_size is None and self.shard_bytes is None:
            object.__setattr__(self, "shard_size", DEFAULT_SHARD_SIZE)
        if self.shard_size is not None and self.shard_size < 1:
            raise ConfigError(f"shard size must be at least 1 record, not {self.shard_size}")
        if self.shard_bytes is not None and self.shard_bytes < 1000:  # (1KB: sizes are decimal, as the flag reads them)
            raise ConfigError(f"shard bytes must be at least 1KB (1000 bytes), not {self.shard_bytes:,} bytes")
        check_workers(self.workers)
        if not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed must be between 0 and 2**63-1, not {self.seed}")
        if self.labels not in LABEL_MODES:
            raise ConfigError(f"labels must be one of {', '.join(LABEL_MODES)}, not {self.labels!r}")
        if self.executor not in EXECUTORS:
            raise ConfigError(f"executor must be one of {', '.join(EXECUTORS)}, not {self.executor!r}")
        if self.resume and self.overwrite:
            raise ConfigError("--resume and --overwrite contradict each other; pick one")
        if self.ray_address is not None and self.executor != "ray":
            raise ConfigError("--ray-address is only used with --executor ray")
        check_train_size(self.train_size)

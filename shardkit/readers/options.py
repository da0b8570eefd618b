"""The read side's keywords, each written once with its default and its check: `ReadOptions` and
`OpenOptions` (open_shards'), `LoaderOptions` (loader()'s). The public functions keep their own
signatures, so users, `help()` and IDEs see every keyword; they hand their values over with
`given(...)`, and tests/test_options.py fails where a signature and its options differ (a keyword
in one and not the other, another default or another type).

Each options object checks its values when it is made, every refusal a ConfigError saying why: a
bad keyword fails when open_shards() or loader() is called, before anything is read."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from ..core.config import DEFAULT_MAX_PIXELS
from ..core.errors import ConfigError, require
from .handlers import OnError
from .order import check_buffer, check_seed
from .samples import DECODE_MODES, SCALES
from .targets import check_target_options

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .samples import Sample

Options = TypeVar("Options", bound="DataclassInstance")
Location = str | os.PathLike[str]  # an output's folder, its manifest.json, or a URL
CROPS = ("random", "center", None)
OUTPUTS = ("torch", "numpy")
MAX_SIDE = 16384  # the largest output side loader(size=...) takes


def given(kind: type[Options], values: Mapping[str, Any]) -> Options:
    """Options of `kind` from a function's keyword values (its `locals()` on entry): each field taken
    from the keyword of its name, so no keyword is handed over by hand, and none can be left out."""
    return kind(**{item.name: values[item.name] for item in fields(kind) if item.init})


@dataclass(frozen=True)
class ReadOptions:
    """How each output is read: open_shards' keywords of that name (see it for each), handed down to
    every dataset of a mix alike."""

    decode: str = "rgb"
    scale: float | None = None
    transform: Callable[[Sample], Any] | None = None
    on_error: str = "raise"
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 1000
    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False
    max_pixels: int = DEFAULT_MAX_PIXELS
    # what of the output is read (readers/subset) and the columns joined to it (readers/joined);
    # not compared: a pyarrow Expression's == makes an Expression
    select: Any = field(default=None, compare=False)
    join: Any = field(default=None, compare=False)
    handler: OnError = field(init=False, repr=False, compare=False)  # made from on_error

    def __post_init__(self) -> None:
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODE_MODES)}, not {self.decode!r}")
        if self.scale is not None and not any(abs(self.scale - s) < 1e-9 for s in SCALES):
            raise ConfigError(f"scale must be 1, 1/2, 1/4 or 1/8, not {self.scale}")
        object.__setattr__(self, "handler", OnError(self.on_error))
        check_seed(self.seed)
        check_buffer(self.shuffle_buffer)
        max_pixels = self.max_pixels
        if isinstance(max_pixels, bool) or not isinstance(max_pixels, int) or max_pixels < 1:
            raise ConfigError(f"max_pixels must be a positive integer, not {max_pixels!r}")
        if self.decode == "torch":
            require("torch", "torch")


@dataclass(frozen=True)
class OpenOptions:
    """Where the outputs are and how several are mixed: open_shards' other keywords. The storage
    ones are checked where a remote output is opened (storage/cache), the mix's where a mix is made
    (readers/mix): a single output does not read exhausted=, and refuses weights= and length=."""

    storage_options: dict[str, Any] | None = None
    cache_dir: Location | None = None
    cache_limit: str | int | None = None
    weights: Sequence[float] | None = None
    length: int | None = None
    exhausted: str = "resample"
    version: int | None = None  # an earlier version kept by --keep-versions (None: the output's own)


@dataclass(frozen=True)
class LoaderOptions:
    """loader()'s keywords (see EpochIteration.loader for each), checked in the order a reader of
    the signature meets them. The fields after the keywords are what the checks make of them."""

    batch_size: int
    size: int | tuple[int, int]
    crop: str | None = "random"
    flip: bool = False
    workers: int | None = None
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    resize: int | None = None
    output: str = "torch"
    pin_memory: bool = False
    prefetch: int | None = None
    drop_last: bool = False
    device: Any = None
    dtype: Any = None
    mean: Sequence[float] | None = None
    std: Sequence[float] | None = None
    mask: str | None = None
    boxes: str | None = None
    box_format: str = "xywh"
    frames: int | None = None
    mask_missing: int | None = None
    box_labels: str | None = None
    stats: bool = True
    progress: bool = False
    out_size: tuple[int, int] = field(init=False)  # size as (height, width)
    resize_to: int = field(init=False)  # resize, or its default: size / 0.875 (224 -> 256)
    threads: int = field(init=False)  # decode threads; 0: each batch made in the calling thread
    ahead: int = field(init=False)  # batches decoded ahead of the one handed out
    torch_device: Any = field(init=False)  # device as a torch.device; None: the CPU path
    normalize: tuple[Any, Any, Any] = field(init=False)  # the device path's (dtype, mean, std)

    def __post_init__(self) -> None:
        _positive("batch_size", self.batch_size)
        out_size = _size(self.size)
        crop, scale, ratio, output = self.crop, self.scale, self.ratio, self.output
        if crop not in CROPS:
            raise ConfigError(f"crop must be 'random', 'center' or None, not {crop!r}")
        if output not in OUTPUTS:
            raise ConfigError(f"output must be 'torch' or 'numpy', not {output!r}")
        if not (0 < scale[0] <= scale[1] <= 1) or not all(math.isfinite(v) for v in scale):
            raise ConfigError(f"scale must be 0 < low <= high <= 1, not {scale}")
        if not (0 < ratio[0] <= ratio[1]) or not all(math.isfinite(v) for v in ratio):
            raise ConfigError(f"ratio must be 0 < low <= high, not {ratio}")
        resize_to = round(min(out_size) / 0.875) if self.resize is None else _positive("resize", self.resize)
        if crop == "center" and resize_to < max(out_size):
            raise ConfigError(f"resize {resize_to} is smaller than the center crop {out_size}")
        if self.workers == 0:  # torch's DataLoader reads num_workers=0 so: in the calling thread
            threads = ahead = 0
        else:
            threads = _positive("workers", self.workers if self.workers is not None else (os.cpu_count() or 1))
            ahead = _positive("prefetch", self.prefetch if self.prefetch is not None else 2 * threads)
        torch_device, normalize = self._device_path()
        check_target_options(self.mask, self.boxes, self.box_format, self.mask_missing, self.box_labels)
        if self.frames is not None:
            _positive("frames", self.frames)
            if self.device is not None or self.mask is not None or self.boxes is not None:
                raise ConfigError("frames= (clips) takes no device=, mask= or boxes=: clips are decoded on the CPU")
        if self.progress and not self.stats:
            raise ConfigError("progress=True shows the loader's stats: leave stats=True")
        made = {"out_size": out_size, "resize_to": resize_to, "threads": threads, "ahead": ahead,
                "torch_device": torch_device, "normalize": normalize}  # fmt: skip
        for name, value in made.items():
            object.__setattr__(self, name, value)

    def _device_path(self) -> tuple[Any, tuple[Any, Any, Any]]:
        """torch (imported here: output="torch" needs it), then device= as a torch.device and the
        normalization it takes (dtype, mean, std), each refused where it cannot run."""
        torch = require("torch", "torch") if self.output == "torch" else None
        if self.device is None:
            if self.dtype is not None or self.mean is not None or self.std is not None:
                raise ConfigError("dtype, mean and std are the device path's (give device='cuda', or 'cpu')")
            return None, (None, None, None)
        from .device import check_device, check_normalize

        if torch is None:
            raise ConfigError("device= gives torch tensors on that device: leave output='torch'")
        return check_device(torch, self.device), check_normalize(torch, self.dtype, self.mean, self.std)

    @property
    def decoder(self) -> str:
        """Which decoder reads the records (readers/loader.py's DECODERS): "clips" with frames=,
        "device" with device=, else "cpu"."""
        return "clips" if self.frames is not None else "device" if self.torch_device is not None else "cpu"


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, not {value!r}")
    return int(value)


def _size(size: Any) -> tuple[int, int]:
    if isinstance(size, (int, np.integer)) and not isinstance(size, bool):
        size = (size, size)
    if not (isinstance(size, tuple | list) and len(size) == 2):
        raise ConfigError(f"size must be an int or (height, width), not {size!r}")
    height, width = (_positive("size", value) for value in size)
    if height > MAX_SIDE or width > MAX_SIDE:
        raise ConfigError(f"size must be at most {MAX_SIDE} pixels a side, not {size!r}")
    return height, width

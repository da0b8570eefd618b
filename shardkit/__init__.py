"""shardkit: pack image folders into fast training shards (WebDataset, LMDB, HDF5).

The public API is what `__all__` names; each name is imported on first use (PEP 562), so
`import shardkit` stays cheap (no numpy, no imaging) and `shardkit --help` starts fast.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "open_shards": "readers",
    "ShardDataset": "readers",
    "pack": "pack",
    "PackResult": "pack",
    "probe": "probe",
    "ProbeReport": "probe",
    "recommend": "probe",
    "verify": "verify",
    "VerifyReport": "verify",
    "PackConfig": "config",
    "ResizeConfig": "config",
    "EncodeConfig": "config",
    "load_preset": "config",
    "available_formats": "formats",
    "ShardkitError": "errors",
    "ConfigError": "errors",
    "SourceError": "errors",
    "OutputError": "errors",
    "ImageError": "errors",
    "ShardFormatError": "errors",
    "ManifestError": "errors",
    "ShardReadError": "errors",
    "MissingDependencyError": "errors",
}
__all__ = [
    "ConfigError",
    "EncodeConfig",
    "ImageError",
    "ManifestError",
    "MissingDependencyError",
    "OutputError",
    "PackConfig",
    "PackResult",
    "ProbeReport",
    "ResizeConfig",
    "ShardDataset",
    "ShardFormatError",
    "ShardReadError",
    "ShardkitError",
    "SourceError",
    "VerifyReport",
    "__version__",
    "available_formats",
    "load_preset",
    "open_shards",
    "pack",
    "probe",
    "recommend",
    "verify",
]


class _Package(types.ModuleType):
    """`pack`, `probe` and `verify` name both a public function and the module defining it: the
    import system binds a submodule to its parent's attribute once imported, which would hide the
    function. The package keeps the function (the module stays in sys.modules, where imports and
    pickle look it up)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS_NAMED_LIKE_MODULES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


_FUNCTIONS_NAMED_LIKE_MODULES = frozenset({"pack", "probe", "verify"})
sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'shardkit' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from .config import EncodeConfig, PackConfig, ResizeConfig, load_preset
    from .errors import (
        ConfigError,
        ImageError,
        ManifestError,
        MissingDependencyError,
        OutputError,
        ShardFormatError,
        ShardkitError,
        ShardReadError,
        SourceError,
    )
    from .formats import available_formats
    from .pack import PackResult, pack
    from .probe import ProbeReport, probe, recommend
    from .readers import ShardDataset, open_shards
    from .verify import VerifyReport, verify

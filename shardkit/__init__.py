"""shardkit: pack image folders into fast training shards (WebDataset, LMDB, HDF5).

The public API is what `__all__` names; each name is imported on first use (PEP 562), so
`import shardkit` stays cheap (no numpy, no imaging) and `shardkit --help` starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .core.version import __version__

# name -> the module that defines it
_EXPORTS = {
    "open_shards": "readers",
    "ShardDataset": "readers",
    "pack": "packing.pack",
    "PackResult": "packing.pack",
    "probe": "packing.probe",
    "ProbeReport": "packing.probe",
    "recommend": "packing.probe",
    "verify": "checks.verify",
    "remove": "changes.remove",
    "append": "changes.append",
    "merge": "changes.merge",
    "MergeResult": "changes.merge",
    "AppendResult": "changes.append",
    "compact": "changes.compact",
    "CompactResult": "changes.compact",
    "RemoveResult": "changes.remove",
    "VerifyReport": "checks.verify_report",
    "PackConfig": "core.config",
    "ResizeConfig": "core.config",
    "EncodeConfig": "core.config",
    "load_preset": "core.pack_options",
    "pack_config": "core.pack_options",
    "available_formats": "formats",
    "ShardkitError": "core.errors",
    "ConfigError": "core.errors",
    "SourceError": "core.errors",
    "OutputError": "core.errors",
    "ImageError": "core.errors",
    "ShardFormatError": "core.errors",
    "ManifestError": "core.errors",
    "ShardReadError": "core.errors",
    "StorageError": "core.errors",
    "StoreUnreachable": "core.errors",
    "MissingDependencyError": "core.errors",
}
__all__ = [
    "AppendResult",
    "CompactResult",
    "ConfigError",
    "EncodeConfig",
    "ImageError",
    "ManifestError",
    "MergeResult",
    "MissingDependencyError",
    "OutputError",
    "PackConfig",
    "PackResult",
    "ProbeReport",
    "RemoveResult",
    "ResizeConfig",
    "ShardDataset",
    "ShardFormatError",
    "ShardReadError",
    "ShardkitError",
    "SourceError",
    "StorageError",
    "StoreUnreachable",
    "VerifyReport",
    "__version__",
    "append",
    "available_formats",
    "compact",
    "load_preset",
    "merge",
    "open_shards",
    "pack",
    "pack_config",
    "probe",
    "recommend",
    "remove",
    "verify",
]


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
    from .checks.verify import verify
    from .checks.verify_report import VerifyReport
    from .core.config import EncodeConfig, PackConfig, ResizeConfig
    from .core.errors import (
        ConfigError,
        ImageError,
        ManifestError,
        MissingDependencyError,
        OutputError,
        ShardFormatError,
        ShardkitError,
        ShardReadError,
        SourceError,
        StorageError,
        StoreUnreachable,
    )
    from .core.pack_options import load_preset, pack_config
    from .formats import available_formats
    from .packing.pack import PackResult, pack
    from .packing.probe import ProbeReport, probe, recommend
    from .readers.dataset import ShardDataset, open_shards

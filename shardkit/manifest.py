"""The output's self-description: `manifest.json` (schema, settings, classes, per-shard sha256) and
`errors.jsonl` (every input that was not packed, with its reason). Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import ShardFormatError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
ERRORS_NAME = "errors.jsonl"
STATE_DIR = ".shardkit"  # resume state and temporary shards; removed when a pack completes


@dataclass(frozen=True)
class ShardInfo:
    name: str
    count: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    format: str
    shards: list[ShardInfo]
    classes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # resize, encode, sharding: how it was made
    totals: dict[str, int] = field(default_factory=dict)  # inputs, records, errors
    schema_version: int = SCHEMA_VERSION
    created_by: str = ""
    checksum: str = ""  # sha256 of everything else: verify uses it to catch hand edits

    @property
    def records(self) -> int:
        return sum(shard.count for shard in self.shards)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def computed_checksum(self) -> str:
        content = {key: value for key, value in asdict(self).items() if key != "checksum"}
        return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()

    def sealed(self) -> Manifest:
        """This manifest with its checksum filled in."""
        from dataclasses import replace

        return replace(self, checksum=self.computed_checksum())

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        try:
            if data["schema_version"] != SCHEMA_VERSION:
                raise ShardFormatError(f"{where}: schema version {data['schema_version']} is not {SCHEMA_VERSION}")
            shards = [ShardInfo(**shard) for shard in data["shards"]]
            manifest = cls(
                format=str(data["format"]),
                shards=shards,
                classes=[str(name) for name in data.get("classes", [])],
                settings=dict(data.get("settings", {})),
                totals={str(k): _total(v) for k, v in data.get("totals", {}).items()},
                schema_version=int(data["schema_version"]),
                created_by=str(data.get("created_by", "")),
                checksum=str(data.get("checksum", "")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ShardFormatError(f"{where}: not a valid shardkit manifest ({error!r})") from None
        if not isinstance(data.get("classes", []), list):
            raise ShardFormatError(f"{where}: classes must be a list of names")
        for shard in shards:
            # Names come from strangers: a shard must sit in the output folder itself.
            name = shard.name
            if not isinstance(name, str) or any(c in name for c in "/\\\0") or name in ("", ".", ".."):
                raise ShardFormatError(f"{where}: shard name {name!r} is not a plain file name")
            if not _is_int(shard.count) or not 0 <= shard.count <= MAX_SHARD_RECORDS:
                raise ShardFormatError(f"{where}: shard {name} has a bad record count")
            if not _is_int(shard.bytes) or shard.bytes < 0:
                raise ShardFormatError(f"{where}: shard {name} has a bad byte size")
            if not isinstance(shard.sha256, str) or len(shard.sha256) != 64:
                raise ShardFormatError(f"{where}: shard {name} has a bad sha256")
        return manifest


MAX_SHARD_RECORDS = 2**40  # far above any real shard; bounds what a hostile manifest can claim


def _total(value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"total {value!r} is not an integer")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_json_atomic(path: str | Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    write_text_atomic(path, text)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: readers never see half a file."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of an output folder (or the manifest file itself)."""
    path = Path(folder)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ShardFormatError(f"{path}: no manifest (is this a shardkit output folder?)") from None
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ShardFormatError(f"{path}: unreadable manifest ({error})") from None
    return Manifest.from_json(data, str(path))


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as source:
        while chunk := source.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def read_errors(folder: str | Path) -> list[dict[str, Any]]:
    path = Path(folder) / ERRORS_NAME
    if not path.exists():
        return []
    rows = []
    try:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError(f"line {number} is not an object")
                rows.append(row)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ShardFormatError(f"{path}: unreadable ({error})") from None
    return rows

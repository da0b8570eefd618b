"""`shardkit compact`: small shards (left by removes, or by a pack with small shards) joined into
full ones, without decoding or encoding a record.

Consecutive shards are taken in the output's order while they fit the target (records, or bytes
as written); each run of two or more becomes one shard under the next version's name of its first
(`shard-NNNNNN-vK`), its records in the same order. A shard alone in its run, or already over the
target, stays as it is, byte for byte. The records, their order and every byte of them are the
same before and after: a reader sees the same samples, from fewer shards. A kill at any point
leaves the earlier version or the new one (changes/journal.py).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from ..core.errors import ConfigError
from ..core.manifest import Manifest, ShardInfo
from ..core.pack_options import parse_bytes
from ..packing.working_folder import versioned_name
from .journal import Changing, Journal
from .rewrite import Change, new_journal, refuse_foreign_shards, refuse_taken_names, run


@dataclass(frozen=True)
class CompactResult:
    """What a compact did: the version it made (the one there was, where nothing was joined), the
    shards before and after, and the bytes written."""

    output: str
    version: int
    shards_before: int
    shards_after: int
    joined: int  # shards written from two or more
    bytes_written: int
    output_bytes: int
    seconds: float
    resumed: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compact(
    output: str | os.PathLike[str],
    *,
    shard_size: int | None = None,
    shard_bytes: int | str | None = None,
    resume: bool = False,
    keep_versions: bool = False,
    progress: Callable[[int, int], None] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> CompactResult:
    """Join consecutive small shards of the output `output` (a folder, or a bucket's URL reached
    with `storage_options`) into shards of at most
    `shard_size` records (or `shard_bytes` bytes: an int or a text such as "256MB"). `resume`
    finishes a compact that was interrupted (so does the same compact run again). `keep_versions`
    keeps the version before whole in versions/vN (hard links; in a bucket, server-side copies).
    `progress(done, total)` counts shards written."""
    target = _target(shard_size, shard_bytes, resume)
    asked = {**target, "keep_versions": True} if keep_versions else target
    request = hashlib.sha256(json.dumps(asked, sort_keys=True).encode()).hexdigest()
    before = [0]

    def plan(changed: Changing) -> Journal | None:
        before[0] = len(changed.manifest.shards)
        return _plan(changed, target, request)

    done = run(
        output,
        Change("compact", request, plan, _totals, _history, check=_check, keep_versions=keep_versions),
        resume,
        progress,
        storage_options,
    )
    after = len(done.manifest.shards)
    size = sum(s.bytes for s in done.manifest.shards)
    if done.journal is None:
        return CompactResult(str(output), done.manifest.version, after, after, 0, 0, size, done.seconds)
    spent = done.journal.plan
    joined = len(spent["writes"])
    shards_before = before[0] or after + len(spent["gone"]) - joined
    return CompactResult(
        str(output), done.journal.version, shards_before, after, joined, spent["bytes_written"], size, done.seconds,
        resumed=done.resumed,
    )  # fmt: skip


def _target(shard_size: Any, shard_bytes: Any, resume: bool) -> dict[str, int]:
    """The target asked for, checked; none with `resume` (the interrupted compact's own is finished)."""
    if resume:
        if shard_size is not None or shard_bytes is not None:
            raise ConfigError("--resume finishes the interrupted compact as it was asked: give no target with it")
        return {}
    if (shard_size is None) == (shard_bytes is None):
        raise ConfigError("compact needs a target: --shard-size (records a shard) or --shard-bytes (not both)")
    if shard_size is not None:
        return {"shard_size": _checked(shard_size, "shard_size")}
    if not isinstance(shard_bytes, (str, int)) or isinstance(shard_bytes, bool):
        raise ConfigError(f"shard bytes must be a whole number of bytes or a size such as 256MB, not {shard_bytes!r}")
    return {"shard_bytes": _checked(parse_bytes(shard_bytes), "shard_bytes")}


def _checked(value: Any, name: str) -> int:
    """A target's value: records (2 or more) or bytes (1KB or more), a whole number."""
    least = 2 if name == "shard_size" else 1000
    if type(value) is not int or value < least:
        said = "2 or more records" if name == "shard_size" else "at least 1KB (1000 bytes)"
        raise ConfigError(f"{name.replace('_', ' ')} must be {said}, not {value!r}")
    return value


def _plan(changed: Changing, target: dict[str, int], request: str) -> Journal | None:
    """Runs of consecutive shards that fit the target, each of two or more joined into one; None
    where no two fit together."""
    refuse_foreign_shards(changed, "compact")
    writes, gone = _joined(changed.manifest, target)
    if not writes:
        return None
    refuse_taken_names(changed, writes)
    return new_journal("compact", request, changed.manifest, {"writes": writes, "gone": gone, "target": target})


def _joined(manifest: Manifest, target: dict[str, int]) -> tuple[list[list[Any]], list[str]]:
    """The plan's `writes` and `gone` for `target`: a function of the manifest and the target alone,
    so that an interrupted compact's plan can be made again and compared."""
    most_records, most_bytes = target.get("shard_size"), target.get("shard_bytes")
    runs: list[list[ShardInfo]] = [[]]
    for shard in manifest.shards:
        records = sum(s.count for s in runs[-1]) + shard.count
        size = sum(s.bytes for s in runs[-1]) + shard.bytes
        if runs[-1] and ((most_records and records > most_records) or (most_bytes and size > most_bytes)):
            runs.append([])
        runs[-1].append(shard)
    version = manifest.version + 1
    joined = [run for run in runs if len(run) > 1]
    writes = [[versioned_name(run[0].name, version), [[s.name, []] for s in run]] for run in joined]
    return writes, [s.name for run in joined for s in run]


def _totals(manifest: Manifest, plan: dict[str, Any], shards: list[ShardInfo], errors: int) -> dict[str, int]:
    return dict(manifest.totals)  # (the same records and errors)


def _history(plan: dict[str, Any]) -> dict[str, Any]:
    return {**plan["target"], "joined": [[new, [old for old, _ in parts]] for new, parts in plan["writes"]]}


def _check(journal: Journal, manifest: Manifest) -> None:
    """A compact's plan read back must be the one its target makes of the output now."""
    target = journal.plan.get("target")
    try:
        if not isinstance(target, dict) or len(target) != 1 or not set(target) <= {"shard_size", "shard_bytes"}:
            raise ConfigError("no target")
        name, value = next(iter(target.items()))
        _checked(value, name)
    except ConfigError:
        raise ValueError("has no target a compact takes") from None
    writes, gone = _joined(manifest, target)
    if journal.plan["writes"] != writes or journal.plan["gone"] != gone:
        raise ValueError("is not what its target makes of the output")

"""Deterministic split of items into shards, and which shards an interrupted run may keep."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .discover import Item
from .manifest import ShardInfo, sha256_file
from .output import shard_name, state_dir
from .safeio import load_json_file


@dataclass(frozen=True)
class ShardSpec:
    index: int
    name: str
    items: tuple[Item, ...]


def plan_shards(
    items: Sequence[Item],
    *,
    suffix: str,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
) -> list[ShardSpec]:
    """Split items (sorted by discovery) into shards of at most `shard_size` records and/or
    `shard_bytes` source bytes. With `shuffle`, the order is a seeded permutation first."""
    order = list(items)
    if shuffle:
        permutation = np.random.default_rng(seed).permutation(len(order))
        order = [order[i] for i in permutation]
    groups: list[list[Item]] = []
    current: list[Item] = []
    current_bytes = 0
    for item in order:
        size = _size(item.path) if shard_bytes is not None else 0
        full_by_count = shard_size is not None and len(current) >= shard_size
        full_by_bytes = shard_bytes is not None and current and current_bytes + size > shard_bytes
        if full_by_count or full_by_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append(item)
        current_bytes += size
    if current:
        groups.append(current)
    return [ShardSpec(i, shard_name(i, suffix), tuple(group)) for i, group in enumerate(groups)]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _size_and_mtime(path: str) -> tuple[int, int]:
    try:
        info = os.stat(path)
    except OSError:
        return -1, -1
    return info.st_size, info.st_mtime_ns


def fingerprint(settings: dict[str, Any], specs: Sequence[ShardSpec]) -> str:
    """One hash of the settings and the exact plan: a resumed run must match it."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for spec in specs:
        digest.update(spec.name.encode())
        for item in spec.items:
            size, mtime = _size_and_mtime(item.path)  # a changed source must not reuse old shards
            line = f"\0{item.relpath}\0{item.key}\0{item.label}\0{size}\0{mtime}"
            digest.update(line.encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def done_path(output: str | Path, spec: ShardSpec) -> Path:
    return state_dir(output) / "done" / f"{spec.name}.json"


def reusable(output: str | Path, spec: ShardSpec, plan_hash: str) -> dict[str, Any] | None:
    """The finished result of this shard from an earlier run, if the shard file is still exactly it."""
    marker = done_path(output, spec)
    shard = Path(output) / spec.name
    try:
        result = load_json_file(marker)
        info = ShardInfo(**result["shard"])
        if result["plan"] != plan_hash or shard.stat().st_size != info.bytes:
            return None
        if sha256_file(shard) != info.sha256:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return result

"""Deterministic split of items into shards, and the plan's fingerprint (the whole plan's, and each
shard's own: what a resume compares, packing/resume.py)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..core.manifest import json_sha256, sorted_json
from ..core.safeio import file_stamp
from ..storage.urls import is_remote
from .sources import Item, payload, with_payload
from .working_folder import shard_name


@dataclass(frozen=True)
class ShardSpec:
    number: int  # the shard's place in the plan (its name's number)
    name: str
    items: tuple[Item, ...]


def plan_shards(
    items: Iterable[Item],
    *,
    suffix: str,
    shard_size: int | None = None,
    shard_bytes: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    weigh: Callable[[Item], int] | None = None,
    per_shard: int = 0,
    first: int = 0,
) -> Iterator[ShardSpec]:
    """Split items (in walk order) into shards of at most `shard_size` records and/or
    `shard_bytes` bytes (the nearest cut): `weigh` says what an item adds to its shard (a pack's estimate of its
    output, packing/estimate.py; by default its source file's bytes) and `per_shard` what a shard
    takes whatever it holds. Each shard is yielded as soon as it is full: a walk still going feeds
    it. With `shuffle`, the order is a seeded permutation of the whole list, so the walk is finished
    first and the list kept compactly (~the bytes of its names) until the last shard is cut. Shards
    are numbered from `first` (an append's shards follow the output's)."""
    order = _shuffled(items, seed) if shuffle else items
    size_of = weigh or (lambda item: _size(item.path))
    current: list[Item] = []
    current_bytes = per_shard
    index = first
    for item in order:
        size = size_of(item) if shard_bytes is not None else 0
        full_by_count = shard_size is not None and len(current) >= shard_size
        # cut where the shard lands nearest the target: over by less than half an item rather than
        # always under, which would leave every shard short of it
        full_by_bytes = shard_bytes is not None and current and current_bytes + size / 2 > shard_bytes
        if full_by_count or full_by_bytes:
            yield ShardSpec(index, shard_name(index, suffix), tuple(current))
            index += 1
            current, current_bytes = [], per_shard
        current.append(item)
        current_bytes += size
    if current:
        yield ShardSpec(index, shard_name(index, suffix), tuple(current))


def _shuffled(items: Iterable[Item], seed: int) -> Iterator[Item]:
    """The items in the order of np.random.default_rng(seed).permutation(len(items)), held as one
    block of UTF-8 text (a record per item: where its path starts, relpath, key, label) and an
    offset array, not as objects, which would take several times the memory."""
    import numpy as np  # (here: only --shuffle needs numpy, and the pack driver does not import it)

    block = bytearray()
    offsets = [0]
    heads: dict[tuple[str, bool], int] = {}  # the part of each path before its relpath: the root
    for item in items:
        joined = item.path.endswith(item.relpath)
        head = item.path[: len(item.path) - len(item.relpath)] if joined else item.path
        head_id = heads.setdefault((head, joined), len(heads))
        label = "" if item.label is None else str(item.label)
        # (a payload is JSON: no raw NUL in it)
        block += f"{head_id}\0{item.relpath}\0{item.key}\0{label}\0{payload(item)}\0".encode("utf-8", "surrogateescape")
        offsets.append(len(block))
    ends = np.array(offsets, dtype=np.int64)
    del offsets
    by_id = list(heads)
    view = memoryview(block)
    for position in np.random.default_rng(seed).permutation(len(ends) - 1).tolist():
        text = bytes(view[ends[position] : ends[position + 1] - 1]).decode("utf-8", "surrogateescape")
        head_text, relpath, key, label_text, extra = text.split("\0")
        head, joined = by_id[int(head_text)]
        number = int(label_text) if label_text else None
        yield with_payload(Item(head + relpath if joined else head, relpath, key, number), extra)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _size_and_mtime(path: str) -> tuple[int, int]:
    if is_remote(path):  # a URL or an object: nothing on this disk to stat (its bytes are not known up front)
        return -1, -1
    stamp = file_stamp(path)
    return (-1, -1) if stamp is None else (stamp[0], stamp[1])


def settings_hash(settings: dict[str, Any]) -> str:
    return json_sha256(settings)


class PlanDigest:
    """The plan's fingerprint, built shard by shard as the plan is cut: the whole plan's hash
    (in the manifest; a finished pack is resumed only by the same one) and each shard's own (in
    its done marker; an interrupted pack reuses a shard only if its files are unchanged)."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings_hash(settings)
        self._whole = hashlib.sha256(sorted_json(settings))

    def add(self, spec: ShardSpec) -> str:
        """Fold in the next shard; returns that shard's own hash."""
        own = hashlib.sha256(self.settings.encode())
        lines = [spec.name.encode()]
        for item in spec.items:
            size, mtime = _size_and_mtime(item.path)  # a changed source must not reuse old shards
            text = f"\0{item.relpath}\0{item.key}\0{item.label}\0{size}\0{mtime}"
            extra = payload(item)
            if extra:  # a changed caption or column rewrites the shard (and none changes nothing)
                text += f"\0{extra}"
            if item.sidecars:  # their files, checked as the image is
                folder = os.path.dirname(item.path)
                for _, name in sorted(item.sidecars.items()):  # (in the payload's order)
                    text += "\0{}\0{}".format(*_size_and_mtime(os.path.join(folder, name)))
            lines.append(text.encode("utf-8", "surrogateescape"))
        for line in lines:
            self._whole.update(line)
            own.update(line)
        return own.hexdigest()

    def hexdigest(self) -> str:
        return self._whole.hexdigest()


def fingerprint(settings: dict[str, Any], specs: Iterable[ShardSpec]) -> str:
    """One hash of the settings and the exact plan."""
    digest = PlanDigest(settings)
    for spec in specs:
        digest.add(spec)
    return digest.hexdigest()

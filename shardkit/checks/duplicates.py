"""Exact and near duplicates within and across sources, and train/test leakage.

A source is an image folder (or list file), walked as pack walks it, or a packed output (a folder
with manifest.json, or a URL). A folder's files are each read once: the bytes hashed (sha256:
exact copies are the same bytes) and, with `near`, decoded at a reduced DCT scale to the DCT hash
of a grey thumbnail (packing/hashes.py). A packed output's records already carry both (the source
file's sha256 and the picture's DCT hash, from pack): they come from its index.parquet, no shard
read and nothing decoded; an output whose records carry no hashes is read and hashed record by
record. Near hashes are grouped through multi-index hashing (core/phash.py), not all pairs. Files
that are one file (symlinks, hard links) count once. A group whose files come from more than one
source is leakage. Nothing here prints.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..core.config import DEFAULT_DEDUP_THRESHOLD, DEFAULT_MAX_PIXELS, check_dedup_threshold, check_workers
from ..core.errors import ConfigError, Failure, ImageError, ManifestError, ShardFormatError, ShardReadError, describe
from ..core.manifest import MANIFEST_NAME, SHA256_HEX, sha256_file
from ..core.phash import PHASH_HEX, dct_hash, distances, near_components
from ..core.safeio import check_regular, read_regular
from ..packing.dedup import hash_paths
from ..packing.encode import picture_hash
from ..packing.hashes import MAX_FILE_BYTES, grey_thumbnail
from ..packing.sources import SourceWalk, walk
from ..readers.dataset import open_shards
from ..storage.urls import is_remote
from .verify_index import index_claims


@dataclass
class DuplicateGroup:
    kind: str  # "exact" (the same bytes) or "near" (DCT hashes within the threshold)
    files: list[str]  # as typed: the source joined with the file's path in it
    sources: list[int]  # which source each file came from
    distance: int = 0  # near: the largest distance of a file's hash to the first file's
    match: str = "bytes"  # exact: "bytes", or "same file" (one file reached from two sources by links)

    @property
    def leakage(self) -> bool:
        return len(set(self.sources)) > 1

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"kind": self.kind, "files": self.files, "leakage": self.leakage}
        if self.kind == "exact":
            row["match"] = self.match
        else:
            row["distance"] = self.distance
        return row


@dataclass
class DuplicatesReport:
    sources: list[str]
    files: int  # distinct files read (a file reached twice, by a link, counts once)
    groups: list[DuplicateGroup]
    failures: list[Failure] = field(default_factory=list)
    near: bool = False
    threshold: int | None = None
    seconds: float = 0.0
    against: int = 0  # the last `against` sources were compared against the others
    records: dict[str, tuple[str, str]] = field(default_factory=dict)  # a packed record's name -> (output, key)
    storage_options: dict[str, Any] | None = None

    def count(self, kind: str) -> int:
        return sum(1 for group in self.groups if group.kind == kind)

    def to_json(self) -> dict[str, Any]:
        split = len(self.sources) - self.against
        return {
            "sources": self.sources[:split], **({"against": self.sources[split:]} if self.against else {}),
            "files": self.files, "near": self.near, "threshold": self.threshold,
            "groups": [group.to_json() for group in self.groups],
            "leakage": sum(1 for group in self.groups if group.leakage),
            "errors": [failure.to_json() for failure in self.failures], "seconds": round(self.seconds, 3),
        }  # fmt: skip


@dataclass
class _Found:
    """Every file (or record) to compare, by position: its name as shown, its source, its hashes."""

    shown: list[str] = field(default_factory=list)
    origin: list[int] = field(default_factory=list)
    digests: list[str | None] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    hashed: list[bool] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)
    aliases: dict[int, list[tuple[str, int]]] = field(default_factory=dict)  # one file reached from another source
    records: dict[str, tuple[str, str]] = field(default_factory=dict)  # shown -> (output, key), for the sheet

    def add(self, shown: str, origin: int, digest: str | None, value: int | None) -> None:
        self.shown.append(shown)
        self.origin.append(origin)
        self.digests.append(digest)
        self.hashes.append(0 if value is None else value)
        self.hashed.append(value is not None)


def find_duplicates(
    sources: Sequence[str | os.PathLike[str]],
    *,
    against: Sequence[str | os.PathLike[str]] = (),
    near: bool = False,
    threshold: int = DEFAULT_DEDUP_THRESHOLD,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> DuplicatesReport:
    """Groups of exact duplicates (the same bytes) and, with `near`, of near duplicates (DCT hashes
    within `threshold` bits) among the images of `sources` (folders or list files, walked as pack
    walks them, or packed outputs), and the files that could not be read, decoded or hashed. With
    `against`, those are sources too, and only the groups that hold a file of `sources` and one of
    `against` are reported: what of one set is in the other (train against val)."""
    if not sources:
        raise ConfigError("give at least one source folder")
    check_dedup_threshold(threshold)
    check_workers(workers)
    started = time.perf_counter()
    typed = [os.fspath(source) for source in [*sources, *against]]
    packed = [_is_output(source) for source in typed]
    walks = {n: walk(source, labels="none", keys=False) for n, source in enumerate(typed) if not packed[n]}
    found = _Found()
    files = _Files()
    for number, source in enumerate(typed):
        if packed[number]:
            _add_records(found, number, source, near, max_pixels, storage_options)
        else:
            _add_files(found, files, number, source, walks[number])
    _hash_files(found, files, near, max_pixels, workers, progress)
    groups = _groups(found, near, threshold)
    if against:
        split = len(sources)
        groups = [g for g in groups if min(g.sources) < split <= max(g.sources)]
    groups.sort(key=lambda group: (-len(group.files), group.kind, group.files[0]))
    return DuplicatesReport(
        typed, len(found.shown), groups, found.failures, near, threshold if near else None,
        time.perf_counter() - started, against=len(against), records=found.records, storage_options=storage_options,
    )  # fmt: skip


@dataclass
class _Files:
    """The folders' files to hash, together in one pool: each one's path, its place in `_Found`,
    and where each file (device, inode) was first reached."""

    paths: list[str] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    first_of: dict[tuple[int, int], int] = field(default_factory=dict)


def _add_files(found: _Found, files: _Files, number: int, source: str, walked: SourceWalk) -> None:
    """Source `number`'s walked files into `found`, to be hashed; a file already reached (a link)
    is not hashed again, and what could not be read or walked is a failure."""
    for item in walked.items:
        if walked.source.downloads:  # a table of URLs: each row's image, downloaded when hashed
            files.positions.append(len(found.shown))
            files.paths.append(item.path)
            found.add(item.relpath, number, None, None)
            continue
        try:
            status = os.stat(item.path)
        except OSError as error:
            found.failures.append(Failure(os.path.join(source, item.relpath), "read", describe(error)))
            continue
        first = files.first_of.get((status.st_dev, status.st_ino))
        if first is not None:
            # A link to a file already taken is that file: within a source it counts once (not
            # a duplicate), but one file in train and val (a symlink farm, cp -al) is leakage.
            taken = [found.origin[first], *(o for _, o in found.aliases.get(first, []))]
            if number not in taken:
                found.aliases.setdefault(first, []).append((os.path.join(source, item.relpath), number))
            continue
        files.first_of[(status.st_dev, status.st_ino)] = len(found.shown)
        files.positions.append(len(found.shown))
        files.paths.append(item.path)
        found.add(os.path.join(source, item.relpath), number, None, None)
    found.failures.extend(walked.skipped)


def _hash_files(
    found: _Found,
    files: _Files,
    near: bool,
    max_pixels: int,
    workers: int | None,
    progress: Callable[[int], None] | None,
) -> None:
    """Hash the folders' files in one pool, into their places in `found`; a file that could not
    be hashed is a failure."""
    table = hash_paths(files.paths, near, max_pixels, workers, progress)
    for i, at in enumerate(files.positions):
        found.digests[at] = table.digests[i]
        found.hashes[at], found.hashed[at] = int(table.hashes[i]), bool(table.hashed[i])
    found.failures += [Failure(found.shown[files.positions[i]], stage, why) for i, stage, why in table.problems]


def _groups(found: _Found, near: bool, threshold: int) -> list[DuplicateGroup]:
    """The groups of `found`: exact copies, one file reached from two sources with no other copy,
    and with `near` the near copies; each file followed by its links from other sources."""

    def files(members: list[int]) -> tuple[list[str], list[int]]:
        """The files at `members`, each followed by its links from other sources."""
        rows = [row for at in members for row in [(found.shown[at], found.origin[at]), *found.aliases.get(at, [])]]
        return [name for name, _ in rows], [number for _, number in rows]

    hashes = np.array(found.hashes, np.uint64)
    groups = []
    exact = exact_sets(found.digests)
    for members in exact:
        names, origins = files(members)
        groups.append(DuplicateGroup("exact", names, origins))
    copied = {at for members in exact for at in members}
    for at in found.aliases:  # one file reached from two sources, with no other copy
        if at not in copied:
            names, origins = files([at])
            groups.append(DuplicateGroup("exact", names, origins, match="same file"))
    if near:
        for members in near_sets(found.digests, hashes, np.array(found.hashed, bool), threshold):
            distance = int(distances(hashes[members], hashes[members[0]]).max())
            names, origins = files(members)
            groups.append(DuplicateGroup("near", names, origins, distance=distance))
    return groups


def exact_sets(digests: Sequence[str | None]) -> list[list[int]]:
    """Positions sharing a digest (two or more), each set in order."""
    by_digest: dict[str, list[int]] = {}
    for at, digest in enumerate(digests):
        if digest is not None:
            by_digest.setdefault(digest, []).append(at)
    return [members for members in by_digest.values() if len(members) > 1]


def near_sets(digests: Sequence[str | None], hashes: np.ndarray, hashed: np.ndarray, threshold: int) -> list[list[int]]:
    """Positions joined through DCT hashes within `threshold` bits (transitively), two or more
    contents to a set; the search runs over distinct contents (one hash per digest), and a set then
    lists every copy of each of its contents, in order."""
    firsts: dict[str, int] = {}
    copies: dict[int, list[int]] = {}
    for at, digest in enumerate(digests):
        if digest is not None and hashed[at]:
            first = firsts.setdefault(digest, at)
            copies.setdefault(first, []).append(at)
    members = np.array(sorted(copies), np.int64)
    if len(members) < 2:
        return []
    group_of = near_components(hashes[members], threshold)
    joined: dict[int, list[int]] = {}
    for i, group in enumerate(group_of.tolist()):
        joined.setdefault(group, []).append(i)
    return [
        sorted(at for i in component for at in copies[int(members[i])])
        for component in joined.values()
        if len(component) > 1
    ]


def _is_output(source: str) -> bool:
    """A packed output (its manifest beside the shards, or a URL) rather than a folder of images."""
    if is_remote(source):
        return True
    path = Path(source)
    return (path / MANIFEST_NAME).is_file() or (path.name == MANIFEST_NAME and path.is_file())


def _add_records(
    found: _Found, number: int, source: str, near: bool, max_pixels: int, storage_options: dict[str, Any] | None
) -> None:
    """A packed output's records and their hashes: from its index when it has them, else from each
    record's metadata, else (an output whose records carry no hashes) from the record's own bytes."""
    shown = source.removesuffix("/" + MANIFEST_NAME).rstrip("/")
    try:
        dataset = open_shards(source, decode="bytes", max_pixels=max_pixels, storage_options=storage_options)
    except (ManifestError, ShardFormatError, ShardReadError, OSError) as error:
        raise ConfigError(f"{shown}: cannot open the packed output ({describe(error)})") from None
    try:
        rows = _index_rows(dataset, shown)
        if rows is None:
            rows = list(_record_rows(dataset, near, max_pixels, found, shown))
        elif near:  # records with no picture hash in the index (kept untouched by --encode original)
            rows = [row if row[2] is not None else _hashed_row(dataset, row, max_pixels, found, shown) for row in rows]
        for key, digest, phash in rows:
            name = f"{shown}#{key}"
            found.records[name] = (source, key)
            found.add(name, number, digest, None if phash is None else int(phash, 16))
    finally:
        dataset.close()


def _index_rows(dataset: Any, shown: str) -> list[tuple[str, str | None, str | None]] | None:
    """(key, source sha256, DCT hash) of every record, from a local output's index.parquet; None
    when it has none, or has not the columns, or is not the file the manifest names. An index
    whose metadata claims other rows than the manifest's records (a re-sealed manifest vouches for
    any bytes) is refused before a row is read: ConfigError."""
    manifest = dataset.manifest
    index = manifest.index
    # (every clip of a video keeps the video's sha256, what an append tells it by: clips are compared
    # by their own bytes, read from the shards)
    if index is None or dataset.remote is not None or manifest.holds_clips:
        return None
    path = Path(dataset.folder) / index.name
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if check_regular(path).st_size != index.bytes or sha256_file(path) != index.sha256:
            return None
        handle = pq.ParquetFile(path)
        wrong = index_claims(handle, manifest, index.bytes)
        if wrong is not None:
            raise ConfigError(f"{shown}/{index.name}: {wrong}; not read")
        schema = handle.schema_arrow
        wanted = ("key", "source_sha256", "phash")
        if any(
            len(schema.get_all_field_indices(name)) != 1 or schema.field(name).type != pa.string() for name in wanted
        ):
            return None  # an index without the hashes, or a stranger's with other types
        table = handle.read(columns=list(wanted))
    except (OSError, ValueError):  # (pyarrow's errors for a damaged file are these)
        return None
    keys, digests, phashes = (table.column(name).to_pylist() for name in ("key", "source_sha256", "phash"))
    if None in keys or any(digest is None or not SHA256_HEX.fullmatch(digest) for digest in digests):
        return None
    return [
        (key, digest, phash if phash is not None and PHASH_HEX.fullmatch(phash) else None)
        for key, digest, phash in zip(keys, digests, phashes, strict=True)
    ]


def _record_rows(
    dataset: Any, near: bool, max_pixels: int, found: _Found, shown: str
) -> Iterator[tuple[str, str | None, str | None]]:
    """(key, sha256, DCT hash) of each record, read from the shards: the metadata's when it holds
    them, else the record's own (an image stored untouched has its source's bytes)."""
    for shard, info in enumerate(dataset.manifest.shards):
        read = 0
        try:
            for record in dataset.records(shard):
                read += 1
                meta = record.meta
                digest = None if dataset.manifest.holds_clips else meta.get("source_sha256")
                if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
                    digest = hashlib.sha256(record.data).hexdigest()
                phash = meta.get("phash")
                if not isinstance(phash, str) or not PHASH_HEX.fullmatch(phash):
                    phash = None
                if near and phash is None:
                    try:
                        phash = _record_hash(record.data, max_pixels)
                    except ValueError as error:
                        found.failures.append(Failure(f"{shown}#{record.key}", "decode", str(error)))
                yield record.key, digest, phash
            if read != info.count:  # a shard cut short (or zeroed: a tar of zeros reads as empty)
                raise ShardFormatError(f"holds {read:,} records, the manifest says {info.count:,}")
        except ShardFormatError as error:
            found.failures.append(Failure(f"{shown}/{info.name}", "read", describe(error)))


def _hashed_row(
    dataset: Any, row: tuple[str, str | None, str | None], max_pixels: int, found: _Found, shown: str
) -> tuple[str, str | None, str | None]:
    """An index row without a picture hash, hashed from its record (read by key, decoded small)."""
    key, digest, _ = row
    try:
        return key, digest, _record_hash(dataset.get(key).image, max_pixels)
    except (ValueError, KeyError, ShardReadError) as error:
        found.failures.append(Failure(f"{shown}#{key}", "decode", describe(error)))
        return row


def _record_hash(data: bytes, max_pixels: int) -> str:
    if data[:6] == b"\x93NUMPY":
        from PIL import Image

        from ..readers.decode import decode_npy

        try:
            return picture_hash(Image.fromarray(decode_npy(data, max_pixels)))
        except ImageError as error:
            raise ValueError(f"cannot decode ({error.reason})") from None
    return f"{dct_hash(grey_thumbnail(data, max_pixels)):016x}"


def contact_sheet(report: DuplicatesReport, path: str | os.PathLike[str], groups: int = 8, per_group: int = 6) -> int:
    """A PNG (or JPEG, by the suffix) of the leakage groups first, then the largest: a row per
    group, a 128 px thumbnail per file with its name under it. Returns the rows drawn."""
    from PIL import Image, ImageDraw

    chosen = sorted(report.groups, key=lambda g: (not g.leakage, -len(g.files)))[:groups]
    cell, label = 128, 14
    columns = max((min(len(group.files), per_group) for group in chosen), default=1)
    sheet = Image.new("RGB", (columns * (cell + 8) + 8, max(1, len(chosen)) * (cell + label + 24) + 8), "white")
    draw = ImageDraw.Draw(sheet)
    opened: dict[str, Any] = {}  # the packed outputs records are drawn from
    try:
        _draw_rows(report, chosen, sheet, draw, opened, cell, label, per_group)
    finally:
        for dataset in opened.values():
            dataset.close()
    sheet.save(path)
    return len(chosen)


def _draw_rows(
    report: DuplicatesReport, chosen: list[DuplicateGroup], sheet: Any, draw: Any, opened: dict[str, Any],
    cell: int, label: int, per_group: int,
) -> None:  # fmt: skip
    from PIL import Image

    from ..core.codecs import RECORD_FORMATS
    from ..readers.decode import decode_npy

    def picture(name: str) -> Image.Image:
        if name in report.records:
            output, key = report.records[name]
            if output not in opened:
                opened[output] = open_shards(output, decode="bytes", storage_options=report.storage_options)
            data = opened[output].get(key).image
        else:
            data = read_regular(name, MAX_FILE_BYTES)
        if data[:6] == b"\x93NUMPY":
            return Image.fromarray(decode_npy(data))
        image = Image.open(io.BytesIO(data), formats=RECORD_FORMATS)
        image.draft("RGB", (cell, cell))
        return image.convert("RGB")

    for row, group in enumerate(chosen):
        top = 8 + row * (cell + label + 24)
        title = f"{group.kind}{' (leakage)' if group.leakage else ''}: {len(group.files)} files"
        draw.text((8, top), title, fill="red" if group.leakage else "black")
        shown = group.files[:per_group]
        for column, (name, text) in enumerate(zip(shown, cell_labels(shown), strict=True)):
            left = 8 + column * (cell + 8)
            try:
                thumbnail = picture(name)
                thumbnail.thumbnail((cell, cell))
                sheet.paste(thumbnail, (left, top + 14))
            except (OSError, ValueError, KeyError, ImageError, ShardReadError, Image.DecompressionBombError):
                draw.rectangle((left, top + 14, left + cell, top + 14 + cell), outline="grey")
            draw.text((left, top + 16 + cell), text, fill="black")


LABEL_CHARS = 20  # what fits under a 128 px thumbnail in Pillow's default font


def cell_labels(names: Sequence[str], width: int = LABEL_CHARS) -> list[str]:
    """Each file's name as it fits under its thumbnail, keeping what tells a group's files apart:
    their base names (their whole paths when base names repeat), a prefix they all
    share given up first for "…", then the middle of what is left. The end stays: where copies'
    names differ (a number, a suffix) far more often than at their start."""
    bases = [os.path.basename(name) for name in names]
    if len(set(bases)) < len(bases):  # the same name in other folders: the paths, less what they share
        bases = list(names)
    # by characters on purpose: copies share prefixes within a name too ("n01440764_00")
    shared = len(os.path.commonprefix(bases)) if len(bases) > 1 else 0  # noqa: RUF071
    labels = []
    for base in bases:
        text = base
        if len(text) > width and shared:
            text = "…" + text[min(shared, len(text) - width + 1) :]  # no more of the prefix than needed
        if len(text) > width:
            head = (width - 1) // 3
            text = text[:head] + "…" + text[len(text) - (width - 1 - head) :]
        labels.append(text)
    return labels

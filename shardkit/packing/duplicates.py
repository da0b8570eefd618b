"""Exact and near duplicates within and across source folders, and train/test leakage.

Each file is read once: its bytes are hashed (sha256: exact duplicates are the same bytes), and
with `near`, decoded at a reduced DCT scale (libjpeg's 1/2 to 1/8, through Pillow's draft) to a
32x32 grey thumbnail whose DCT hash (core/phash.py) is compared with every other's through
multi-index hashing, not all pairs. Files that are one file (symlinks, hard links) count once.
A group whose files come from more than one source is leakage. Nothing here prints.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.config import DEFAULT_MAX_PIXELS, check_workers
from ..core.errors import ConfigError, Failure, describe
from ..core.executors import default_workers, map_local
from ..core.phash import THUMBNAIL, dct_hash, distances, near_components
from ..core.safeio import read_regular
from .discover import walk

# Below this short side a thumbnail says too little: such images are reported, not hashed.
MIN_SIDE = 16
# Measured on planted copies of real photos (tests/test_duplicates.py, README): re-encodes, half
# size, PNG, grey and brighter copies land within 4 bits, 3 % crops within 10; distinct photos of
# the ImageNet sample are 18 or more bits apart.
DEFAULT_THRESHOLD = 10
MAX_FILE_BYTES = 1 << 30
CHUNK_FILES = 256


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

    def count(self, kind: str) -> int:
        return sum(1 for group in self.groups if group.kind == kind)

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": self.sources, "files": self.files, "near": self.near, "threshold": self.threshold,
            "groups": [group.to_json() for group in self.groups],
            "leakage": sum(1 for group in self.groups if group.leakage),
            "errors": [failure.to_json() for failure in self.failures], "seconds": round(self.seconds, 3),
        }  # fmt: skip


def _hash_files(job: tuple[list[str], bool, int]) -> list[tuple[str | None, int | None, str | None]]:
    """(sha256, DCT hash or None, error or None) per file."""
    paths, near, max_pixels = job
    return [_hash_file(path, near, max_pixels) for path in paths]


def _hash_file(path: str, near: bool, max_pixels: int) -> tuple[str | None, int | None, str | None]:
    try:
        data = read_regular(path, MAX_FILE_BYTES)
    except OSError as error:
        return None, None, f"cannot read ({describe(error)})"
    digest = hashlib.sha256(data).hexdigest()
    if not near:
        return digest, None, None
    try:
        thumbnail = _thumbnail(data, max_pixels)
    except ValueError as error:
        return digest, None, str(error)
    return digest, dct_hash(thumbnail), None


def _thumbnail(data: bytes, max_pixels: int) -> np.ndarray:
    """A THUMBNAIL x THUMBNAIL grey thumbnail, decoded at the smallest DCT scale that keeps at
    least twice its size (JPEG); ValueError with the reason when the image cannot give one."""
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > max_pixels:
                raise ValueError(f"{width}x{height} is over the limit of {max_pixels:,} pixels")
            if min(width, height) < MIN_SIDE:
                raise ValueError(f"too small to hash ({width}x{height}, under {MIN_SIDE} px a side)")
            if image.format == "JPEG":
                image.draft("L", (2 * THUMBNAIL, 2 * THUMBNAIL))
            grey = image.convert("L").resize((THUMBNAIL, THUMBNAIL), Image.Resampling.BOX)
            return np.asarray(grey, np.float64)
    except ValueError:
        raise
    except Exception as error:  # Pillow raises many types for a bad file: each is "cannot decode"
        raise ValueError(f"cannot decode ({describe(error, with_type=True)})") from None


def find_duplicates(
    sources: Sequence[str | os.PathLike[str]],
    *,
    near: bool = False,
    threshold: int = DEFAULT_THRESHOLD,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int], None] | None = None,
) -> DuplicatesReport:
    """Groups of exact duplicates (the same bytes) and, with `near`, of near duplicates (DCT hashes
    within `threshold` bits) among the images of `sources` (folders or list files, walked as pack
    walks them), and the files that could not be read, decoded or hashed."""
    if not sources:
        raise ConfigError("give at least one source folder")
    if not 0 <= threshold <= 32:
        raise ConfigError(f"threshold must be 0 to 32 bits, not {threshold}")
    check_workers(workers)
    started = time.perf_counter()
    typed = [os.fspath(source) for source in sources]
    walks = [walk(source, labels="none", keys=False) for source in typed]  # each refused here if bad
    paths: list[str] = []
    shown: list[str] = []
    origin: list[int] = []
    failures: list[Failure] = []
    first_of: dict[tuple[int, int], int] = {}  # a file (device, inode) -> where it was first reached
    aliases: dict[int, list[tuple[str, int]]] = {}  # the same file reached from another source
    for number, (source, found) in enumerate(zip(typed, walks, strict=True)):
        for item in found.items:
            try:
                status = os.stat(item.path)
            except OSError as error:
                failures.append(Failure(os.path.join(source, item.relpath), "read", describe(error)))
                continue
            first = first_of.get((status.st_dev, status.st_ino))
            if first is not None:
                # A link to a file already taken is that file: within a source it counts once (not
                # a duplicate), but one file in train and val (a symlink farm, cp -al) is leakage.
                if number != origin[first] and all(number != o for _, o in aliases.get(first, [])):
                    aliases.setdefault(first, []).append((os.path.join(source, item.relpath), number))
                continue
            first_of[(status.st_dev, status.st_ino)] = len(paths)
            paths.append(item.path)
            shown.append(os.path.join(source, item.relpath))
            origin.append(number)
        failures.extend(found.skipped)
    chunks = [(paths[i : i + CHUNK_FILES], near, max_pixels) for i in range(0, len(paths), CHUNK_FILES)]
    digests: list[str | None] = [None] * len(paths)
    hashes = np.zeros(len(paths), np.uint64)
    hashed = np.zeros(len(paths), bool)
    done = 0
    for index, results in map_local(_hash_files, chunks, workers or default_workers()):
        for offset, (digest, value, why) in enumerate(results):
            at = index * CHUNK_FILES + offset
            digests[at] = digest
            if value is not None:
                hashes[at], hashed[at] = value, True
            if why is not None:
                failures.append(Failure(shown[at], "decode" if digest else "read", why))
        done += len(results)
        if progress is not None:
            progress(done)

    def files(members: list[int]) -> tuple[list[str], list[int]]:
        """The files at `members`, each followed by its links from other sources."""
        found = [row for at in members for row in [(shown[at], origin[at]), *aliases.get(at, [])]]
        return [name for name, _ in found], [number for _, number in found]

    groups = _exact_groups(digests, files)
    if near:
        groups += _near_groups(digests, hashes, hashed, files, threshold)
    groups.sort(key=lambda group: (-len(group.files), group.kind, group.files[0]))
    return DuplicatesReport(typed, len(paths), groups, failures, near, threshold if near else None,
                            time.perf_counter() - started)  # fmt: skip


def _exact_groups(
    digests: list[str | None], files: Callable[[list[int]], tuple[list[str], list[int]]]
) -> list[DuplicateGroup]:
    """Files with the same bytes; a file reached from two sources (a link) is a group of its own
    ("same file")."""
    by_digest: dict[str, list[int]] = {}
    for at, digest in enumerate(digests):
        if digest is not None:
            by_digest.setdefault(digest, []).append(at)
    groups = []
    for members in by_digest.values():
        names, sources = files(members)
        if len(names) > 1:
            groups.append(DuplicateGroup("exact", names, sources, match="bytes" if len(members) > 1 else "same file"))
    return groups


def _near_groups(
    digests: list[str | None], hashes: np.ndarray, hashed: np.ndarray,
    files: Callable[[list[int]], tuple[list[str], list[int]]], threshold: int,
) -> list[DuplicateGroup]:  # fmt: skip
    """Near groups over distinct contents: one hash per set of identical files (those are the exact
    groups), joined through every pair within the threshold (union-find); a group lists every file
    of its contents, so a near group may hold exact copies too."""
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
    groups = []
    for component in joined.values():
        if len(component) < 2:
            continue
        contents = [at for i in component for at in copies[int(members[i])]]
        distance = int(distances(hashes[contents], hashes[contents[0]]).max())
        names, sources = files(contents)
        groups.append(DuplicateGroup("near", names, sources, distance=distance))
    return groups


def contact_sheet(report: DuplicatesReport, path: str | os.PathLike[str], groups: int = 8, per_group: int = 6) -> int:
    """A PNG (or JPEG, by the suffix) of the leakage groups first, then the largest: a row per
    group, a 128 px thumbnail per file with its name under it. Returns the rows drawn."""
    from PIL import Image, ImageDraw

    chosen = sorted(report.groups, key=lambda g: (not g.leakage, -len(g.files)))[:groups]
    cell, label = 128, 14
    columns = max((min(len(group.files), per_group) for group in chosen), default=1)
    sheet = Image.new("RGB", (columns * (cell + 8) + 8, max(1, len(chosen)) * (cell + label + 24) + 8), "white")
    draw = ImageDraw.Draw(sheet)
    for row, group in enumerate(chosen):
        top = 8 + row * (cell + label + 24)
        title = f"{group.kind}{' (leakage)' if group.leakage else ''}: {len(group.files)} files"
        draw.text((8, top), title, fill="red" if group.leakage else "black")
        for column, name in enumerate(group.files[:per_group]):
            left = 8 + column * (cell + 8)
            try:
                with Image.open(name) as image:
                    image.draft("RGB", (cell, cell))
                    thumbnail = image.convert("RGB")
                    thumbnail.thumbnail((cell, cell))
                sheet.paste(thumbnail, (left, top + 14))
            except (OSError, ValueError):
                draw.rectangle((left, top + 14, left + cell, top + 14 + cell), outline="grey")
            draw.text((left, top + 16 + cell), os.path.basename(name)[:20], fill="black")
    sheet.save(path)
    return len(chosen)

"""One table of URLs in parts: a local folder holding only table files, or a glob of them (LAION's
parquet parts, a DataComp pool, a Spark job's output), read as one source (url_table.py walks it).

The parts are taken in natural order of their paths (`part-2` before `part-10`, digits compared
as numbers), each read in row order. A Spark or Hadoop folder's own files (`_SUCCESS`, `.crc`
checksums, any hidden or `_`-prefixed name) are not parts and are passed over; any other file
that is not a table is refused by name, since a stray file may be a part in a format not read.
A folder that holds images, sub-folders or a `metadata.*` table is not a folder of parts: the
folder and table conventions read it.
"""

from __future__ import annotations

import glob
import os
import re

from ...core.errors import SourceError
from ...storage.urls import is_remote
from .folder import IMAGE_EXTENSIONS, VIDEO_SUFFIXES
from .item import display
from .rows import AUTO_TABLES, table_kind

__all__ = ["glob_parts", "is_glob", "part_key_format", "part_name", "table_folder_parts"]

_MAGIC = re.compile(r"[*?[]")  # what makes a path a glob (glob.has_magic's characters)
_DIGITS = re.compile(r"([0-9]+)")
PART_DIGITS = 5  # a part's place in a key, at least: `00003-000000042`
ROW_DIGITS = 9  # a row's place in a key, at least (a single table's keys: `000000042`)
_TABLE_SUFFIXES = ".parquet, .csv, .tsv or .jsonl (a text table may be gzipped)"


def is_glob(source: str) -> bool:
    """Whether a local source is a glob of table parts rather than a path (one that exists is a
    path, whatever characters it holds)."""
    return _MAGIC.search(source) is not None and not os.path.lexists(source)


def is_remote_glob(source: str) -> bool:
    """An object-store source with glob characters: a URL at http(s) is never one (`?` starts its
    query)."""
    return is_remote(source) and not source.lower().startswith(("http://", "https://")) and "*" in source


def not_a_part(name: str) -> bool:
    """A file of a Spark or Hadoop folder that is not one of its parts: `_SUCCESS`, `_metadata`,
    `.part-0.parquet.crc`, hidden files."""
    return name.startswith((".", "_")) or name.lower().endswith(".crc")


def natural_order(path: str) -> tuple[list[int | str], str]:
    """A path's place among the parts: digit runs compared as numbers, ties by the text."""
    pieces: list[int | str] = [int(piece) if i % 2 else piece for i, piece in enumerate(_DIGITS.split(path))]
    return pieces, path


def table_folder_parts(root: str) -> list[str] | None:
    """The table parts of the local folder `root`, in natural order, when it is a folder of parts:
    table files only (beside a Spark job's own files), with no sub-folder, image, video or
    `metadata.*` table. None when it is another kind of folder (or cannot be listed: the folder
    convention says why). SourceError naming a file that is neither a part nor a Spark file."""
    try:
        entries = sorted(os.scandir(root), key=lambda entry: natural_order(entry.name))
    except OSError:
        return None
    parts: list[str] = []
    others: list[str] = []
    for entry in entries:
        name = entry.name
        if not_a_part(name):
            continue
        suffix = os.path.splitext(name)[1].lower()
        if name in AUTO_TABLES or suffix in IMAGE_EXTENSIONS or suffix in VIDEO_SUFFIXES or _is_dir(entry):
            return None
        (parts if table_kind(name) is not None else others).append(os.path.join(root, name))
    if parts and others:
        raise SourceError(
            f"{display(others[0])}: not a table part; a folder of URL tables holds {_TABLE_SUFFIXES} files"
        )
    return parts or None


def glob_parts(pattern: str) -> list[str]:
    """The table files a local glob matches, in natural order (a Spark job's own files passed
    over); SourceError when it matches none, or a folder or a file that is not a table."""
    parts: list[str] = []
    for path in sorted(glob.glob(pattern), key=natural_order):
        if not_a_part(os.path.basename(path)):
            continue
        if os.path.isdir(path):
            raise SourceError(f"{display(path)}: a folder; a glob of a table's parts names its files")
        if table_kind(path) is None:
            raise SourceError(f"{display(path)}: not a table part; a glob of URL tables names {_TABLE_SUFFIXES} files")
        parts.append(path)
    if not parts:
        raise SourceError(f"{display(pattern)}: no table part matches (quote a glob, so the shell leaves it whole)")
    return parts


def part_name(path: str, source: str) -> str:
    """How errors name a part: its path under the folder, or under a glob's folder part (the
    components before the first with glob characters), so two parts never share a name."""
    if not is_glob(source):
        return os.path.relpath(path, source)
    fixed: list[str] = []
    for component in source.split(os.sep):
        if _MAGIC.search(component):
            break
        fixed.append(component)
    base = os.sep.join(fixed)
    return os.path.relpath(path, base or os.curdir) if base or not source.startswith(os.sep) else path


def part_key_format(rows: list[int]) -> list[str]:
    """Each part's key prefix and row width as a format for its row number: a single table keeps
    its row's place alone (`000000042`, as wide as its last row needs); parts name their place and
    the row (`00003-000000042`), widths fixed by the number of parts and the largest, so keys sort
    as the parts and rows do."""
    width = max(ROW_DIGITS, len(str(max(rows, default=1) - 1)))
    if len(rows) == 1:
        return [f"{{:0{width}d}}"]
    digits = max(PART_DIGITS, len(str(len(rows) - 1)))
    return [f"{number:0{digits}d}-{{:0{width}d}}" for number in range(len(rows))]


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False

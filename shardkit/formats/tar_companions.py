"""The files other readers want around a WebDataset output, which shardkit writes and never reads:
DALI's .idx file beside each tar (`Backend.idx_file`) and wids' shardindex.json beside the whole
output (`Backend.output_files`). `webdataset`'s BACKEND declares them; verify derives both again
and compares.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

from ..core.manifest import WIDS_NAME, ShardInfo, wids_index
from ..core.safeio import open_regular
from .tar_headers import READ_AHEAD, FileBytes, split_name, tar_members

# --- DALI's .idx file ---------------------------------------------------------------------------------
# What DALI's wds2idx writes (v1.2), so DALI need not scan each tar: a first line `v1.2 <samples>`,
# then a line per sample of its members as `<ext> <data offset> <size> <member name>` joined by
# spaces, members grouped as consecutive ones with the same key (hidden files, a name starting
# with '.', and names without an extension left out). DALI splits lines on whitespace, so a tar
# with a member name holding some (a file "my photo.jpg") gets the older v1.1, which DALI also
# reads: the same without names (they only label DALI's samples). shardkit does not read either.


def dali_samples(
    data: FileBytes, where: str, skipped: list[tuple[str, str]] | None = None, unnamed: list[str] | None = None
) -> Iterator[list[tuple[str, int, int, str]]]:
    """Each sample's members (ext, data offset, size, name), grouped as wds2idx groups them (and
    as the reader does, which also leaves out samples with no image member). The members of no
    sample (no extension, hidden: `split_name`) are named in `unnamed` when it is given."""
    members = ((name, offset, size) for name, offset, size, _ in tar_members(data, where, 0, skipped))
    return grouped(members, unnamed)


def grouped(
    members: Iterable[tuple[str, int, int]], unnamed: list[str] | None = None
) -> Iterator[list[tuple[str, int, int, str]]]:
    """dali_samples of a tar's regular-file members, (name, data offset, size) in tar order."""
    group: list[tuple[str, int, int, str]] = []
    key: str | None = None
    for name, offset, size in members:
        split = split_name(name)
        if split is None:
            if unnamed is not None:
                unnamed.append(name)
            continue
        if split[0] != key and group:
            yield group
            group = []
        key = split[0]
        group.append((split[1], offset, size, name))
    if group:
        yield group


def dali_index(path: str, members: list[tuple[str, int, int]] | None = None) -> bytes | None:
    """DALI's index of the tar at `path` (v1.2 byte for byte what wds2idx writes; v1.1 when a
    member name holds whitespace), or None when an extension holds some (no version can say it)
    or the tar has no sample; from `members` (its writer's, all of its regular files) when given,
    else from its headers. Raises ShardFormatError on a damaged tar, OSError when unreadable."""
    if members is not None:
        return dali_index_of(list(grouped(members)))
    fd = open_regular(path)
    try:
        return dali_index_of(list(dali_samples(FileBytes(fd, os.fstat(fd).st_size, READ_AHEAD), path)))
    finally:
        os.close(fd)


def dali_index_of(samples: list[list[tuple[str, int, int, str]]]) -> bytes | None:
    """dali_index from a tar's samples as dali_samples gave them."""
    members = [member for sample in samples for member in sample]
    if not samples or any(_spaced(ext) for ext, _, _, _ in members):
        return None  # (DALI refuses an index of no samples)
    named = not any(_spaced(name) for _, _, _, name in members)
    lines = [f"{'v1.2' if named else 'v1.1'} {len(samples)}"]
    for sample in samples:
        if named:
            lines.append(" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in sample))
        else:
            lines.append(" ".join(f"{ext} {offset} {size}" for ext, offset, size, _ in sample))
    return "".join(line + "\n" for line in lines).encode()


def _spaced(text: str) -> bool:
    return any(c.isspace() for c in text)


# --- wids' shardindex.json ---------------------------------------------------------------------------


def wids_files(shards: list[ShardInfo]) -> list[tuple[str, bytes]]:
    """The output's files for other readers: wids' shardindex.json, so that
    `wids.ShardListDataset(OUT/shardindex.json)` opens the output."""
    return [(WIDS_NAME, wids_index(shards))]

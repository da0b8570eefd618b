"""The names and places of a local folder a pack writes: the output folder, or a bucket's staging
folder. Shards are named `shard-NNNNNN` and their format's suffix; the pack's working folder
`.shardkit/` holds its lock, its state file, the done markers (`done/`), the index parts (`index/`)
and the shards being written (`tmp/`), and is removed when the pack ends. An OSError while writing
any of it is an OutputError that names the folder (`writing`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from ..core.errors import OutputError, describe
from ..core.manifest import CHANGE_NAME as CHANGE_NAME  # (the names live where the reader sees them too)
from ..core.manifest import ERRORS_NAME, INDEX_NAME, MANIFEST_NAME, STATE_DIR
from ..core.manifest import STATE_NAME as STATE_NAME
from ..core.manifest import change_action as change_action
from ..core.manifest import finishing as finishing
from ..formats import output_file_names

LOCK_NAME = "lock"
HASHES_NAME = "hashes.jsonl"  # pack --dedup's hashes as they are taken, for a resume
CLEARING_NAME = "clearing.json"  # what an --overwrite in progress is deleting
NEXT_DIR = "next"  # what a change writes, until its commit renames it into the output
SHARD_PREFIX = "shard-"
# Temporary files of atomic writes that shardkit before 0.2 leaves beside their targets.
_OLD_TEMP_PREFIXES = (f".{MANIFEST_NAME}.", f".{ERRORS_NAME}.")
# what a pack writes beside its shards (and the formats' files for other readers: own_files())
OWN_FILES = (MANIFEST_NAME, ERRORS_NAME, INDEX_NAME)


def shard_name(number: int, suffix: str) -> str:
    return f"{SHARD_PREFIX}{number:06d}{suffix}"


def own_files() -> tuple[str, ...]:
    """The names a pack writes beside its shards: the manifest, errors.jsonl, the index, and the
    files its formats write for other readers (`formats.output_file_names`)."""
    return (*OWN_FILES, *sorted(output_file_names()))


# shard-NNNNNN as pack names it, then -vN where a change of the output (remove) rewrote it
_SHARD_STEM = r"(shard-\d{6,})(?:-v[1-9]\d{0,9})?"


def is_shard_name(name: str) -> bool:
    """A name shardkit gives shards (shard-NNNNNN, a version where a change rewrote it, and a
    format's suffix): the only names a record of the output may make --overwrite delete, besides
    manifest.json and errors.jsonl."""
    from ..formats import FORMATS  # (the registry's modules, imported on first use)

    match = re.fullmatch(rf"{_SHARD_STEM}(\.[a-z0-9]+)", name)
    return match is not None and any(match.group(2) == backend.suffix for backend in FORMATS.values())


def is_idx_name(name: str) -> bool:
    """A name shardkit gives a shard's .idx file for other readers (a tar's, for DALI)."""
    return re.fullmatch(rf"{_SHARD_STEM}\.idx", name) is not None


def shard_number(name: str) -> int:
    """The number in a name shardkit gives a shard (`shard-000012-v3.tar`: 12)."""
    match = re.match(_SHARD_STEM, name)
    if match is None:
        raise ValueError(f"{name!r} is not a name shardkit gives shards")
    return int(match.group(1).removeprefix("shard-"))


def versioned_name(name: str, version: int) -> str:
    """The name of shard `name` rewritten for `version` of its output: shard-000003.tar becomes
    shard-000003-v2.tar (and shard-000003-v2.tar shard-000003-v5.tar): a new file, never the old
    one overwritten, so the version before stays whole until the new manifest is in place."""
    match = re.fullmatch(rf"{_SHARD_STEM}(\.[a-z0-9]+)", name)
    if match is None:
        raise ValueError(f"{name!r} is not a name shardkit gives shards")
    return f"{match.group(1)}-v{version}{match.group(2)}"


def state_dir(output: str | os.PathLike[str]) -> Path:
    return Path(output) / STATE_DIR


def temp_dir(output: str | os.PathLike[str]) -> Path:
    """Where half-written shards live until they are complete."""
    return state_dir(output) / "tmp"


def done_path(output: str | os.PathLike[str], shard: str) -> Path:
    """A shard's done marker: its result, written before the shard is renamed into the output."""
    return state_dir(output) / "done" / f"{shard}.json"


class writing:
    """Turns an OSError while writing the output into an OutputError naming the output and cause."""

    def __init__(self, output: str | os.PathLike[str], what: str) -> None:
        self.output, self.what = output, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> None:
        if isinstance(error, OSError):
            raise output_error(self.output, self.what, error) from None


def output_error(output: str | os.PathLike[str], what: str, error: OSError) -> OutputError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
        return OutputError(f"{output}: {cause} (writing {what}); free some space, then run again with --resume")
    return OutputError(f"{output}: cannot write {what} ({describe(error)})")


def old_temp_file(name: str) -> bool:
    return name.startswith(_OLD_TEMP_PREFIXES) and name.endswith(".tmp")


def remove_old_temp_files(output: Path) -> None:
    """Temporary files that shardkit before 0.2 leaves beside manifest.json when killed."""
    for entry in os.scandir(output):
        if old_temp_file(entry.name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def remove_temp_shards(output: Path) -> None:
    """Half-written shards of workers that are gone (killed, or stopped after a failure)."""
    for path in temp_dir(output).glob("*.tmp"):
        path.unlink(missing_ok=True)


def remove_state(output: Path, keep_lock: bool = False) -> None:
    """Remove the working folder's own files (and the folders, once empty); nothing else. The state
    file goes first: a working folder without one is what a finished pack's cleanup left, which a
    --resume removes, and one with it still has every done marker, which the ledger needs."""
    state = state_dir(output)
    (state / STATE_NAME).unlink(missing_ok=True)
    for folder, pattern in (
        ("done", "*.json"), ("done", ".*.tmp"), ("index", "*.jsonl"), ("index", ".*.tmp"), ("errors", "*.jsonl"),
        ("tmp", "*.tmp"), (".", ".*.tmp"),
    ):  # fmt: skip
        for path in (state / folder).glob(pattern):
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
    (state / CLEARING_NAME).unlink(missing_ok=True)
    (state / HASHES_NAME).unlink(missing_ok=True)  # (a name: a link planted there is only unlinked)
    if not keep_lock:
        (state / LOCK_NAME).unlink(missing_ok=True)
    if keep_lock:  # the folder stays in use
        return
    for emptied in (state / "done", state / "index", state / "errors", state / "tmp", state):
        with contextlib.suppress(OSError):
            emptied.rmdir()

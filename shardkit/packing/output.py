"""The output folder of a pack: refusing a bad one before any work, one pack at a time (a lock),
and knowing exactly which files shardkit wrote there (its ledger), so that `--overwrite` deletes
those and nothing else.

The ledger is the output's own records: the shards its manifest.json lists, the shards the done
markers of an interrupted run name (a marker is written before its shard is renamed into place, so
no shard of ours is ever unrecorded), manifest.json and errors.jsonl themselves, and the working
folder `.shardkit/`. Anything else in the folder is the user's: a pack refuses to run beside it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import ManifestError, OutputError, describe
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    STATE_DIR,
    read_manifest,
    write_json_atomic,
)
from ..core.safeio import NotRegularFileError, load_json_file, open_regular
from ..formats import idx_files, output_file_names

LOCK_NAME = "lock"
STATE_NAME = "state.json"
HASHES_NAME = "hashes.jsonl"  # pack --dedup's hashes as they are taken, for a resume
CLEARING_NAME = "clearing.json"  # what an --overwrite in progress is deleting
SHARD_PREFIX = "shard-"
# Temporary files of atomic writes by shardkit before 0.2 sat beside their targets.
_OLD_TEMP_PREFIXES = (f".{MANIFEST_NAME}.", f".{ERRORS_NAME}.")
# what a pack writes beside its shards (and the formats' files for other readers: own_files())
OWN_FILES = (MANIFEST_NAME, ERRORS_NAME, INDEX_NAME)


def shard_name(index: int, suffix: str) -> str:
    return f"{SHARD_PREFIX}{index:06d}{suffix}"


def own_files() -> tuple[str, ...]:
    """The names a pack writes beside its shards: the manifest, errors.jsonl, the index, and the
    files its formats write for other readers (`formats.output_file_names`)."""
    return (*OWN_FILES, *sorted(output_file_names()))


def is_shard_name(name: str) -> bool:
    """A name shardkit gives shards (shard-NNNNNN and a format's suffix): the only names a record
    of the output may make --overwrite delete, besides manifest.json and errors.jsonl."""
    from ..formats import FORMATS  # (the registry's modules, imported on first use)

    match = re.fullmatch(r"shard-\d{6,}(\.[a-z0-9]+)", name)
    return match is not None and any(match.group(1) == backend.suffix for backend in FORMATS.values())


def is_idx_name(name: str) -> bool:
    """A name shardkit gives a shard's .idx file for other readers (a tar's, for DALI)."""
    return re.fullmatch(r"shard-\d{6,}\.idx", name) is not None


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


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def refuse_overlap(source: str | os.PathLike[str], output: str | os.PathLike[str]) -> None:
    """OUT must not be SRC, lie inside it (its shards would be read as inputs next time) or hold it
    (a source file could be taken for a shard). Links are resolved."""
    src, out = os.path.realpath(source), os.path.realpath(output)
    shown_src, shown_out = os.fspath(source), os.fspath(output)
    if os.path.isfile(src):  # a list file: the files it names are checked after discovery
        if _inside(src, out):
            raise OutputError(f"{shown_out}: holds the source list {shown_src}; write the shards elsewhere")
        return
    if src == out:
        raise OutputError(f"{shown_out}: is the source folder itself; write the shards elsewhere")
    if _inside(out, src):
        raise OutputError(f"{shown_out}: lies inside the source folder {shown_src}; write the shards elsewhere")
    if _inside(src, out):
        raise OutputError(f"{shown_out}: holds the source folder {shown_src}; write the shards elsewhere")


def refuse_sources_inside(paths: list[str], output: str | os.PathLike[str]) -> None:
    """For list-file sources: no listed file may lie in OUT (by path; no link is resolved per file)."""
    folders = {os.path.abspath(output), os.path.realpath(output)}
    for path in paths:
        absolute = os.path.abspath(path)
        if any(_inside(absolute, folder) for folder in folders):
            raise OutputError(f"{os.fspath(output)}: holds the source file {path}; write the shards elsewhere")


def precheck(output: str | os.PathLike[str]) -> None:
    """What can be refused without touching anything, before the source is walked."""
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path}: exists and is not a folder")
    existing = next((p for p in (path, *path.absolute().parents) if os.path.lexists(p)), Path("/"))
    if not existing.is_dir():
        raise OutputError(f"{path}: cannot write here ({existing} is not a folder)")
    try:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    if read_only:
        raise OutputError(f"{path}: cannot write here (read-only file system)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: cannot write here (permission denied)")
    for name in own_files():
        target = path / name
        if os.path.lexists(target) and not stat.S_ISREG(os.lstat(target).st_mode):
            raise OutputError(f"{target}: is not a regular file; shardkit did not write it, and would write there")


@dataclass
class Claim:
    """An output folder held by this process: the lock, and what was there before."""

    output: Path
    lock_fd: int
    ours: set[str] = field(default_factory=set)  # names in the folder that shardkit wrote
    created: bool = False  # the folder did not exist before this pack
    created_state: bool = False  # nor did its working folder

    def release(self, undo: bool) -> None:
        """Let go of the folder; `undo` (a refusal or failure before any shard was started) leaves
        it as it was found."""
        if undo and (self.created or self.created_state):
            remove_state(self.output)
        if undo and self.created:
            with contextlib.suppress(OSError):
                self.output.rmdir()  # only if nothing else is in it
        os.close(self.lock_fd)


def claim(output: str | os.PathLike[str], *, resume: bool, overwrite: bool) -> Claim:
    """Create and lock the output folder and refuse it when it holds files shardkit did not write,
    or anything at all without resume or overwrite. Nothing is deleted here."""
    path = Path(output)
    precheck(path)
    created = not path.exists()
    state = state_dir(path)
    state_existed = os.path.lexists(state)
    for folder in (state, state / "done", state / "index", state / "tmp"):  # a planted link must not redirect deletions
        if os.path.lexists(folder) and not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise OutputError(f"{folder}: is not shardkit's working folder (not a folder); move it away")
    try:
        (state / "done").mkdir(parents=True, exist_ok=True)
        lock_fd = _lock(state / LOCK_NAME, path)
    except OSError as error:
        raise OutputError(f"{path}: cannot write here ({describe(error)})") from None
    held = Claim(path, lock_fd, created=created, created_state=not state_existed)
    try:
        names = {entry.name for entry in os.scandir(path)}
        if not state_existed:
            names.discard(STATE_DIR)
        if names and not (resume or overwrite):
            raise OutputError(f"{path}: not empty; use --resume to finish an interrupted pack or --overwrite")
        held.ours = ledger(path)
        foreign = sorted(names - held.ours - {STATE_DIR})
        if foreign:
            raise OutputError(
                f"{path}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                "which shardkit did not write; move it away or use an empty folder"
            )
    except BaseException:
        held.release(undo=True)
        raise
    return held


def _lock(path: Path, output: Path) -> int:
    """An exclusive lock on `path` (fcntl, so it works on NFS too), or OutputError naming the holder."""
    for _ in range(10):
        try:  # a planted link must not make us write into someone's file
            fd = open_regular(path, os.O_RDWR | os.O_CREAT, own=True)
        except NotRegularFileError:
            raise OutputError(f"{path}: is not shardkit's lock file (not a plain file); move it away") from None
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise OutputError(f"{path}: is a link, not shardkit's lock file; move it away") from None
            raise
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = _holder(path)
            raise OutputError(f"{output}: another shardkit pack is writing here ({holder}); wait for it") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:  # else the holder removed the file as it finished: lock the new one
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
            return fd
        os.close(fd)
    raise OutputError(f"{output}: cannot take the lock {path}")


def _holder(path: Path) -> str:
    try:
        pid, host = path.read_text(encoding="utf-8").split()[:2]
    except (OSError, ValueError):
        return "another process"
    return f"pid {pid} on {host}"


def ledger(output: Path) -> set[str]:
    """Names of the entries of `output` that its own records say shardkit wrote: the shards of a
    manifest whose checksum holds, those named by done markers or by an --overwrite that was
    interrupted, each tar's DALI index, manifest.json, errors.jsonl, index.parquet and
    shardindex.json. Every name must be a name shardkit gives: a crafted record cannot make
    anything else deletable."""
    ours: set[str] = set()
    own = own_files()
    for name in own:
        if (output / name).is_file():
            ours.add(name)  # a pack writes these names anyway
    if (output / MANIFEST_NAME).is_file():
        with contextlib.suppress(ManifestError):  # unreadable: its shards cannot be told from others
            manifest = read_manifest(output)
            if manifest.checksum == manifest.computed_checksum():
                ours.update(shard.name for shard in manifest.shards if is_shard_name(shard.name))
    for marker in (state_dir(output) / "done").glob("*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            name = load_json_file(marker)["shard"]["name"]
            if name == marker.name[: -len(".json")] and is_shard_name(name):
                ours.add(name)
    with contextlib.suppress(OSError, ValueError, TypeError):
        clearing = load_json_file(state_dir(output) / CLEARING_NAME)
        ours.update(
            name
            for name in clearing
            if isinstance(name, str) and (is_shard_name(name) or is_idx_name(name) or name in own)
        )
    ours.update(idx_files(name for name in ours if is_shard_name(name)))  # their .idx files
    ours.update(entry.name for entry in os.scandir(output) if _old_temp_file(entry.name))
    # Only regular files are what shardkit writes: a folder or link under a shard's name is not ours.
    return {name for name in ours if os.path.lexists(output / name) and stat.S_ISREG(os.lstat(output / name).st_mode)}


def clear(held: Claim) -> None:
    """--overwrite: delete what the ledger names and the working state; keep the lock. The list is
    written first, so an --overwrite killed half way still knows what it was deleting; the manifest
    goes first, so the folder never looks complete while its shards go."""
    order = sorted(held.ours, key=lambda name: (name != MANIFEST_NAME, name))
    try:
        write_json_atomic(state_dir(held.output) / CLEARING_NAME, order)
        for name in order:
            (held.output / name).unlink(missing_ok=True)
        remove_state(held.output, keep_lock=True)
    except OSError as error:
        raise OutputError(f"{held.output}: cannot remove the earlier output ({describe(error)})") from None
    held.ours = set()


def _old_temp_file(name: str) -> bool:
    return name.startswith(_OLD_TEMP_PREFIXES) and name.endswith(".tmp")


def remove_old_temp_files(output: Path) -> None:
    """Temporary files that shardkit before 0.2 left beside manifest.json when killed."""
    for entry in os.scandir(output):
        if _old_temp_file(entry.name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)


def remove_temp_shards(output: Path) -> None:
    """Half-written shards of workers that are gone (killed, or stopped after a failure)."""
    for path in temp_dir(output).glob("*.tmp"):
        path.unlink(missing_ok=True)


def remove_state(output: Path, keep_lock: bool = False) -> None:
    """Remove the working folder's own files (and the folders, once empty); nothing else."""
    state = state_dir(output)
    for folder, pattern in (
        ("done", "*.json"), ("done", ".*.tmp"), ("index", "*.jsonl"), ("index", ".*.tmp"), ("tmp", "*.tmp"),
        (".", ".*.tmp"),
    ):  # fmt: skip
        for path in (state / folder).glob(pattern):
            if path.is_file() and not path.is_symlink():
                path.unlink(missing_ok=True)
    (state / STATE_NAME).unlink(missing_ok=True)
    (state / CLEARING_NAME).unlink(missing_ok=True)
    (state / HASHES_NAME).unlink(missing_ok=True)  # (a name: a link planted there is only unlinked)
    if not keep_lock:
        (state / LOCK_NAME).unlink(missing_ok=True)
    if keep_lock:  # the folder stays in use
        return
    for emptied in (state / "done", state / "index", state / "tmp", state):
        with contextlib.suppress(OSError):
            emptied.rmdir()

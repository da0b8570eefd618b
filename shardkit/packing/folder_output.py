"""A local folder as a pack's output: refused when bad before any work, one pack at a time (a
lock), exactly the files shardkit wrote there known (its ledger), so that `--overwrite` deletes
those and nothing else; each shard written in the working folder's `tmp/` and renamed into place.

The ledger is the output's own records: the shards its manifest.json lists, the shards the done
markers of an interrupted run name (a marker is written before its shard is renamed into place, so
no shard of ours is ever unrecorded), manifest.json and errors.jsonl themselves, and the working
folder `.shardkit/`. Anything else in the folder is the user's: a pack refuses to run beside it.

A bucket's staging folder is claimed by the same rules (bucket_output.py): it is the local folder
of a pack to a bucket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.config import PackConfig
from ..core.errors import ManifestError, OutputError, describe
from ..core.manifest import (
    MANIFEST_NAME,
    STATE_DIR,
    VERSIONS_DIR,
    Manifest,
    idx_name,
    read_manifest,
    sha256_file,
    write_json_atomic,
)
from ..core.safeio import NotRegularFileError, load_json_file, open_regular
from ..formats import idx_files
from .index import part_path, write_part
from .shard_writing import Workspace
from .working_folder import (
    CHANGE_NAME,
    CLEARING_NAME,
    LOCK_NAME,
    change_action,
    done_path,
    finishing,
    is_idx_name,
    is_shard_name,
    old_temp_file,
    own_files,
    remove_state,
    state_dir,
    temp_dir,
    writing,
)

if TYPE_CHECKING:
    from .finish import PackResult
    from .shard_writing import ShardResult


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
    """An output folder this process has claimed: its lock, and what was there before."""

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
    # a planted link must not redirect deletions or writes
    for folder in (state, state / "done", state / "index", state / "errors", state / "tmp"):
        if os.path.lexists(folder) and not stat.S_ISDIR(os.lstat(folder).st_mode):
            raise OutputError(f"{folder}: is not shardkit's working folder (not a folder); move it away")
    try:
        (state / "done").mkdir(parents=True, exist_ok=True)
        lock_fd = lock_folder(state, path)
    except OSError as error:
        raise OutputError(f"{path}: cannot write here ({describe(error)})") from None
    claimed = Claim(path, lock_fd, created=created, created_state=not state_existed)
    try:
        if (state / CHANGE_NAME).exists():  # (its commit may be half done: nothing else may touch the output)
            action, source = change_action(path)
            raise OutputError(f"{path}: an interrupted {action!r} is here; {finishing(path, action, source)}")
        names = {entry.name for entry in os.scandir(path)}
        if not state_existed:
            names.discard(STATE_DIR)
        if names and not (resume or overwrite):
            raise OutputError(
                f"{path}: not empty; use --resume to finish an interrupted pack, --append to add to it, or --overwrite"
            )
        claimed.ours = ledger(path)
        foreign = sorted(names - claimed.ours - {STATE_DIR})
        if VERSIONS_DIR in foreign and (path / MANIFEST_NAME).exists():
            raise OutputError(
                f"{path}: keeps earlier versions ({VERSIONS_DIR}/, --keep-versions); move them away to pack here again"
            )
        if foreign:
            raise OutputError(
                f"{path}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                "which shardkit did not write; move it away or use an empty folder"
            )
    except BaseException:
        claimed.release(undo=True)
        raise
    return claimed


def lock_folder(state: Path, output: Path) -> int:
    """An exclusive lock on the working folder `state` of `output` (fcntl on its lock file, so it
    works on NFS too), or OutputError naming the holder."""
    path = state / LOCK_NAME
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
            raise OutputError(
                f"{output}: another shardkit pack or remove is writing here ({holder}); wait for it"
            ) from None
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
    ours.update(entry.name for entry in os.scandir(output) if old_temp_file(entry.name))
    # Only regular files are what shardkit writes: a folder or link under a shard's name is not ours.
    return {name for name in ours if os.path.lexists(output / name) and stat.S_ISREG(os.lstat(output / name).st_mode)}


def clear(claimed: Claim) -> None:
    """--overwrite: delete what the ledger names and the working state; keep the lock. The list is
    written first, so an --overwrite killed half way still knows what it was deleting; the manifest
    goes first, so the folder never looks complete while its shards go."""
    order = sorted(claimed.ours, key=lambda name: (name != MANIFEST_NAME, name))
    try:
        write_json_atomic(state_dir(claimed.output) / CLEARING_NAME, order)
        for name in order:
            (claimed.output / name).unlink(missing_ok=True)
        remove_state(claimed.output, keep_lock=True)
    except OSError as error:
        raise OutputError(f"{claimed.output}: cannot remove the earlier output ({describe(error)})") from None
    claimed.ours = set()


@dataclass(frozen=True)
class FolderShards:
    """A local folder as the place a written shard goes (the worker's side of FolderOutput): each
    shard is written in the working folder's `tmp/`, which the worker must see, then its index
    part and done marker are written, and its .idx file and itself renamed into the folder."""

    folder: str

    def workspace(self, name: str, files: contextlib.ExitStack) -> Workspace:
        """`name`'s temporary files in `tmp/`, named by this process too: one worker may write two
        parts of a shard before either is appended (`files` is not needed: `discard` removes them)."""
        if not os.path.isdir(state_dir(self.folder)) or not os.access(self.folder, os.W_OK):
            raise OutputError(
                f"{self.folder}: not visible or not writable from worker {socket.gethostname()}:{os.getpid()}; "
                "with --executor ray the output folder must be on storage that every node shares"
            )
        temp = temp_dir(self.folder) / f"{name}.{os.getpid()}.tmp"
        return Workspace(self.folder, temp, temp_dir(self.folder) / f"{idx_name(name)}.{os.getpid()}.tmp")

    def put(self, result: ShardResult, rows: list[tuple[Any, ...]], space: Workspace) -> None:
        """The shard into the folder, recorded first: its index part, then the done marker that
        vouches for it (no shard is ever in the folder without a record of it, which is what
        --overwrite may delete; a marker whose shard is missing is simply written again), then its
        .idx file before the shard (a shard in the folder always has its index)."""
        placing = time.perf_counter()
        name = result.shard.name
        with writing(self.folder, name):
            write_part(part_path(state_dir(self.folder), name), rows)
            write_json_atomic(done_path(self.folder, name), result.marker())
            if result.companion is not None:
                os.replace(space.idx, Path(self.folder) / result.companion.name)
            os.replace(space.shard, Path(self.folder) / name)
        result.timings["write"] += time.perf_counter() - placing


@dataclass
class FolderOutput:
    """A local folder as a pack's output (output.Output): the pack's local folder is the output
    itself, its workers put each shard in place (FolderShards), and finish writes the files beside
    the whole output there; nothing is left to publish but the working folder to remove."""

    url: str  # the folder as the user named it
    folder: Path
    shards_here = True  # (the shards are files in `folder`)

    def open(self, config: PackConfig) -> Manifest | None:
        """Nothing to check before the local claim: the folder is claimed with its lock (`claim`)
        once a Ray cluster is reached, and a finished pack found there is told by resume.resumable."""
        return None

    def complete(self, manifest: Manifest) -> bool:
        """Whether every shard `manifest` names is in the folder with its size."""
        return all(_size(self.folder / shard.name) == shard.bytes for shard in manifest.shards)

    def local_config(self, config: PackConfig) -> PackConfig:
        return config

    def begin(self) -> None:
        """Nothing: an --overwrite cleared the folder when it was claimed."""

    def destination(self, name: str) -> FolderShards:
        return FolderShards(str(self.folder))

    def intact(self, result: ShardResult) -> bool:
        """Whether the shard an earlier run finished is still in the folder, byte for byte."""
        shard = self.folder / result.shard.name
        try:
            return shard.stat().st_size == result.shard.bytes and sha256_file(shard) == result.shard.sha256
        except OSError:
            return False

    def mark_done(self, result: ShardResult) -> None:
        """Nothing: the shard's done marker and index part are written as it is put in place."""

    def publish(self, manifest: Manifest) -> None:
        """The working folder removed, unless some rows failed for a passing cause: its done
        markers stay, so that --resume tries those rows again."""
        if not manifest.totals.get("transient"):
            remove_state(self.folder)

    def report(self, result: PackResult) -> PackResult:
        return result


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None

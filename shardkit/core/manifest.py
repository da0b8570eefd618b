"""The output's self-description: `manifest.json` (schema, settings, classes, per-shard sha256) and
`errors.jsonl` (every input that was not packed, with its reason). Written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, TypeVar

from .errors import ManifestError, describe
from .safeio import loads, open_regular, read_regular

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
ERRORS_NAME = "errors.jsonl"
INDEX_NAME = "index.parquet"  # a row per record: key, shard, position, label, caption, columns, sizes
WIDS_NAME = "shardindex.json"  # wids' list of shards (formats/tar_companions)
VERSIONS_DIR = "versions"  # earlier versions kept whole (`--keep-versions`): versions/v1/, versions/v2/...
STATE_DIR = ".shardkit"  # resume state and temporary shards; removed when a pack completes
STATE_NAME = "state.json"  # in STATE_DIR: a pack's resume state, until its cleanup
CHANGE_NAME = "change.json"  # in STATE_DIR: the journal of a change of an output, until it is done


@dataclass(frozen=True)
class ShardInfo:
    name: str
    count: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class PackedResize:
    """How pack sized the images, as the manifest's settings say: what the read side needs of it."""

    mode: str | None  # "short", "long" or "center-crop"; None where the settings do not say
    size: int | None  # the target in pixels; None where images kept their size

    @property
    def center_crop(self) -> bool:
        """Whether pack cut each image's centered square before resizing it (boxes map back through it)."""
        return self.mode == "center-crop" and self.size is not None


@dataclass(frozen=True)
class Manifest:
    format: str
    shards: list[ShardInfo]
    classes: list[str] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)  # resize, encode, sharding: how it was made
    totals: dict[str, int] = field(default_factory=dict)  # inputs, records, errors
    schema_version: int = SCHEMA_VERSION
    created_by: str = ""
    checksum: str = ""  # sha256 of everything else: verify uses it to catch hand edits
    index: ShardInfo | None = None  # index.parquet (count: its rows); None for an output without one
    # files for other readers beside the shards (formats/tar_companions: a tar's DALI index, wids'
    # shardindex.json), count: the records each describes; absent when there are none
    companions: list[ShardInfo] = field(default_factory=list)
    # 1 for what a pack wrote; each change of a finished output (`shardkit remove`) makes the next,
    # and `history` says what each version after the first changed (absent while there is none)
    version: int = 1
    history: list[dict[str, Any]] = field(default_factory=list)

    @property
    def records(self) -> int:
        return sum(shard.count for shard in self.shards)

    @property
    def holds_clips(self) -> bool:
        """Whether its records are clips of videos (pack --clip-seconds: settings["clips"])."""
        return isinstance(self.settings.get("clips"), dict)

    @property
    def packed_resize(self) -> PackedResize:
        """settings["resize"], as pack writes it, typed (an output from elsewhere may say nothing)."""
        resize = self.settings.get("resize")
        if not isinstance(resize, dict):
            return PackedResize(None, None)
        mode, size = resize.get("mode"), resize.get("size")
        whole = isinstance(size, int) and not isinstance(size, bool)
        return PackedResize(mode if isinstance(mode, str) else None, size if whole else None)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.index is None:  # an output without an index keeps the manifest (and checksum) it had
            del data["index"]
        if not self.companions:
            del data["companions"]
        if self.version == 1 and not self.history:  # a packed output's manifest is as it always was
            del data["version"], data["history"]
        return data

    def computed_checksum(self) -> str:
        return json_sha256({key: value for key, value in self.to_json().items() if key != "checksum"})

    def sealed(self) -> Manifest:
        """This manifest with its checksum filled in."""
        from dataclasses import replace

        return replace(self, checksum=self.computed_checksum())

    @classmethod
    def from_json(cls, data: Any, where: str = MANIFEST_NAME) -> Manifest:
        """A manifest from parsed JSON that may come from a stranger: every field is type-checked."""
        if not isinstance(data, dict):
            raise ManifestError(f"{where}: not a valid shardkit manifest (not a JSON object)")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION or not _is_int(version):
            raise ManifestError(f"{where}: schema version {str(version)[:20]} is not {SCHEMA_VERSION}")
        try:
            manifest = cls(
                format=_typed(data, "format", str),
                shards=[_shard(row, where) for row in _typed(data, "shards", list)],
                classes=_typed(data, "classes", list, []),
                settings=_typed(data, "settings", dict, {}),
                totals=_typed(data, "totals", dict, {}),
                schema_version=version,
                created_by=_typed(data, "created_by", str, ""),
                checksum=_typed(data, "checksum", str, ""),
                index=None if data.get("index") is None else _shard(data["index"], where),
                companions=[_shard(row, where) for row in _typed(data, "companions", list, [])],
                version=_typed(data, "version", int, 1),
                history=_typed(data, "history", list, []),
            )
        except ValueError as error:
            raise ManifestError(f"{where}: not a valid shardkit manifest ({error})") from None
        if not all(isinstance(name, str) for name in manifest.classes):
            raise ManifestError(f"{where}: classes must be a list of names")
        for key, value in manifest.totals.items():
            if not _is_int(value) or value < 0:
                raise ManifestError(f"{where}: total {key} is not a count ({str(value)[:20]})")
        if not _is_int(manifest.version) or not 1 <= manifest.version <= MAX_VERSION:
            raise ManifestError(f"{where}: version {str(manifest.version)[:20]} is not a version number")
        if len(manifest.history) != manifest.version - 1 or not all(isinstance(row, dict) for row in manifest.history):
            raise ManifestError(f"{where}: history must be an object per version after the first")
        if manifest.index is not None and manifest.index.name != INDEX_NAME:
            raise ManifestError(f"{where}: the index must be {INDEX_NAME}")
        allowed = companion_names(manifest.shards)
        for companion in manifest.companions:
            if companion.name not in allowed:  # a crafted name must not make another file ours
                raise ManifestError(f"{where}: {companion.name[:80]!r} is not a shard's index or {WIDS_NAME}")
        return manifest


IDX_SUFFIX = ".idx"


def idx_name(shard: str) -> str:
    """The DALI index of `shard-000000.tar` is `shard-000000.idx` (as DALI's wds2idx names it)."""
    stem, dot, _ = shard.rpartition(".")
    return f"{stem if dot else shard}{IDX_SUFFIX}"


def companion_names(shards: list[ShardInfo]) -> set[str]:
    """The names a manifest may list as companions: each tar's index, and wids' shard list."""
    names = {idx_name(shard.name) for shard in shards if shard.name.endswith(".tar")} | {WIDS_NAME}
    return names - {shard.name for shard in shards} - {MANIFEST_NAME, ERRORS_NAME, INDEX_NAME}


def wids_index(shards: list[ShardInfo]) -> bytes:
    """wids' shardindex.json for these shards, so `wids.ShardListDataset(OUT/shardindex.json)`
    opens the output. URLs are relative: wids resolves them against the index's own folder or URL,
    so a copied or uploaded output works as it is. No name: wids then names its cache after the
    index's URL."""
    spec = {
        "__kind__": "wids-shard-index-v1",
        "wids_version": 1,
        "shardlist": [{"url": shard.name, "nsamples": shard.count, "filesize": shard.bytes} for shard in shards],
    }
    return (json.dumps(spec, indent=2, sort_keys=True) + "\n").encode()


_T = TypeVar("_T")


def _typed(data: dict[str, Any], key: str, kind: type[_T], default: Any = None) -> _T:
    value = data.get(key, default)
    if not isinstance(value, kind):
        raise ValueError(f"{key} must be a {kind.__name__}, not {type(value).__name__}")
    return value


def _shard(row: Any, where: str) -> ShardInfo:
    if not isinstance(row, dict) or set(row) != {"name", "count", "bytes", "sha256"}:
        raise ManifestError(f"{where}: a shard entry is not {{name, count, bytes, sha256}}")
    name, count, size, digest = row["name"], row["count"], row["bytes"], row["sha256"]
    # Names come from strangers: a shard must sit in the output folder itself.
    if not isinstance(name, str) or any(c in name for c in "/\\\0") or name in ("", ".", ".."):
        raise ManifestError(f"{where}: shard name {str(name)[:80]!r} is not a plain file name")
    if not _is_int(count) or not 0 <= count <= MAX_SHARD_RECORDS:
        raise ManifestError(f"{where}: shard {name} has a bad record count")
    if not _is_int(size) or not 0 <= size <= MAX_SHARD_BYTES:
        raise ManifestError(f"{where}: shard {name} has a bad byte size")
    if not isinstance(digest, str) or not SHA256_HEX.fullmatch(digest):
        raise ManifestError(f"{where}: shard {name} has a bad sha256")
    return ShardInfo(name, count, size, digest)


MAX_VERSION = 2**31  # bounds what a hostile manifest can claim (versions name files: shard-000001-v2.tar)
MAX_SHARD_RECORDS = 2**40  # far above any real shard; bounds what a hostile manifest can claim
MAX_SHARD_BYTES = 2**50
# ~100,000 shards (100 M images at 1,000 a shard); a bigger manifest.json is refused unread. Parsed
# JSON takes up to ~50x its text in memory: this bounds what a hostile manifest can cost.
MAX_MANIFEST_BYTES = 16 << 20
MAX_ERROR_LINE = 1 << 20  # one errors.jsonl row; the file itself is streamed
SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # a sha256 as shardkit writes it (the manifest, the index)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_json_atomic(path: str | Path, data: Any, temp_dir: str | Path | None = None) -> None:
    text = json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n"
    write_text_atomic(path, text, temp_dir)


def write_text_atomic(path: str | Path, text: str, temp_dir: str | Path | None = None) -> None:
    """Write to a temporary file, fsync, then rename: readers never see half a file. The temporary
    file goes in `temp_dir` (same filesystem) when given, so a kill leaves nothing beside `path`."""
    write_lines_atomic(path, [text], temp_dir)


def write_lines_atomic(path: str | Path, texts: Iterable[str], temp_dir: str | Path | None = None) -> None:
    """`write_text_atomic` of the texts joined, written as they come (never held whole)."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=temp_dir or path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.writelines(texts)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_manifest(folder: str | Path) -> Manifest:
    """The manifest of an output folder (or the manifest file itself)."""
    path = Path(folder)
    if path.is_dir():
        path = path / MANIFEST_NAME
    try:
        text = read_regular(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        if not os.path.lexists(folder):  # a mistyped path is said as every command says it
            raise ManifestError(f"{folder}: no such file or folder") from None
        raise ManifestError(f"{path}: {_no_manifest(path.parent)}") from None
    except OSError as error:
        raise ManifestError(f"{path}: unreadable manifest ({describe(error)})") from None
    return parse_manifest(text, str(path))


def _no_manifest(folder: Path) -> str:
    """Why `folder` has no manifest, as its working folder says: a pack or a change into it (a merge
    makes a new folder) begun and not finished, with the command that finishes it; or no output."""
    journal = folder / STATE_DIR / CHANGE_NAME
    if os.path.isfile(journal) and not os.path.islink(journal):
        action, plan = change_action(folder)
        if action == "change":  # (a journal that does not read as one: verify says what is wrong with it)
            return unfinished(action, "`shardkit verify` says what its journal holds")
        return unfinished(action, finishing(folder, action, plan))
    state = folder / STATE_DIR / STATE_NAME
    if os.path.isfile(state) and not os.path.islink(state):
        return unfinished("pack", "the same `shardkit pack` with --resume finishes it")
    return "no manifest (is this a shardkit output folder?)"


_UNFINISHED = {"pack": "a pack into it", "merge": "a merge into it", "append": "an append to it"}


def unfinished(action: str, finish: str) -> str:
    """The words for an output whose manifest is not there yet because `action` (its journal's) has
    not finished, and `finish`, what finishes it."""
    what = _UNFINISHED.get(action, f"a {action} of it" if action in ("remove", "compact") else "a change of it")
    return f"no manifest yet: {what} began and has not finished (it may still be running); {finish}"


def finishing(output: str | os.PathLike[str], action: str, plan: object = None) -> str:
    """The command that finishes an interrupted change of `output` (its journal's `action`; an
    append's source, key prefix and table from its `plan`), as a refusal says it. A journal may be a
    stranger's: what it says is shown only when it is printable, and quoted as a shell word."""
    import shlex

    if action == "append":
        said = plan if isinstance(plan, dict) else {}
        words = [_word(said.get("source"), "SOURCE"), _word(str(output), "OUTPUT"), "--append"]
        if said.get("key_prefix"):
            words += ["--key-prefix", _word(said.get("key_prefix"), "PREFIX")]
        if said.get("table"):
            words += ["--metadata", _word(said.get("table"), "TABLE")]
        return f"`shardkit pack {' '.join(words)}` (the same append again) finishes it"
    if action == "merge":
        said = plan if isinstance(plan, dict) else {}
        listed = said.get("sources")
        sources = listed if isinstance(listed, list) else []
        words = [_word(source, "OUTPUT") for source in sources[:64]] or ["OUTPUT", "..."]
        if len(sources) > 64:  # (a command line of them all would be a page)
            words.append(f"...{len(sources) - 64} more")
        flags = [flag for flag, key in (("--prefix-keys", "prefix_keys"), ("--relabel", "relabel")) if said.get(key)]
        command = " ".join([*words, _word(str(output), "OUT"), *flags, "--resume"])
        return f"`shardkit merge {command}` finishes it"
    if action in ("remove", "compact"):
        return f"`shardkit {action} {shlex.quote(str(output))} --resume` finishes it"
    return f"move {str(output).rstrip('/')}/{STATE_DIR} away to abandon it"


def _word(text: object, otherwise: str) -> str:
    """`text` as one shell word, or `otherwise` where it is not printable text of a sane length."""
    import shlex

    if not isinstance(text, str) or not text or len(text) > 1000 or not text.isprintable():
        return otherwise
    return shlex.quote(text)


JOURNAL_LIMIT = 64 << 20  # the most a change's journal (changes/journal.py) may hold


def change_action(output: str | os.PathLike[str]) -> tuple[str, object]:
    """The action and plan a change's journal in `output` names, read without checking it (for a
    refusal's words; changes/journal.py checks a journal before acting on it): ("change", None)
    where it cannot be read as one. Only a regular file of the state folder's own is read (a FIFO
    planted there would hang a plain open; a link could read another folder's)."""
    try:
        fd = open_regular(Path(output) / STATE_DIR / CHANGE_NAME, own=True)
        with os.fdopen(fd, "rb") as journal:
            text = journal.read(JOURNAL_LIMIT + 1)
        data = loads(text) if len(text) <= JOURNAL_LIMIT else None
    except (OSError, ValueError):
        return "change", None
    if not isinstance(data, dict) or not isinstance(data.get("action"), str):
        return "change", None
    return data["action"][:40], data.get("plan")


def parse_manifest(text: bytes, where: str) -> Manifest:
    """A manifest from the bytes of manifest.json (read from disk or fetched from a URL)."""
    try:
        data = loads(text)
    except ValueError as error:  # UnicodeDecodeError and JSON errors included
        raise ManifestError(f"{where}: unreadable manifest ({error})") from None
    return Manifest.from_json(data, where)


def info_of(name: str, count: int, data: bytes) -> ShardInfo:
    """The manifest entry of a file written from `data` (an index file, describing `count` records)."""
    return ShardInfo(name, count, len(data), hashlib.sha256(data).hexdigest())


def sorted_json(value: Any) -> bytes:
    """The one JSON form shardkit hashes (settings, plans, the manifest's checksum): sorted keys."""
    return json.dumps(value, sort_keys=True).encode()


def json_sha256(value: Any) -> str:
    return hashlib.sha256(sorted_json(value)).hexdigest()


def sha256_file(path: str | Path, block: int = 1 << 20) -> str:
    fd = open_regular(path)
    try:
        return sha256_of(fd, block)
    finally:
        os.close(fd)


def sha256_of(fd: int, block: int = 1 << 20) -> str:
    """The sha256 of what is left to read from `fd` (for a caller that checked the file first)."""
    digest = hashlib.sha256()
    while chunk := os.read(fd, block):
        digest.update(chunk)
    return digest.hexdigest()


ERROR_FIELDS = ("path", "stage", "reason")


def iter_errors(folder: str | Path, most: int | None = None) -> Iterator[dict[str, str]]:
    """The rows of errors.jsonl one at a time (the file is streamed: its size is not bounded, each
    row is); with `most` (the manifest's totals.errors), a row past it ends them (`error_lines`)."""
    path = Path(folder) / ERRORS_NAME
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return
    except OSError as error:
        raise ManifestError(f"{path}: unreadable ({describe(error)})") from None
    with open(fd, "rb") as lines:
        yield from error_lines(lines, str(path), most)


def error_lines(lines: BinaryIO, where: str, most: int | None = None) -> Iterator[dict[str, str]]:
    """The rows of an errors.jsonl read from `lines` (a local file, or a remote body streamed), each
    checked. With `most`, the first row past it raises ManifestError, and so do blank lines past it
    (pack writes none): a log that never ends is read no further than the count its manifest gives."""
    for _, row in error_lines_as_written(lines, where, most):
        yield row


def error_lines_as_written(
    lines: BinaryIO, where: str, most: int | None = None
) -> Iterator[tuple[bytes, dict[str, str]]]:
    """`error_lines`, each row with its line as written (to copy a log byte for byte, checked)."""
    rows = blank = 0
    for number, line in enumerate(iter(lambda: lines.readline(MAX_ERROR_LINE + 1), b""), 1):
        if len(line) > MAX_ERROR_LINE:
            raise ManifestError(f"{where}: line {number} is over {MAX_ERROR_LINE:,} bytes")
        empty = not line.strip()
        rows, blank = rows + (not empty), blank + empty
        if most is not None and max(rows, blank) > most:
            raise ManifestError(f"{where}: more than the {most:,} rows the manifest's totals say")
        if empty:
            continue
        try:
            row = loads(line)
        except ValueError as error:
            raise ManifestError(f"{where}: line {number} is not JSON ({error})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(name), str) for name in ERROR_FIELDS):
            raise ManifestError(f"{where}: line {number} is not an object of {', '.join(ERROR_FIELDS)} strings")
        yield line, row

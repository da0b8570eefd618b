"""A subset of an output taken from its index.parquet, no shard touched: `open_shards(OUT, select=...)`.

The selection (keys, a pyarrow Expression over the index's columns, or a callable given the index
as a Table) is resolved once to each shard's kept positions, sorted: the epoch machinery then counts
kept records (`Subset.counts`) and reads each shard's kept positions as a few ranges, skipping what
lies between (`runs`). The index is trusted only once it is the manifest's (bytes and sha256) and
lists every shard's positions 0..count-1 exactly once, so a position read is the record meant.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.errors import ConfigError, ManifestError, describe
from ..core.manifest import INDEX_NAME, Manifest, sha256_file
from .arrays import boolean, booleans, flags, int64s, integers, strings

if TYPE_CHECKING:
    from ..storage.store import Store

# A run of kept positions is read as one range while at most this many unkept records lie
# between two kept ones: reading past a few records costs less than starting a read again (a tar
# walk from its nearest mark, an LMDB transaction, an HDF5 window).
GAP = 16
SHOWN = 3  # unknown keys an error names

Selection = Sequence[str] | Callable[[Any], Any] | Any  # keys, a callable, or a pyarrow Expression


@dataclass
class IndexFile:
    """An output's index.parquet checked against its manifest: `source` is what pyarrow reads
    (a local path, or the fetched bytes of a remote one), and `keys`, `shards` (the shard's number
    in the manifest) and `positions` its key, shard and position columns."""

    source: Any
    manifest: Manifest
    keys: Any  # pyarrow string array, the index's row order
    shards: np.ndarray  # int64: the manifest's number of each row's shard
    positions: np.ndarray  # int64
    _columns: list[str] = field(default_factory=list)

    @property
    def columns(self) -> list[str]:
        return self._columns

    def read(self, columns: list[str] | dict[str, Any] | None = None) -> Any:
        """Columns of the index (all by default), or expressions over them ({name: Expression}):
        only the columns they name are read."""
        if hasattr(self.source, "seek"):
            self.source.seek(0)
        if not isinstance(columns, dict):  # (pyarrow.dataset imports pandas, 0.4 s: only expressions need it)
            import pyarrow.parquet as pq

            unknown = next((name for name in columns or () if name not in self.columns), None)
            if unknown is not None:
                raise ConfigError(
                    f"select: the index has no column {unknown!r} (it has {', '.join(self.columns)}); "
                    "a column of your own table is in its 'columns' text: filter on it with a callable"
                )
            return pq.ParquetFile(self.source).read(columns=columns)
        import pyarrow.dataset as ds
        import pyarrow.fs as fs

        try:
            local = None if hasattr(self.source, "seek") else fs.LocalFileSystem()
            return ds.ParquetFileFormat().make_fragment(self.source, filesystem=local).to_table(columns=columns)
        except Exception as error:  # pyarrow's own (ArrowInvalid for an unknown column, a type mismatch, ...)
            said = str(error).splitlines()[0]
            missing = re.match(r"No match for FieldRef\.Name\((.*?)\) in ", said)
            if missing is not None:  # pyarrow lists the columns it has in its schema's own notation
                raise ConfigError(
                    f"select: the index has no column {missing.group(1)!r} (it has {', '.join(self.columns)}); "
                    "a column of your own table is in its 'columns' text: filter on it with a callable"
                ) from None
            raise ConfigError(f"select: {said[:300]}") from None


def read_index(where: Path | Store, manifest: Manifest) -> IndexFile:
    """The output's index.parquet (fetched once for a remote output), checked to be the manifest's
    and to list each shard's positions exactly once; ManifestError saying what does not fit."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    entry = manifest.index
    name = where / INDEX_NAME if isinstance(where, Path) else where.child(INDEX_NAME)
    if entry is None:
        raise ConfigError(f"{name}: this output has no index, which select and join need (pack it again)")
    source: Any
    try:
        if isinstance(where, Path):
            size = os.stat(name).st_size
            digest = sha256_file(Path(name)) if size == entry.bytes else ""
            source = str(name)
        else:
            data = where.read(INDEX_NAME, limit=entry.bytes)
            size, digest = len(data), hashlib.sha256(data).hexdigest()
            source = pa.BufferReader(data)
    except FileNotFoundError:
        raise ManifestError(f"{name}: listed in the manifest but missing") from None
    except OSError as error:
        raise ManifestError(f"{name}: {describe(error)}") from None
    if size != entry.bytes or digest != entry.sha256:
        raise ManifestError(f"{name}: differs from the manifest (bytes changed)")
    try:
        handle = pq.ParquetFile(source)
        rows = handle.metadata.num_rows
        if rows != manifest.records:
            raise ManifestError(f"{name}: {rows:,} rows, the manifest says {manifest.records:,} records")
        columns = list(handle.schema_arrow.names)
        twice = next((column for column in columns if columns.count(column) > 1), None)
        if twice is not None:
            raise ManifestError(f"{name}: names the column {twice[:80]!r} twice")
        table = handle.read(columns=["key", "shard", "position"])
    except ManifestError:
        raise
    except Exception as error:  # pyarrow's own errors for a damaged file or a missing column
        raise ManifestError(f"{name}: unreadable ({str(error).splitlines()[0][:200]})") from None
    if not isinstance(where, Path):
        source = pa.BufferReader(data)  # read again from the start by each later read
    keys, shard_names, positions = (table.column(n).combine_chunks() for n in ("key", "shard", "position"))
    typed = pa.types.is_string(keys.type) and pa.types.is_string(shard_names.type)
    if not typed or not pa.types.is_signed_integer(positions.type):
        raise ManifestError(f"{name}: a key, shard or position of the wrong type")
    if keys.null_count or shard_names.null_count or positions.null_count:
        raise ManifestError(f"{name}: a key, shard or position missing or of the wrong type")
    numbers = _shard_numbers(shard_names, manifest, name)
    at = integers(positions)
    _check_positions(numbers, at, manifest, name)
    return IndexFile(source, manifest, keys, numbers, at, columns)


def _shard_numbers(names: Any, manifest: Manifest, where: object) -> np.ndarray:
    import pyarrow.compute as pc

    listed = strings([shard.name for shard in manifest.shards])
    numbers = pc.index_in(names, value_set=listed)
    if numbers.null_count:
        stranger = names.filter(pc.is_null(numbers))[0].as_py()
        raise ManifestError(f"{where}: names a shard the manifest lacks: {str(stranger)[:80]!r}")
    return integers(numbers)


def _check_positions(shards: np.ndarray, positions: np.ndarray, manifest: Manifest, where: object) -> None:
    """Every shard's positions are 0..count-1, each once: then (shard, position) names one record."""
    counts = np.array([shard.count for shard in manifest.shards], np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)])
    order = np.lexsort((positions, shards))
    expected = np.arange(len(order), dtype=np.int64) - starts[shards[order]]
    if len(order) != int(starts[-1]) or not np.array_equal(positions[order], expected):
        raise ManifestError(f"{where}: its positions are not each shard's records 0 to count - 1")


@dataclass(frozen=True)
class Subset:
    """Each shard's kept positions: `positions[offsets[s]:offsets[s + 1]]`, sorted, for shard s."""

    positions: np.ndarray  # int64, sorted within each shard
    offsets: np.ndarray  # int64, len(shards) + 1
    keys: Any  # pyarrow string array: the kept records' keys, in the same order
    identity: str  # a hash of the kept positions: a state resumes only the selection it was saved on

    @property
    def counts(self) -> list[int]:
        result: list[int] = np.diff(self.offsets).tolist()
        return result

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def kept(self, shard: int) -> np.ndarray:
        return self.positions[self.offsets[shard] : self.offsets[shard + 1]]

    def position(self, shard: int, local: int) -> int:
        """The stored position of the shard's `local`-th kept record."""
        return int(self.positions[self.offsets[shard] + local])


def select(index: IndexFile, selection: Selection, what: str) -> Subset:
    """The subset `selection` keeps of the output whose index is `index` (`what` names it in errors)."""
    mask = _mask(index, selection)
    rows = np.flatnonzero(mask)
    if not len(rows):
        raise ConfigError(f"select keeps no record of {what}")
    shards, positions = index.shards[rows], index.positions[rows]
    order = np.lexsort((positions, shards))
    rows, shards, positions = rows[order], shards[order], positions[order]
    offsets = np.searchsorted(shards, np.arange(len(index.manifest.shards) + 1)).astype(np.int64)
    digest = hashlib.sha256(offsets.tobytes() + positions.tobytes()).hexdigest()[:16]
    return Subset(positions, offsets, index.keys.take(int64s(rows)), digest)


def _mask(index: IndexFile, selection: Selection) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(selection, pc.Expression):
        # evaluated as a projected column: only the columns it names are read, a row per index row
        keep = index.read(columns={"keep": selection}).column("keep")
        if not pa.types.is_boolean(keep.type):
            raise ConfigError(f"select: the expression must be a condition (true or false), not {keep.type}")
        return flags(pc.fill_null(keep, boolean(False)))  # (False or to_numpy() would import pandas)
    if callable(selection):
        picked = selection(index.read())
        if isinstance(picked, pa.Table):
            if "key" not in picked.column_names:
                raise ConfigError("select: the table the callable returned has no 'key' column")
            _refuse_repeats(picked.column("key"))
            return _keys_mask(index, picked.column("key"))
        mask = np.asarray(picked.to_numpy(zero_copy_only=False) if hasattr(picked, "to_numpy") else picked)
        if mask.dtype != np.bool_ or mask.shape != (len(index.keys),):
            raise ConfigError(
                f"select: the callable must return a Table or {len(index.keys):,} booleans, "
                f"not {mask.dtype} of shape {mask.shape}"
            )
        return mask
    if isinstance(selection, (set, frozenset)):
        selection = sorted(selection)
    if isinstance(selection, (str, bytes)) or not isinstance(selection, Sequence | np.ndarray | pa.Array):
        raise ConfigError(
            f"select must be a list of keys, a pyarrow Expression or a callable, not {type(selection).__name__}"
        )
    try:
        if not isinstance(selection, pa.Array) and all(isinstance(key, str) for key in selection):
            wanted = strings(list(selection))  # (pa.array of Python strings would import pandas)
        else:
            wanted = pa.array(list(selection) if not isinstance(selection, pa.Array) else selection, pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        odd = next((k for k in selection if k is not None and not isinstance(k, str)), None)
        raise ConfigError(f"select: keys are text; {odd!r} is a {type(odd).__name__}") from None
    unknown = wanted.filter(pc.invert(pc.is_in(wanted, value_set=index.keys)))
    if len(unknown):
        names = ", ".join(repr(k) for k in unknown[:SHOWN].to_pylist())
        more = f" and {len(unknown) - SHOWN:,} more" if len(unknown) > SHOWN else ""
        raise ConfigError(f"select: {len(unknown):,} keys not in the output: {names}{more}")
    _refuse_repeats(wanted)
    return _keys_mask(index, wanted)


def _refuse_repeats(keys: Any) -> None:
    """A subset holds each record once: a key named twice is a mistake upstream (a join that fanned
    out, a list built twice), refused rather than kept once without a word."""
    import pyarrow.compute as pc

    counts = pc.value_counts(keys)
    repeated = counts.filter(booleans(integers(counts.field("counts")) > 1))  # (pc.greater(..., 1): pandas)
    if len(repeated):
        shown = ", ".join(f"{r['values']!r} {r['counts']} times" for r in repeated[:SHOWN].to_pylist())
        more = f" and {len(repeated) - SHOWN:,} more" if len(repeated) > SHOWN else ""
        raise ConfigError(
            f"select: {len(repeated):,} {'key' if len(repeated) == 1 else 'keys'} named more than once: {shown}{more};"
            " a subset holds each record once"
        )


def _keys_mask(index: IndexFile, keys: Any) -> np.ndarray:
    import pyarrow.compute as pc

    result: np.ndarray = flags(pc.is_in(index.keys, value_set=keys.unique()))
    return result


def runs(kept: np.ndarray, gap: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """Sorted positions as ranges read whole: (first, stop, begin, end) for stored positions
    [first, stop) holding kept[begin:end]; a new range starts where more than `gap` unkept
    records lie between two kept ones."""
    if not len(kept):
        return
    gap = GAP if gap is None else gap
    breaks = np.flatnonzero(np.diff(kept) > gap + 1) + 1
    bounds = [0, *breaks.tolist(), len(kept)]
    for begin, end in itertools.pairwise(bounds):
        yield int(kept[begin]), int(kept[end - 1]) + 1, begin, end

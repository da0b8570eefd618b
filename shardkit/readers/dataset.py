"""`open_shards()`: one reader for every format, PyTorch-ready.

A `ShardDataset` is map-style (len, ds[i], ds.get(key); works with any sampler, DistributedSampler
included) and iterable: `iter(ds)` streams shards, the epoch cut into equal contiguous runs per
rank and DataLoader worker (each sample once per epoch; equal step counts on every rank),
optionally with a seeded shard-order shuffle and a bounded shuffle buffer. `ds.iterable()` wraps
it as a torch IterableDataset.

File handles (LMDB environments, HDF5 files, tar descriptors) open lazily in the process that reads,
so a dataset can be created before DataLoader workers fork. This module never imports the pack side.
"""

from __future__ import annotations

import bisect
import functools
import operator
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, SupportsIndex, cast, overload

import numpy as np

from ..core.config import DEFAULT_MAX_PIXELS
from ..core.errors import ConfigError, ManifestError, ShardFormatError, ShardReadError
from ..core.manifest import MANIFEST_NAME, MAX_VERSION, VERSIONS_DIR, Manifest, read_manifest
from ..formats.base import Record
from .epoch import EpochRecord, ShardSpace
from .iteration import EpochIteration
from .options import Location, OpenOptions, ReadOptions, given
from .order import Progress, check_buffer, version_mark
from .samples import Sample, sample_of
from .shards import Shards, check_sizes
from .stream import lanes_for

if TYPE_CHECKING:
    from ..storage.remote import Remote
    from ..storage.store import Store
    from .box_classes import BoxClasses
    from .joined import Joined
    from .mix import MixedDataset
    from .subset import Subset


class ShardDataset(EpochIteration):
    """One shardkit output, as `open_shards` opens it: a map-style dataset of `Sample`s.

    `len(ds)`, `ds[i]` (an int, a slice or a list of ints: a list of samples), `ds.get(key)`;
    iteration in stored (or shuffled) order, split by rank; `ds.loader(...)`, the batch loader;
    `ds.iterable()`, a torch IterableDataset; `ds.set_epoch(e)`. Opened while torch is imported,
    it is also a `torch.utils.data.Dataset` (readers/torch_data), so anything that asks for one
    takes it; DataLoader fetches a batch's samples in one call (`__getitems__`).
    """

    def __init__(
        self,
        folder: Path | str,
        manifest: Manifest,
        options: ReadOptions,
        *,
        remote: Remote | None = None,
        subset: Subset | None = None,
        joined: Joined | None = None,
    ) -> None:
        self.folder = folder
        self.manifest = manifest
        self.options = options
        self.classes = list(manifest.classes)
        self.decode = options.decode
        self.scale = None if options.scale in (None, 1) else options.scale
        self.transform = options.transform
        self.on_error = options.handler
        self.shuffle = options.shuffle
        self.seed = options.seed
        self.shuffle_buffer = check_buffer(options.shuffle_buffer)
        self.rank = options.rank
        self.world_size = options.world_size
        self.drop_last = options.drop_last
        self.max_pixels = options.max_pixels
        self.epoch = 0
        self.skipped = 0  # records skipped with on_error="skip" (in this process)
        self.remote = remote
        self._shards = Shards(folder, manifest, remote, subset, joined)
        self.subset = subset
        self.joined = joined
        self.counts: list[int] = subset.counts if subset is not None else [s.count for s in manifest.shards]
        self._starts: list[int] = np.cumsum([0, *self.counts]).tolist()
        self._key_index: dict[str, tuple[int, int]] | None = None
        self._box_classes: dict[str, BoxClasses] = {}  # box_labels= vocabularies made, by column

    @property
    def format(self) -> str:
        return self.manifest.format

    @property
    def random_access(self) -> bool:
        return self._shards.backend.random_access

    def __len__(self) -> int:
        return self._starts[-1]

    # --- map-style ----------------------------------------------------------------------------

    @overload
    def __getitem__(self, index: SupportsIndex) -> Any: ...

    @overload
    def __getitem__(self, index: slice | Sequence[SupportsIndex]) -> list[Any]: ...

    def __getitem__(self, index: SupportsIndex | slice | Sequence[SupportsIndex]) -> Any:
        """A sample by its place (negative counts from the end), or a list of them for a slice or a
        list of places, as a torch Subset or numpy would take them."""
        if isinstance(index, slice):
            return self.__getitems__(range(len(self))[index])
        if isinstance(index, (list, tuple, range)) or getattr(index, "ndim", 0) > 0:  # (a numpy array, a tensor)
            return self.__getitems__(index)  # type: ignore[arg-type]
        try:
            place = operator.index(index)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"a sample's index is an int, a slice or a list of ints, not {type(index).__name__}"
            ) from None
        return self._at(place)

    def __getitems__(self, indices: Sequence[SupportsIndex]) -> list[Any]:
        """The samples at `indices`, in their order: torch's DataLoader asks for a batch's in one
        call. Read in stored order (a tar's records one after another), handed back as asked."""
        places = [operator.index(i) for i in indices]
        found: dict[int, Any] = {}
        for place in sorted(set(places), key=lambda i: i + len(self) if i < 0 else i):
            found[place] = self._at(place)
        return [found[place] for place in places]

    def _at(self, index: int) -> Any:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = bisect.bisect_right(self._starts, index) - 1
        local = index - self._starts[shard]
        return self._sample(shard, local if self.subset is None else self.subset.position(shard, local), str(index))

    def get(self, key: str) -> Any:
        """The sample stored under `key` (KeyError if there is none)."""
        if self._key_index is None and self.subset is not None:  # the subset's keys, from the index
            shards = np.repeat(np.arange(len(self.counts)), self.counts).tolist()
            kept = zip(self.subset.keys.to_pylist(), shards, self.subset.positions.tolist(), strict=True)
            self._key_index = {key: (shard, position) for key, shard, position in kept}
        if self._key_index is None:
            index: dict[str, tuple[int, int]] = {}
            for shard in range(len(self.manifest.shards)):
                keys = self._shards.keys(shard)
                index.update((key, (shard, local)) for local, key in enumerate(keys))
            self._key_index = index
        shard, position = self._key_index[key]
        return self._sample(shard, position, key)

    def _sample(self, shard: int, position: int, what: str) -> Any:
        """The sample at a stored position of a shard (`what` names it in errors)."""
        name = self.manifest.shards[shard].name
        try:
            return self.decode_record(self._shards.read(shard, position), name)
        except ShardFormatError as error:
            raise ShardReadError(f"{error} (reading record {what})") from None

    def decode_record(self, record: Record, shard_name: str) -> Any:
        """A record of shard `shard_name` as this dataset hands it out (readers/samples.py): decoded
        as `decode` says, its fields, then `transform`; ShardReadError when it does not decode."""
        return sample_of(record, shard_name, self.decode, self.scale, self.max_pixels, self.transform)

    def first_items(self) -> list[EpochRecord]:
        """The output's first record (none when it holds none, or when it cannot be read here), read
        without on_error: what the batch loader checks its options against when it is made."""
        for shard, count in enumerate(self.counts):
            if count:
                position = 0 if self.subset is None else self.subset.position(shard, 0)
                record = self._shards.peek(shard, position)
                return [] if record is None else [EpochRecord(self, shard, record)]
        return []

    def box_classes(self, path: str) -> list[Any]:
        """The sorted distinct categories of column `path` (a dotted path into nested columns, as
        loader's boxes= takes) over every record of this output, read from its index.parquet once:
        what `loader(box_labels=path)` numbers boxes by (text: a box's id is its category's place
        in this list; whole numbers: the number itself). The same whatever select= reads."""
        return list(self.box_vocabulary(path).classes)

    def box_vocabulary(self, path: str) -> BoxClasses:
        """box_classes(path) as the loader uses it (readers/box_classes.py), made once per column."""
        if not isinstance(path, str) or not path:
            raise ConfigError(f"box_labels must be a column name (a string), not {path!r}")
        if path not in self._box_classes:
            from .box_classes import vocabulary
            from .subset import read_index

            if self.manifest.index is None:
                raise ConfigError(
                    f"{self.folder}: this output has no index.parquet, which box_labels= reads its classes from "
                    "(pack it again)"
                )
            where: Path | Store = Path(self.folder) if self.remote is None else self.remote.store
            texts = read_index(where, self.manifest).read(["columns"]).column("columns").to_pylist()
            self._box_classes[path] = vocabulary(texts, path, str(self.folder))
        return self._box_classes[path]

    # --- iterable -----------------------------------------------------------------------------

    @property
    def selection(self) -> str | None:
        """The identity of the subset read (a hash of its kept positions), None for the whole output."""
        return self.subset.identity if self.subset is not None else None

    def fresh_progress(self) -> Progress:
        """The start of this dataset's current epoch (readers/order)."""
        per_shard = len(self) / max(1, len(self.manifest.shards))
        lanes = lanes_for(self.shuffle_buffer, per_shard)
        progress = Progress(
            self.epoch, self.seed, self.shuffle, self.shuffle_buffer, [len(self)], len(self), lanes=lanes
        )
        progress.selection = self.selection  # a state resumes only the subset it was saved on
        if self.manifest.version > 1:  # a state resumes only the version it was saved on
            progress.versions = [version_mark(self.manifest.version, self.manifest.checksum)]
        return progress

    def space(self, progress: Progress) -> ShardSpace:
        """The epoch's positions as records: shards in stored order, or shuffled by (seed, epoch)."""
        return ShardSpace(self, (progress.seed, progress.epoch), progress.shuffle)

    def _shard_id(self, shard: int) -> tuple[str, int, str]:
        info = self.manifest.shards[shard]
        return info.name, info.bytes, info.sha256

    def prefetch(self, shards: Sequence[int]) -> None:
        """Starts downloading the first shards of `shards` a remote output fetches ahead (its
        `Remote.ahead`) into the cache, in the background; nothing for a local output."""
        if self.remote is not None:
            self.remote.prefetch([self._shard_id(shard) for shard in shards[: self.remote.ahead]])

    def close_shard(self, shard: int) -> None:
        """Closes one shard's reader (it opens again when next read): the cache may then evict a
        remote shard's copy."""
        self._shards.close_shard(shard)

    def records(self, shard: int) -> Iterator[Record]:
        """The stored records of one shard, in order and undecoded."""
        return self._shards.records(shard)

    def shard_samples(self, shard: int, start: int = 0, stop: int | None = None) -> Iterator[Any]:
        """The samples [start, stop) of one shard, in stored order, decoded and transformed."""
        name = self.manifest.shards[shard].name
        for record in self.read_range(shard, start, stop):
            try:
                yield self.decode_record(record, name)
            except ShardReadError as error:
                self.on_error(error, self)

    def read_range(self, shard: int, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """The records [start, stop) of one shard as this dataset counts them (a subset: its kept
        records), undecoded, with any joined columns, checked against the manifest's count: a
        damaged shard raises ShardReadError, or with on_error="skip" ends the run early (counted in
        `skipped`; the caller sees fewer records than it asked for)."""
        stop = self.counts[shard] if stop is None else stop
        return self._shards.read_range(shard, start, stop, self._failed)

    def _failed(self, error: ShardReadError) -> None:
        self.on_error(error, self)

    def close(self) -> None:
        self._shards.close()
        if self.remote is not None:
            self.remote.close()


@overload
def open_shards(
    path: Location,
    *,
    decode: str = "rgb",
    scale: float | None = None,
    transform: Callable[[Sample], Any] | None = None,
    on_error: str = "raise",
    shuffle: bool = False,
    seed: int = 0,
    shuffle_buffer: int = 1000,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    cache_limit: str | int | None = None,
    weights: Sequence[float] | None = None,
    length: int | None = None,
    exhausted: str = "resample",
    select: Any = None,
    join: Any = None,
    version: int | None = None,
) -> ShardDataset: ...


@overload
def open_shards(
    path: list[Location] | tuple[Location, ...],
    *,
    decode: str = "rgb",
    scale: float | None = None,
    transform: Callable[[Sample], Any] | None = None,
    on_error: str = "raise",
    shuffle: bool = False,
    seed: int = 0,
    shuffle_buffer: int = 1000,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    cache_limit: str | int | None = None,
    weights: Sequence[float] | None = None,
    length: int | None = None,
    exhausted: str = "resample",
    select: Any = None,
    join: Any = None,
    version: int | None = None,
) -> MixedDataset: ...


def open_shards(
    path: Location | list[Location] | tuple[Location, ...],
    *,
    decode: str = "rgb",
    scale: float | None = None,
    transform: Callable[[Sample], Any] | None = None,
    on_error: str = "raise",
    shuffle: bool = False,
    seed: int = 0,
    shuffle_buffer: int = 1000,
    rank: int | None = None,
    world_size: int | None = None,
    drop_last: bool = False,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    storage_options: dict[str, Any] | None = None,
    cache_dir: Location | None = None,
    cache_limit: str | int | None = None,
    weights: Sequence[float] | None = None,
    length: int | None = None,
    exhausted: str = "resample",
    select: Any = None,
    join: Any = None,
    version: int | None = None,
) -> ShardDataset | MixedDataset:
    """Open a shardkit output folder (or its manifest.json); the format comes from the manifest.

    decode: "rgb" (HWC uint8 numpy), "bytes", "pil" or "torch" (CHW uint8 tensor). scale: 1/2, 1/4
    or 1/8 decodes JPEG in the DCT domain. rank/world_size default to torch.distributed's when it is
    initialised; iteration gives every rank the same number of samples (see `samples_per_rank`; with
    drop_last=True the remainder of an uneven split is left out instead of repeated).
    on_error="skip" skips unreadable records during iteration and counts them (a skipped record
    makes that rank's epoch one shorter: run `shardkit verify` first). max_pixels: a record whose
    header claims more pixels is refused before it is decoded (shards may come from strangers).

    `path` may be a URL fsspec reaches: s3://bucket/prefix, gs://..., https://host/path (credentials
    and endpoints the standard way: AWS_* variables, AWS_ENDPOINT_URL, profiles; or
    `storage_options`, fsspec's keywords). Remote shards are read through a local cache of whole
    shards shared by every process of the machine: `cache_dir` (default ~/.cache/shardkit, or
    SHARDKIT_CACHE), at most `cache_limit` bytes ("50GB" by default; least recently used shards are
    evicted). Each shard is downloaded once, checked against the manifest's sha256; iteration fetches
    the next shards of the epoch in the background.

    A list of outputs (local or remote, any formats) makes a weighted mix (readers/mix): each
    sample comes from output i with probability weights[i] (equal weights by default), drawn
    deterministically per seed and epoch. An epoch of the mix is `length` samples (default: the
    outputs' records together); an output that runs out within it starts again in a fresh order
    (exhausted="resample", the default), or the epoch ends before the first sample an output cannot
    give (exhausted="stop"). Ranks, workers, the loader and checkpoints work on a mix as on one
    output; labels are each output's own (`ds.classes` is a list per output).

    select reads a subset without packing again, resolved from the output's index.parquet before any
    shard is opened (readers/subset): a list of keys, a pyarrow Expression over the index's columns
    (`pc.field("label") < 10`), or a callable given the index as a Table and returning a boolean
    mask or a filtered Table. The subset keeps the stored order; len, ds[i], get, iteration, ranks,
    workers, the loader and checkpoints see only it (a checkpoint resumes only the subset it was
    saved on). join adds columns without rewriting a shard (readers/joined): a parquet, CSV or JSONL
    file or a pyarrow Table with a `key` column; its other columns join each sample's `fields`
    (None for a record the table lacks). A mix takes select as a filter applied to each output.

    version reads an earlier version of the output, one a change kept whole with --keep-versions
    (`OUT/versions/vN`, what `shardkit remove|compact|pack --append ... --keep-versions` leave);
    None or the output's own version reads the output as it is.
    """
    options, opening = given(ReadOptions, locals()), given(OpenOptions, locals())
    if isinstance(path, (list, tuple)):
        return _open_mix(path, options, opening)
    if weights is not None or length is not None:
        raise ConfigError("weights and length are for a mix: pass a list of outputs")
    return _open_one(path, options, opening)


def _open_mix(paths: list[Location] | tuple[Location, ...], options: ReadOptions, opening: OpenOptions) -> MixedDataset:
    """A weighted mix of the outputs at `paths` (readers/mix): each output opened alone, unshuffled
    and unsplit, as the mix's positions are drawn, shuffled and split by the mix."""
    from .mix import MixedDataset

    if not paths:
        raise ConfigError("open_shards needs at least one output to mix")
    if options.join is not None or (options.select is not None and not _filters(options.select)):
        raise ConfigError(
            "a mix takes select as a filter (an Expression or a callable, applied to each output), "
            "not keys or join: open one output for those"
        )
    per_source = replace(options, shuffle=False, rank=None, world_size=None, drop_last=False)
    return MixedDataset([_open_one(p, per_source, opening) for p in paths], options, opening)


def _open_one(path: Location, options: ReadOptions, opening: OpenOptions) -> ShardDataset:
    from ..storage.location import locate

    storage_options = opening.storage_options
    folder = locate(path, storage_options)
    if opening.version is not None:
        folder = _version(folder, opening.version)
    if not isinstance(folder, Path):  # a Store: the shards are read through the local cache
        from ..storage.cache import ShardCache
        from ..storage.remote import Remote
        from ..storage.store import read_remote_manifest

        cache = ShardCache.at(opening.cache_dir, opening.cache_limit)  # a bad limit is refused before any request
        remote = Remote(folder, cache)
        manifest = read_remote_manifest(folder)
        subset, joined = _narrowed(folder, manifest, options, storage_options)
        return _dataset_class()(folder.url, manifest, options, remote=remote, subset=subset, joined=joined)
    manifest = read_manifest(folder)
    check_sizes(folder, manifest)
    subset, joined = _narrowed(folder, manifest, options, storage_options)
    return _dataset_class()(folder, manifest, options, subset=subset, joined=joined)


def _version(folder: Path | Store, version: Any) -> Path | Store:
    """The folder of `version` of the output at `folder`: the output itself at its own version, or
    the one --keep-versions kept (versions/vN); ConfigError naming the versions there are."""
    if type(version) is not int or not 1 <= version <= MAX_VERSION:
        raise ConfigError(f"version must be a version number (1 or more), not {version!r}")
    if not isinstance(folder, Path):  # a bucket's kept versions are prefixes: versions/vN/
        from ..storage.store import Store, kept_versions, read_remote_manifest

        at = read_remote_manifest(folder).version
        if version == at:
            return folder
        earlier = Store(folder.child(f"{VERSIONS_DIR}/v{version}"), folder.options)
        try:
            found = read_remote_manifest(earlier).version
        except ManifestError:
            found = None
        if found is not None and found != version:
            raise ConfigError(f"{earlier.url}: holds version {found}, not {version}")
        if found is not None:
            return earlier
        there = kept_versions(folder)
        said = f"kept: {', '.join(map(str, there))}" if there else "none kept (--keep-versions keeps them)"
        raise ConfigError(f"{folder.url}: has no version {version} (it is at version {at}; {said})")
    manifest = read_manifest(folder)
    if version == manifest.version:
        return folder
    kept = folder / VERSIONS_DIR / f"v{version}"
    if (kept / MANIFEST_NAME).is_file() and not kept.is_symlink():
        if read_manifest(kept).version != version:  # (changed since it was kept: not that version)
            raise ConfigError(f"{kept}: holds version {read_manifest(kept).version}, not {version}")
        return kept
    there = sorted(
        int(entry.name[1:]) for entry in _entries(folder / VERSIONS_DIR) if re.fullmatch(r"v[0-9]{1,10}", entry.name)
    )
    said = f"kept: {', '.join(map(str, there))}" if there else "none kept (--keep-versions keeps them)"
    raise ConfigError(f"{folder}: has no version {version} (it is at version {manifest.version}; {said})")


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    try:
        return list(os.scandir(folder))
    except OSError:
        return []


def _dataset_class() -> type[ShardDataset]:
    """ShardDataset, or with torch imported, its twin that is also a torch Dataset: a training script
    gets a real `torch.utils.data.Dataset`, and a script without torch never imports it."""
    return _torch_twin() if "torch" in sys.modules else ShardDataset


@functools.cache
def _torch_twin() -> type[ShardDataset]:
    """TorchShardDataset: ShardDataset and torch's map-style Dataset, nothing else different. Made
    on first use (torch is imported already) and found by pickle as this module's attribute."""
    from torch.utils.data import Dataset

    twin = type("TorchShardDataset", (ShardDataset, Dataset), {"__module__": __name__, "__doc__": _torch_twin.__doc__})
    return cast(type[ShardDataset], twin)


def __getattr__(name: str) -> Any:
    if name == "TorchShardDataset":  # (pickle's way to the twin, in a DataLoader worker)
        return _torch_twin()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _filters(select: Any) -> bool:
    """Whether `select` is a filter (a callable or a pyarrow Expression), not a list of keys."""
    if callable(select):
        return True
    compute = sys.modules.get("pyarrow.compute")
    return compute is not None and isinstance(select, compute.Expression)


def _narrowed(
    where: Path | Store, manifest: Manifest, options: ReadOptions, storage_options: dict[str, Any] | None
) -> tuple[Subset | None, Joined | None]:
    """The subset `select` keeps and the columns `join` adds, both from the output's index.parquet
    (fetched once for a remote output): no shard is read."""
    if options.select is None and options.join is None:
        return None, None
    from .subset import read_index, select

    index = read_index(where, manifest)
    name = str(where) if isinstance(where, Path) else where.url
    subset = select(index, options.select, name) if options.select is not None else None
    joined = None
    if options.join is not None:
        from .joined import join

        joined = join(index, options.join, name, storage_options)  # (a table at a URL: the same options)
    return subset, joined

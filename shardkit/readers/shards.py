"""An output's records as a dataset reads them, undecoded: a format's reader per shard (opened
lazily in the process that reads; a remote output's through the local cache of whole shards),
every read checked against the manifest's record counts, a subset's kept records read as a few
ranges per shard (readers/subset), a join's columns added as each record is read (readers/joined),
and random access on a remote output keeping only its last few shards open. The dataset
(readers/dataset.py) makes samples of them."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..core.errors import ConfigError, ManifestError, ShardFormatError, ShardReadError, StorageError, describe
from ..core.manifest import Manifest
from ..core.safeio import check_regular
from ..formats import get_format
from ..formats.base import Backend, Record, ShardReader
from ..formats.folder_labels import FolderLabels, folder_classes
from .subset import runs

if TYPE_CHECKING:
    from ..storage.remote import Remote
    from .joined import Joined
    from .subset import Subset

OPEN_REMOTE_SHARDS = 8  # remote shards random access keeps open per process


def check_sizes(folder: Path, manifest: Manifest) -> None:
    """A local output's shards are the manifest's: a cheap stat catches a truncated or replaced
    shard before any is opened or mapped."""
    for shard in manifest.shards:
        try:
            size = check_regular(folder / shard.name).st_size
        except FileNotFoundError:
            raise ShardFormatError(f"{folder / shard.name}: listed in the manifest but missing") from None
        except OSError as error:
            raise ShardFormatError(f"{folder / shard.name}: {describe(error)}") from None
        if size != shard.bytes:
            raise ShardFormatError(
                f"{folder / shard.name}: {size:,} bytes, the manifest says {shard.bytes:,} (truncated or replaced?)"
            )


class Shards:
    """The shards of one output: `read` one record, `read_range` a run of them, `keys` of one shard,
    each shard's record count checked against the manifest's before its records are trusted."""

    def __init__(
        self,
        folder: Path | str,
        manifest: Manifest,
        remote: Remote | None,
        subset: Subset | None,
        joined: Joined | None,
    ) -> None:
        self.manifest, self.remote, self.subset, self.joined = manifest, remote, subset, joined
        try:
            self.backend: Backend = get_format(manifest.format)
        except ConfigError:
            raise ManifestError(f"{folder}: unknown shard format {manifest.format[:40]!r} in the manifest") from None
        self._readers: list[ShardReader]
        if remote is None:
            self._readers = [self.backend.reader(os.path.join(folder, s.name)) for s in manifest.shards]
        else:  # whole shards through the local cache, fetched on first use in each process
            from .cached import CachedShardReader

            self._readers = [
                CachedShardReader(self.backend.reader, remote, s.name, s.bytes, s.sha256) for s in manifest.shards
            ]
        classes = folder_classes(manifest.settings, manifest.classes)
        if classes is not None:  # tars adopted with --folder-labels: a record's label is its folder's
            self._readers = [FolderLabels(reader, classes) for reader in self._readers]
        self._stored_starts: list[int] = np.cumsum([0] + [s.count for s in manifest.shards]).tolist()
        self._counted: set[int] = set()  # shards whose record count was checked against the manifest
        self._open_remote: OrderedDict[int, None] = OrderedDict()  # remote shards random access holds open

    def where(self, shard: int) -> str:
        return self._readers[shard].path

    def check_count(self, shard: int) -> None:
        """Random access trusts the manifest's counts: the shard must hold exactly that many records."""
        if shard not in self._counted:
            found, listed = len(self._readers[shard]), self.manifest.shards[shard].count
            if found != listed:
                raise ShardFormatError(f"{self.where(shard)}: holds {found:,} records, the manifest says {listed:,}")
            self._counted.add(shard)

    def read(self, shard: int, position: int) -> Record:
        """The record at a stored position of a shard, with any joined columns (ShardFormatError
        when the shard is damaged)."""
        try:
            self.check_count(shard)
            record = self._readers[shard].read(position)
            return record if self.joined is None else self.joined.add(record, self._stored_starts[shard] + position)
        finally:
            if self.remote is not None:
                self._keep_open(shard)

    def peek(self, shard: int, position: int) -> Record | None:
        """The record at a stored position, read as a stream's first (no member table is built), or
        None where it cannot be read: whoever reads it next says why, under its on_error."""
        reader = self._readers[shard]
        try:
            return next(iter(reader.read_range(position, position + 1)), None)
        except (ShardFormatError, ShardReadError, StorageError):
            return None
        finally:
            if self.remote is not None:
                reader.close()

    def keys(self, shard: int) -> list[str]:
        """A shard's keys in stored order (ShardReadError naming the shard when it is damaged)."""
        reader = self._readers[shard]
        try:
            self.check_count(shard)
            return reader.keys()
        except ShardFormatError as error:
            raise ShardReadError(str(error)) from None  # it names the shard's path
        finally:
            if self.remote is not None:
                reader.close()

    def _keep_open(self, shard: int) -> None:
        """Random access keeps the last few remote shards open, not all it ever touched: each open
        one holds descriptors, and a cached copy the cache evicted still takes its disk space."""
        self._open_remote[shard] = None
        self._open_remote.move_to_end(shard)
        while len(self._open_remote) > OPEN_REMOTE_SHARDS:
            oldest, _ = self._open_remote.popitem(last=False)
            self._readers[oldest].close()

    def read_range(
        self, shard: int, start: int, stop: int, failed: Callable[[ShardReadError], None]
    ) -> Iterator[Record]:
        """The records [start, stop) of one shard as the dataset counts them (a subset: its kept
        records), with any joined columns, checked against the manifest's count: a damaged shard is
        a ShardReadError handed to `failed` (the dataset's on_error), after the records read before
        the damage; where `failed` returns, the run ends early."""
        if self.subset is None:
            records = self._read_stored(shard, start, stop, failed)
            if self.joined is None:
                return records
            return self.joined.added(records, self._stored_starts[shard] + start)
        return self._read_kept(shard, self.subset.kept(shard)[start:stop], failed)

    def _read_kept(self, shard: int, kept: np.ndarray, failed: Callable[[ShardReadError], None]) -> Iterator[Record]:
        """The records at sorted stored positions `kept` of a shard: runs of nearby positions read
        as one range, the records between skipped (reads stay sequential within the shard)."""
        base = self._stored_starts[shard]
        for first, stop, begin, end in runs(kept):
            wanted = kept[begin:end].tolist()
            at, got = first, 0
            for record in self._read_stored(shard, first, stop, failed):
                if at == wanted[got]:
                    yield record if self.joined is None else self.joined.add(record, base + at)
                    got += 1
                at += 1
            if got < len(wanted):  # a damaged shard, skipped (on_error="skip"): read no more of it
                return

    def _read_stored(
        self, shard: int, start: int, stop: int, failed: Callable[[ShardReadError], None]
    ) -> Iterator[Record]:
        """The records [start, stop) of one shard as stored, checked against the manifest's count."""
        where, count = self.where(shard), self.manifest.shards[shard].count
        wanted = stop - start
        read = 0
        failure: ShardReadError | None = None
        try:
            # A run to the shard's end asks for one record more: there must be none (cheap: one header)
            for record in self._readers[shard].read_range(start, stop + 1 if stop == count else stop):
                read += 1
                if read > wanted:
                    raise ShardFormatError(f"{where}: holds more than the {count:,} records the manifest says")
                yield record
            if read < wanted:  # the manifest promised more: never end an epoch short in silence
                raise ShardFormatError(f"{where}: ends after {start + read:,} records, the manifest says {count:,}")
        except ShardFormatError as error:
            failure = ShardReadError(str(error))
        if failure is not None:  # (raised here, not in the except: the ShardFormatError is no context of it)
            failed(failure)

    def records(self, shard: int) -> Iterator[Record]:
        """The stored records of one shard, in order and unchecked."""
        return iter(self._readers[shard])

    def close_shard(self, shard: int) -> None:
        self._readers[shard].close()

    def close(self) -> None:
        for reader in self._readers:
            reader.close()

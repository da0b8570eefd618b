"""Where `shardkit index` adopts tars: a local folder or a bucket prefix, behind one small
interface, so that packing/adopt.py never asks which kind it holds. `tar_place` picks the kind once,
from the location `storage.location.locate` gives."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..core.errors import ConfigError, OutputError, StorageError, describe
from ..core.manifest import ERRORS_NAME, MANIFEST_NAME, Manifest, read_manifest, write_json_atomic, write_text_atomic
from ..storage.location import locate
from ..storage.store import Store, read_remote_manifest


class TarPlace(Protocol):
    """What index needs of the place its tars are in."""

    @property
    def where(self) -> str:
        """The place as messages name it."""
        ...

    @property
    def store(self) -> Store | None:
        """The bucket a scanning worker downloads a tar from (None: a local folder)."""
        ...

    def names(self) -> tuple[set[str], list[str], bool]:
        """Every name at its top level, its .tar files in sorted order, and whether a manifest is
        there; refuses a place that cannot hold what index writes."""
        ...

    def refuse_unwritable(self) -> None:
        """Refuses, before the scan, a place index cannot write its files to."""
        ...

    def manifest(self) -> Manifest:
        """The manifest there (ManifestError or StorageError when it cannot be read)."""
        ...

    def work_folder(self) -> contextlib.AbstractContextManager[str]:
        """A folder the scanning workers read tars in: the tars' own, or a temporary one."""
        ...

    def local_copy(self, name: str) -> contextlib.AbstractContextManager[str]:
        """A path of tar `name` on this machine, for as long as the context lasts."""
        ...

    def put(self, files: dict[str, bytes], errors: str, manifest: Manifest) -> None:
        """The files beside the tars and errors.jsonl, the manifest last (a run stopped half way
        leaves no manifest)."""
        ...


def tar_place(folder: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> TarPlace:
    """`folder` as the place index adopts tars in (nothing is touched here)."""
    root = locate(folder, storage_options, manifest=False)
    return LocalTars(root) if isinstance(root, Path) else BucketTars(root)


@dataclass
class LocalTars:
    """Tars in a local folder: read where they are, the files written beside them atomically."""

    root: Path

    @property
    def where(self) -> str:
        return str(self.root)

    @property
    def store(self) -> None:
        return None

    def names(self) -> tuple[set[str], list[str], bool]:
        if not self.root.is_dir():
            raise ConfigError(f"{self.root}: not a folder")
        here = {entry.name for entry in os.scandir(self.root)}
        tars = sorted(name for name in here if name.endswith(".tar") and (self.root / name).is_file())
        if not os.access(self.root, os.W_OK):
            raise OutputError(f"{self.root}: cannot write here (permission denied); index a copy you can write to")
        return here, tars, (self.root / MANIFEST_NAME).exists()

    def refuse_unwritable(self) -> None:
        return None  # (names() asked the folder already)

    def manifest(self) -> Manifest:
        return read_manifest(self.root)

    @contextlib.contextmanager
    def work_folder(self) -> Iterator[str]:
        yield str(self.root)

    @contextlib.contextmanager
    def local_copy(self, name: str) -> Iterator[str]:
        yield str(self.root / name)

    def put(self, files: dict[str, bytes], errors: str, manifest: Manifest) -> None:
        try:
            with contextlib.suppress(FileNotFoundError):
                (self.root / MANIFEST_NAME).unlink()  # --overwrite: no stale manifest while the rest changes
            for name, data in files.items():
                write_text_atomic(self.root / name, data.decode("utf-8"))  # (names are UTF-8: the walk checked)
            write_text_atomic(self.root / ERRORS_NAME, errors)
            write_json_atomic(self.root / MANIFEST_NAME, manifest.to_json())
        except OSError as error:
            raise OutputError(f"{self.root}: cannot write the index files ({describe(error)})") from None


@dataclass
class BucketTars:
    """Tars under a bucket prefix: downloaded to scan, the files uploaded beside them."""

    store: Store

    @property
    def where(self) -> str:
        return self.store.url

    def names(self) -> tuple[set[str], list[str], bool]:
        listing = self.store.listing()  # (files only: a bucket has no .shardkit/ folder to see)
        return set(listing), sorted(name for name in listing if name.endswith(".tar")), MANIFEST_NAME in listing

    def refuse_unwritable(self) -> None:
        self.store.write(f"{ERRORS_NAME}.probe", b"")
        self.store.delete(f"{ERRORS_NAME}.probe")

    def manifest(self) -> Manifest:
        return read_remote_manifest(self.store)

    @contextlib.contextmanager
    def work_folder(self) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="shardkit-index-") as temp:
            yield temp

    @contextlib.contextmanager
    def local_copy(self, name: str) -> Iterator[str]:
        with tempfile.TemporaryDirectory(prefix="shardkit-index-") as temp:
            yield self.store.get(name, os.path.join(temp, name))

    def put(self, files: dict[str, bytes], errors: str, manifest: Manifest) -> None:
        try:
            self.store.delete(MANIFEST_NAME)
            for name, data in files.items():
                self.store.write(name, data)
            self.store.write(ERRORS_NAME, errors.encode())
            self.store.write(MANIFEST_NAME, (json.dumps(manifest.to_json(), indent=2, sort_keys=True) + "\n").encode())
        except StorageError as error:
            raise OutputError(f"cannot write the index files ({error})") from None
        except OSError as error:  # (what the store's retries let through: a path that is not a file)
            raise OutputError(f"{self.where}: cannot write the index files ({describe(error)})") from None

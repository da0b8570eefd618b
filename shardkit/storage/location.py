"""The one entry that opens an output local or remote: `locate` turns a folder, a file:// URL, an
object-storage URL or either's manifest.json into a local folder or a Store. The reader, verify,
bench and pack call it, so the two kinds are told apart (and storage options given with a local
path refused) in one place."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.manifest import MANIFEST_NAME
from .urls import is_remote, local_path, refuse_local_options, split_manifest_url

if TYPE_CHECKING:
    from .store import Store


def locate(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, manifest: bool = True
) -> Path | Store:
    """A URL fsspec reaches (s3://, gs://, https://...) as a Store holding `storage_options`; a
    path or file:// URL as a local folder (with storage options it is refused: a URL that lost its
    scheme?). With `manifest` (an output being read), a path to its manifest.json means its folder."""
    if is_remote(path):
        from .store import Store  # here: a local read never imports the HTTP path

        url = os.fspath(path)
        return Store(split_manifest_url(url) if manifest else url, dict(storage_options or {}))
    refuse_local_options(path, storage_options)
    folder = Path(local_path(path))
    if manifest and folder.name == MANIFEST_NAME and folder.is_file():
        folder = folder.parent
    return folder

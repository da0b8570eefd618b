"""Telling a URL from a path, and the options that reach a URL: the only place that knows the two
apart (every other module asks `is_remote`)."""

from __future__ import annotations

import json
import os
import re
from typing import Any
from urllib.parse import unquote

from ..core.errors import ConfigError
from ..core.manifest import MANIFEST_NAME

URL_SCHEME = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://")
# which extra brings the filesystem of a protocol (fsspec names the package, not our extra)
PROTOCOL_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}


def is_remote(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a URL fsspec opens (s3://, gs://, https://, ...) rather than a local path.
    file:// URLs count as local."""
    match = URL_SCHEME.match(os.fspath(path)) if isinstance(path, str) else None
    return match is not None and match.group(1).lower() != "file"


def refuse_local_options(path: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> None:
    """Storage options given with a local path are a mistake (a URL lost its scheme?): say so."""
    if storage_options:
        raise ConfigError(f"{os.fspath(path)}: storage_options are for URLs (s3://, https://, ...), not local folders")


def local_path(path: str | os.PathLike[str]) -> str:
    """A local path from a path or a file:// URL."""
    text = os.fspath(path)
    return text[len("file://") :] if text.lower().startswith("file://") else text


def parse_storage_options(pairs: list[str] | None) -> dict[str, Any]:
    """`--storage-option key=value` pairs as fsspec keywords: values are JSON when they parse
    (numbers, true, {...}), strings otherwise; dotted keys nest (client_kwargs.region_name=...)."""
    options: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"storage option {pair!r} is not key=value")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        node = options
        for name in parents:
            node = node.setdefault(name, {})
            if not isinstance(node, dict):
                raise ConfigError(f"storage option {key!r} nests under a value that is not a mapping")
        node[leaf] = value
    return options


def split_manifest_url(url: str) -> str:
    """The folder URL of a folder or manifest.json URL."""
    url = url.rstrip("/")
    return url[: -len(MANIFEST_NAME) - 1] if url.endswith("/" + MANIFEST_NAME) else url


def split_object_url(url: str) -> tuple[str, str]:
    """The folder URL and the name of a URL to one object, the name as a `Store` of that folder
    names it: an http(s) URL's percent-escapes decoded (the store quotes names itself)."""
    folder, _, name = url.rstrip("/").rpartition("/")
    scheme = URL_SCHEME.match(url)
    if scheme is not None and scheme.group(1).lower() in ("http", "https"):
        name = unquote(name)
    return folder, name

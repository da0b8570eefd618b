"""Labels from class folders, for tars someone else made of a class-folder tree (`tar --sort=name
-cf train.tar -C train .`): such tars carry no `.cls` member, but every key starts with its class's
folder. `shardkit index --folder-labels` names the classes from those folders in the manifest;
readers then give each record its folder's label through `FolderLabels`. A key's folder is one
rule, here, for both."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .base import Record, ShardReader

FOLDER_LABELS = "folders"  # the manifest's settings.adopted.labels when the labels are the folders


def folder_classes(settings: dict[str, Any], classes: Sequence[str]) -> Sequence[str] | None:
    """The class names records take their labels from by folder (a manifest's classes), or None
    where the output's records carry their own labels."""
    adopted = settings.get("adopted")
    return classes if isinstance(adopted, dict) and adopted.get("labels") == FOLDER_LABELS else None


def key_folder(key: str) -> str | None:
    """The class folder a key starts with ("./cat/x" and "cat/x": "cat"), None for a key at the top."""
    while key.startswith("./"):  # `tar -C DIR .` names every member ./...
        key = key[2:]
    folder, slash, _ = key.partition("/")
    return folder if slash and folder not in ("", ".", "..") else None


class FolderLabels(ShardReader):
    """A shard's reader whose records take their label from their key's class folder (None for a
    key in no folder, or in a folder the manifest does not name)."""

    def __init__(self, inner: ShardReader, classes: Sequence[str]) -> None:
        super().__init__(inner.path)
        self.inner = inner
        self.labels = {name: label for label, name in enumerate(classes)}

    def _labelled(self, record: Record) -> Record:
        folder = key_folder(record.key)
        return record._replace(label=None if folder is None else self.labels.get(folder))

    def __len__(self) -> int:
        return len(self.inner)

    def keys(self) -> list[str]:
        return self.inner.keys()

    def read(self, index: int) -> Record:
        return self._labelled(self.inner.read(index))

    def read_range(self, start: int, stop: int) -> Iterator[Record]:
        return map(self._labelled, self.inner.read_range(start, stop))

    def positions(self) -> dict[str, int]:
        return self.inner.positions()

    def close(self) -> None:
        self.inner.close()

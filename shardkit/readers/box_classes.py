"""`loader(box_labels=...)`: each box's class id, from a column of categories aligned with the boxes
(Hugging Face's `objects.category`), through a vocabulary made once per output and column from the
output's index.parquet: the sorted distinct categories of that column over all its records. Text
categories (COCO's names in Hugging Face's sets: "person", "dog") get their place in that list as
id; when every category is a whole number, the numbers are the ids already and pass through. Made
from the index alone, never from what one process read, the ids are the same on every rank, worker
and resume, and whatever subset `select=` reads.

A column no record has, or one that is a list in none, is refused up front (ConfigError); a record
whose column is missing, is not a list, holds something that is no category or counts other than
its boxes, is a failure of that record (ImageError, which the loader hands to on_error)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.errors import ConfigError, ImageError
from ..core.safeio import loads
from .order import shown
from .targets import column_value

Category = str | int
INT64 = (-(2**63), 2**63 - 1)


def category(value: Any) -> Category | None:
    """`value` as a category (text, or a whole number an int64 holds), else None."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and INT64[0] <= value <= INT64[1]:
        return value
    return None


@dataclass(frozen=True)
class BoxClasses:
    """One column's vocabulary: `classes`, its sorted distinct categories (text, or numbers that are
    their own ids)."""

    path: str
    classes: tuple[Category, ...]
    numeric: bool
    _ids: dict[Category, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ids", {value: i for i, value in enumerate(self.classes)})

    def ids(self, value: Any, boxes: int) -> np.ndarray:
        """A record's column (`value`) as int64 ids, one per box of its `boxes`; ImageError saying why not."""
        if not isinstance(value, list):
            raise ImageError("box_labels", f"column {self.path!r} is {shown(value)}, not a list of categories")
        if len(value) != boxes:
            raise ImageError("box_labels", f"column {self.path!r} holds {len(value):,} labels for {boxes:,} boxes")
        ids = np.empty(boxes, np.int64)
        for i, item in enumerate(value):
            found = category(item)
            if found is None or isinstance(found, str) == self.numeric:
                kind = "whole numbers" if self.numeric else "text"
                raise ImageError("box_labels", f"column {self.path!r} holds {shown(item)}: its categories are {kind}")
            ids[i] = found if isinstance(found, int) else self._id(found)
        return ids

    def _id(self, name: str) -> int:
        try:
            return self._ids[name]
        except KeyError:
            raise ImageError(
                "box_labels", f"category {shown(name)} of {self.path!r} is not in the output's index.parquet"
            ) from None


def vocabulary(texts: Iterable[str | None], path: str, name: str) -> BoxClasses:
    """The vocabulary of column `path` over index.parquet's `columns` texts (one JSON object a
    record, None for a record without columns) of output `name`."""
    words: set[str] = set()
    numbers: set[int] = set()
    found = lists = 0
    other: Any = None
    for text in texts:
        if text is None:
            continue
        try:
            value = column_value(_object(loads(text)), path)
        except (KeyError, ValueError):  # (a record without it, or text that is no JSON object)
            continue
        found += 1
        if not isinstance(value, list):
            other = value if other is None else other
            continue
        lists += 1
        for item in value:
            kept = category(item)
            if isinstance(kept, str):
                words.add(kept)
            elif kept is not None:
                numbers.add(kept)
    return _made(path, name, words, numbers, found, lists, other)


def _object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _made(path: str, name: str, words: set[str], numbers: set[int], found: int, lists: int, other: Any) -> BoxClasses:
    if not found:
        raise ConfigError(f"box_labels: no record of {name} has a column {path!r} (its index.parquet's columns)")
    if not lists:
        raise ConfigError(
            f"box_labels: {path!r} is {shown(other)} in {name}, in every record: not a list of categories"
        )
    if words and numbers:
        raise ConfigError(
            f"box_labels: {path!r} holds both text ({shown(min(words))}) and numbers ({min(numbers)}) in {name}: "
            "one kind of category a column (select= reads the records of one kind)"
        )
    if numbers:
        return BoxClasses(path, tuple(sorted(numbers)), True)
    return BoxClasses(path, tuple(sorted(words)), False)


def merged(vocabularies: Sequence[BoxClasses], path: str) -> BoxClasses:
    """A mix's vocabulary: its outputs' categories together (one kind for all of them)."""
    kinds = {v.numeric for v in vocabularies if v.classes}
    if len(kinds) > 1:
        raise ConfigError(f"box_labels: {path!r} holds text in one output of the mix and numbers in another")
    numeric = kinds == {True}
    values = {value for v in vocabularies for value in v.classes}
    if numeric:
        return BoxClasses(path, tuple(sorted(v for v in values if isinstance(v, int))), True)
    return BoxClasses(path, tuple(sorted(v for v in values if isinstance(v, str))), False)

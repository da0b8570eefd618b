"""What every source convention yields: `Item`s (one sample each, typed), and the rules every
convention shares (keys from paths, labels, how a name is shown, a skipped input). The walk that
streams them is `base.SourceWalk`."""

from __future__ import annotations

import json
import os
import re
from typing import Any, NamedTuple
from urllib.parse import quote

from ...core.config import LABEL_RULE, MAX_LABEL
from ...core.errors import Failure

Caption = str | list[str]  # one caption, or several (a table's list column)


class Span(NamedTuple):
    """A span table's row: the part of its video that is the row's one clip (seconds on the video's
    timeline, `end` excluded), and where the row is (its errors name it: "spans.csv line 3")."""

    start: float
    end: float
    where: str


# Characters kept as they are in keys; everything else (and '.') is percent-escaped so keys are
# ASCII, unique, and safe for tar member names where '.' separates the key from the extension.
_KEY_SAFE = "/ _-'()+,;=@!~&$[]"

_DIGITS = re.compile(r"[0-9]{1,19}")  # ASCII digits only (str.isdigit takes '²', which int() refuses)


class Item(NamedTuple):
    """One sample to pack (a NamedTuple: a walk builds millions, far cheaper to make than dataclasses).
    A table row brings `text` and `columns`; a sidecar sample names its other files in `sidecars`
    ({part: file name in the image's folder}), read by the worker beside the image."""

    path: str  # where to read the file
    relpath: str  # relative to the source root, '/'-separated: what the user sees and metadata keeps
    key: str
    label: int | None = None
    text: Caption | None = None
    columns: dict[str, Any] | None = None
    sidecars: dict[str, str] | None = None
    span: Span | None = None  # a span table's row: its video's one clip


def payload(item: Item) -> str:
    """An item's caption, columns or sidecar names as one canonical JSON text ("" when it has none):
    what the plan's fingerprint hashes (so a changed caption rewrites its shard) and what --shuffle's
    compact list keeps. `with_payload` reads it back."""
    if item.sidecars is not None:
        return json.dumps({"sidecars": item.sidecars}, sort_keys=True, ensure_ascii=False)
    if item.span is not None:  # (a changed span rewrites its shard, as a changed caption does)
        extra = json.loads(row_json(item.text, item.columns))
        extra["span"] = list(item.span)
        return json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    if item.text is None and item.columns is None:
        return ""
    return row_json(item.text, item.columns)


def row_json(text: Caption | None, columns: dict[str, Any] | None) -> str:
    """A table row's caption and columns as canonical JSON; ValueError for NaN or infinity."""
    extra: dict[str, Any] = {}
    if text is not None:
        extra["text"] = text
    if columns is not None:
        extra["columns"] = columns
    return json.dumps(extra, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def with_payload(item: Item, text: str) -> Item:
    """`item` with the fields `payload` wrote into `text` (JSON shardkit wrote itself)."""
    if not text:
        return item
    fields = json.loads(text)
    span = Span(*fields["span"]) if "span" in fields else None
    return item._replace(
        text=fields.get("text"), columns=fields.get("columns"), sidecars=fields.get("sidecars"), span=span
    )


class Run(NamedTuple):
    """Consecutive files of one folder in a walk: item i is Item(prefix + relpaths[i], relpaths[i],
    keys[i], label). Kept as lists, so a walk of millions of files takes no Python step per file."""

    prefix: str
    relpaths: list[str]
    keys: list[str]
    label: int | None

    def items(self) -> list[Item]:
        prefix, label = self.prefix, self.label
        return [Item(prefix + rel, rel, key, label) for rel, key in zip(self.relpaths, self.keys, strict=True)]


def parse_label(text: str) -> int | None:
    """A label written as text (a list file's, a CSV cell, a .cls file's), or None when it is not one
    under the label rule."""
    if not _DIGITS.fullmatch(text):
        return None
    number = int(text)
    return number if number <= MAX_LABEL else None


def label_problem(number: int) -> str:
    """Why a whole-number label breaks the label rule ("" when it does not)."""
    if 0 <= number <= MAX_LABEL:
        return ""
    return _label_over(str(number)) if number > 0 else f"label {_shown(str(number))} is negative"


def whole_label(value: int | str) -> tuple[int | None, str]:
    """A label given as a number or as text of ASCII digits: (the label, "") under the label rule,
    else (None, why). Text is never given to int() past 19 digits (Python refuses 4,300)."""
    if isinstance(value, int):
        problem = label_problem(value)
        return (None, problem) if problem else (value, "")
    number = parse_label(value)
    if number is not None:
        return number, ""
    if value.isascii() and value.isdigit():
        return None, _label_over(value)
    return None, f"label {_shown(value)!r} is not {LABEL_RULE}"


def _label_over(digits: str) -> str:
    return f"label {_shown(digits)} is over 2**63-1, the largest (int64)"


def _shown(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:20]}..."


def display(name: str) -> str:
    """A printable form of a file name that may hold undecodable bytes."""
    if name.isascii():
        return name
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def skip(relpath: str, reason: str) -> Failure:
    """An input the walk does not take: a Failure at the discover stage."""
    return Failure(display(relpath), "discover", reason)


def make_key(relpath: str, keep_extension: bool = False) -> str:
    stem = relpath if keep_extension else _strip_extension(relpath)
    return quote(os.fsencode(stem), safe=_KEY_SAFE).replace(".", "%2E")


def _strip_extension(relpath: str) -> str:
    head, _, name = relpath.rpartition("/")
    base, dot, _ext = name.rpartition(".")
    stem = base if dot and base else name
    return f"{head}/{stem}" if head else stem


def unique_keys(relpaths: list[str]) -> list[str]:
    """Keys of distinct relpaths: the extension is dropped unless that makes two files' keys
    collide (a.jpg and a.png; or a.jpg kept whole against a.jpg.png), in which case both keep it.
    Keys of files in different folders never collide, so a walk settles each folder on its own."""
    keys = [make_key(rel) for rel in relpaths]
    whole: set[int] = set()  # files whose key keeps the extension
    while True:
        owners: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            owners.setdefault(key, []).append(index)
        clashing = {index for group in owners.values() if len(group) > 1 for index in group} - whole
        if not clashing:
            return keys
        whole |= clashing
        for index in clashing:
            keys[index] = make_key(relpaths[index], keep_extension=True)

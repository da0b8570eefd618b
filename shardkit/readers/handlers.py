"""The read side's error policy as one value (webdataset's `handlers.py`): `OnError`, made once from
the user's on_error="raise" | "skip" and handed to every place a record can fail to read (a damaged
shard's range, a record that does not decode, a batch's crop-decode), which call it only on a
failure: reading costs nothing more per record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..core.errors import ConfigError, ShardReadError

ON_ERROR = ("raise", "skip")


class Skips(Protocol):
    """What a skip is counted in: the dataset whose record it was (`ShardDataset.skipped`)."""

    skipped: int


@dataclass(frozen=True)
class OnError:
    """on_error="raise": a record that cannot be read raises; "skip": it is counted in its dataset's
    `skipped` and the read goes on."""

    name: str = "raise"

    def __post_init__(self) -> None:
        if self.name not in ON_ERROR:
            raise ConfigError(f"on_error must be raise or skip, not {self.name!r}")

    def __call__(self, error: ShardReadError, source: Skips) -> None:
        """A record of `source` could not be read: raises `error`, or counts the skip and returns."""
        if self.name == "raise":
            raise error
        source.skipped += 1

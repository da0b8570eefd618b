"""What `verify` reports: each problem found, with the shard and key it concerns, and the report."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Problem:
    kind: str  # manifest, missing, stray, size, checksum, count, unreadable, duplicate-key, label, decode, ...
    detail: str
    shard: str | None = None
    key: str | None = None


@dataclass
class VerifyReport:
    folder: str
    format: str | None
    shards: int = 0
    records: int = 0
    decoded: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was seen and is fine (e.g. a reader's lock files)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}

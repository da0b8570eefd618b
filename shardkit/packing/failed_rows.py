"""The failures of a pack's shards, kept out of the driver's memory: as each shard comes back, its
failed rows go to a part of their own in the state folder (errors/<shard>.jsonl, the lines
errors.jsonl will hold) and the driver keeps only their counts; errors.jsonl is the walk's own
failures, then each shard's part in plan order, streamed. A table of URLs may fail a third of
its rows: held as rows, 10 M of them would weigh gigabytes in the driver."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.errors import Failure
from .shard_writing import ShardResult


def error_line(row: Failure) -> str:
    """A failure as errors.jsonl holds it: one JSON line, keys sorted."""
    return json.dumps(row.to_json(), sort_keys=True) + "\n"


def part_path(state: Path, shard: str) -> Path:
    return state / "errors" / f"{shard}.jsonl"


@dataclass
class FailedRows:
    """What the driver keeps of the shards' failed rows: their counts (all, those that may pass,
    per "stage:cause"), the rows themselves in their parts under the state folder `state`."""

    state: Path
    count: int = 0
    transient: int = 0
    causes: Counter[str] = field(default_factory=Counter)

    def add(self, result: ShardResult) -> ShardResult:
        """The shard's failed rows written to its part and counted; the result without them."""
        self.count += len(result.errors)
        for row in result.errors:
            self.transient += row.transient
            if row.cause is not None:
                self.causes[f"{row.stage}:{row.cause}"] += 1
        path = part_path(self.state, result.shard.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        # not synced: a run killed before the end writes each part again, from its shard's done
        # marker; made anew (exclusive), so a link planted in its place is never followed
        path.unlink(missing_ok=True)
        with open(path, "x", encoding="utf-8") as part:
            part.writelines(error_line(row) for row in result.errors)
        return replace(result, errors=[])

    def lines(self, skipped: Iterable[Failure], shards: Iterable[str]) -> Iterator[str]:
        """errors.jsonl's lines: the walk's failures (`skipped`), then each shard's, in order."""
        for row in skipped:
            yield error_line(row)
        for name in shards:
            with open(part_path(self.state, name), encoding="utf-8") as part:
                yield from part

    def totals(self, skipped: list[Failure]) -> tuple[int, int, dict[str, int]]:
        """(failures, those that may pass, failures per "stage:cause" most first) with the walk's."""
        causes = Counter(self.causes)
        for row in skipped:
            if row.cause is not None:
                causes[f"{row.stage}:{row.cause}"] += 1
        transient = self.transient + sum(1 for row in skipped if row.transient)
        ordered = dict(sorted(causes.items(), key=lambda item: (-item[1], item[0])))
        return self.count + len(skipped), transient, ordered

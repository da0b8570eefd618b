"""loader(progress=True): a live line on stderr while an epoch is iterated: the batches handed out
of the epoch's, batches/s, and the verdict with the stage that dominates (readers/stats), over the
last few seconds, so a change (a cache that fills, a slow disk) shows while it lasts."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from .stats import LoaderClock, Totals

WINDOW = 5.0  # seconds of the recent past the line's rate and verdict are taken over
REFRESH = 0.5  # seconds between the line's updates


def with_progress(batches: Iterator[Any], clock: LoaderClock, total: int) -> Iterator[Any]:
    """`batches`, showing the line while they are iterated (rich draws it from its own thread)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    said = TextColumn("{task.fields[line]}")
    columns = (TextColumn("batches"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), said)
    marks: deque[tuple[float, Totals]] = deque([(time.perf_counter(), clock.mark())])
    with Progress(*columns, console=Console(stderr=True), transient=False) as progress:
        task = progress.add_task("", total=total or None, line="")
        for batch in batches:
            progress.advance(task)
            now = time.perf_counter()
            if now - marks[-1][0] >= REFRESH:
                marks.append((now, clock.mark()))
                while len(marks) > 2 and now - marks[1][0] >= WINDOW:
                    marks.popleft()
                recent = clock.between(marks[0][1], marks[-1][1])
                line = f"{recent.batches_per_second:,.1f} batches/s, {recent.verdict} ({recent.dominant})"
                progress.update(task, line=line)
            yield batch

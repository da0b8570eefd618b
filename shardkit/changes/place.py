"""Where a change runs: a local output folder itself (journal.changing), or, for an output in a
bucket, its local mirror, committed into the bucket (bucket.changing_bucket). The actions ask for
`changing` here and never which kind they hold."""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any

from ..storage.urls import is_remote
from .bucket import changing_bucket
from .journal import Changing
from .journal import changing as changing_folder


def changing(
    output: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, take_over: bool = False
) -> AbstractContextManager[Changing]:
    """`output` locked for a change, with its manifest and any unfinished change's journal; for a
    bucket, `take_over` (--resume) takes over a change another run began and did not commit."""
    if is_remote(output):
        return changing_bucket(output, storage_options, take_over)
    return changing_folder(output)

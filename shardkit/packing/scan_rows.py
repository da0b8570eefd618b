"""What a scan says of one file, apart from the census of many: its row (the compiled scanner's
or its pure-Python fallback's), the problem found in reading it, the warnings its header gives. The pack
side takes these for every file it reads, so they live apart from the census, which needs numpy
(the pack driver does not import it)."""

from __future__ import annotations

from typing import Any

from ..core.headers import EXTENSION_FORMATS, ImageHeader

# One file as the scanner (or its pure-Python fallback) reports it: (bytes, header tuple or None, error,
# warnings, head hash, file identity).
ScanRow = tuple[Any, ...]

CANNOT_READ = "cannot read (permissions, I/O)"


class FileProblem(str):
    """A file's problem as probe reports it: the reason (a str, so it prints and serializes as one)
    with its kind attached by whoever found it, never guessed from the wording."""

    kind: str

    def __new__(cls, reason: str, kind: str) -> FileProblem:
        problem = super().__new__(cls, reason)
        problem.kind = kind
        return problem

    def __reduce__(self) -> tuple[type[FileProblem], tuple[str, str]]:
        return (FileProblem, (str(self), self.kind))


def header_warnings(header: ImageHeader, relpath: str, max_pixels: int) -> tuple[str, ...]:
    """What is wrong with a readable header: "truncated", "extension-mismatch", "too-many-pixels"."""
    expected = EXTENSION_FORMATS.get("." + relpath.rpartition(".")[2].lower())
    if header.complete and expected == header.format and header.width * header.height <= max_pixels:
        return ()  # the common case, kept cheap
    warnings: list[str] = []
    if not header.complete:
        warnings.append("truncated")
    if expected is not None and expected != header.format:
        warnings.append("extension-mismatch")
    if header.width * header.height > max_pixels:
        warnings.append("too-many-pixels")
    return tuple(warnings)

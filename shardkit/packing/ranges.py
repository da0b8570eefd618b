"""An image's header read by ranges from something that is not a local file (a bucket's object, an
image at an http(s) URL): a first range, then only what the header parser asks for beyond it.
Everything here is given a `ReadRange` callable, so a new kind of remote item is one function that
reads a range, and probe and the worker read its headers as they read a bucket's."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from ..core.errors import HeaderError, StorageError, StoreUnreachable, describe
from ..core.headers import HEAD_BYTES, ImageHeader, head_hash, parse_header
from .scan_rows import CANNOT_READ, FileProblem, ScanRow, header_warnings

# (start, length) -> (the bytes, fewer at the object's end, and the object's whole size)
ReadRange = Callable[[int, int], tuple[bytes, int]]

PROBE_FIRST = HEAD_BYTES  # probe's first range: all of most photos' headers (more only where one runs on)
PACK_FIRST = 64 << 10  # the worker's: the header of nearly any photo, and all of a small one
_MORE = 16 << 10  # a header that runs on is read on in ranges of at least this much (a 45 KB EXIF: 3)


class RangeReads:
    """An object read by ranges for its header: `head` (the first range) and `size` from the first
    request, then `fetch(offset, n)` (parse_header's reader) from what was read or by a further
    range; the bytes and requests it took are counted."""

    def __init__(self, read_range: ReadRange, first: int) -> None:
        self._read_range = read_range
        self.head, self.size = read_range(0, first)
        self._blocks = [(0, self.head)]
        self.bytes_read, self.requests = len(self.head), 1

    def fetch(self, offset: int, n: int) -> bytes:
        n = min(n, self.size - offset)
        if n <= 0 or offset < 0:
            return b""
        for start, data in self._blocks:
            if start <= offset and offset + n <= start + len(data):
                return data[offset - start : offset - start + n]
        # the end marker (the last bytes) is read as asked; a header that runs on, by a larger range
        length = n if offset + n >= self.size else min(max(n, _MORE), self.size - offset)
        data, _ = self._read_range(offset, length)
        self._blocks.append((offset, data))
        self.bytes_read += len(data)
        self.requests += 1
        return data[:n]

    def whole(self) -> bytes:
        """All of the object: what the first range read, and the rest by one more range. OSError
        when the object changed size since its first range (replaced while it was read)."""
        if len(self.head) >= self.size:
            return self.head[: self.size]
        rest, size = self._read_range(len(self.head), self.size - len(self.head))
        self.bytes_read += len(rest)
        self.requests += 1
        if size != self.size or len(self.head) + len(rest) != size:
            raise OSError(f"changed while it was read ({self.size:,} bytes, then {size:,})")
        return self.head + rest

    def header(self) -> ImageHeader:
        """The header, parsed as a local file's is (HeaderError when there is none)."""
        return parse_header(self.head, self.fetch, self.size, None)


def identity_of(url: str) -> int:
    """A remote object's identity for probe's copies (a local file's is its inode): objects have no
    links, so each URL is a file of its own."""
    return int.from_bytes(hashlib.blake2b(url.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "little")


def probe_row(read_range: ReadRange, url: str, relpath: str, max_pixels: int) -> tuple[ScanRow, int]:
    """One remote image's probe row, as `probe_file` makes a local file's: (bytes, header tuple or
    None, error, warnings, head hash, identity), and the bytes its ranges read. A store out of
    reach (StoreUnreachable) is no one object's row: it goes on."""
    try:
        reads = RangeReads(read_range, PROBE_FIRST)
    except StoreUnreachable:
        raise
    except (OSError, StorageError) as error:  # (the error the retries end with names the URL: so does the row)
        return (0, None, FileProblem(f"cannot read: {describe(error)}", CANNOT_READ), (), None, None), 0
    try:
        header = reads.header()
    except HeaderError as error:
        return (reads.size, None, FileProblem(str(error), error.kind), (), None, None), reads.bytes_read
    except StoreUnreachable:
        raise
    except (OSError, StorageError) as error:
        problem = FileProblem(f"cannot read: {describe(error)}", CANNOT_READ)
        return (0, None, problem, (), None, None), reads.bytes_read
    warnings = header_warnings(header, relpath, max_pixels)
    row = (reads.size, tuple(header), None, warnings, head_hash(reads.head[:HEAD_BYTES]), identity_of(url))
    return row, reads.bytes_read

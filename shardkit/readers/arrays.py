"""Arrow arrays to and from Python and numpy without pandas. pyarrow imports pandas (0.4 s) the
first time it converts Python objects (`pa.array(list)`) or hands an array to numpy
(`to_numpy`), even a zero-copy one; a process that only reads an index (a change of an output,
`open_shards(select=...)`) pays that at start for nothing. Built from buffers here instead:
measured, pandas stays out (`tests/test_arrays.py`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.errors import ConfigError


def strings(values: Sequence[str]) -> Any:
    """A pa.string() array of `values` (no nulls). A value UTF-8 cannot hold (a lone surrogate, as
    text read in a locale that keeps undecodable bytes gives) is refused, naming it."""
    import pyarrow as pa

    encoded = []
    for value in values:
        try:
            encoded.append(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ConfigError(f"{value!r}: not text (it holds a character UTF-8 cannot encode)") from None
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(text) for text in encoded], out=offsets[1:])
    large = pa.LargeStringArray.from_buffers(len(encoded), pa.py_buffer(offsets), pa.py_buffer(b"".join(encoded)))
    return large.cast(pa.string())


def string(value: str) -> Any:
    """A pa.string() scalar (what a compute function takes beside arrays; a Python str there is
    converted, and that imports pandas)."""
    return strings([value])[0]


def boolean(value: bool) -> Any:
    """A pa.bool_() scalar (a Python bool beside an array would be converted, importing pandas)."""
    return booleans(np.array([value], bool))[0]


def int64s(values: np.ndarray) -> Any:
    """A pa.int64() array of a one-dimensional numpy array of integers."""
    import pyarrow as pa

    exact = values.dtype.kind == "i" or (values.dtype.kind == "u" and values.dtype.itemsize < 8)
    if values.ndim != 1 or not exact:  # (uint64 would wrap, floats be cut)
        raise ValueError(f"int64s() takes a 1-D array of integers int64 holds, not {values.ndim}-D {values.dtype}")
    numbers = np.ascontiguousarray(values, np.int64)
    return pa.Array.from_buffers(pa.int64(), len(numbers), [None, pa.py_buffer(numbers)])


def booleans(values: np.ndarray) -> Any:
    """A pa.bool_() array of a one-dimensional numpy array of booleans (what `filter` takes)."""
    import pyarrow as pa

    if values.ndim != 1 or values.dtype != bool:
        raise ValueError(f"booleans() takes a 1-D bool array, not {values.ndim}-D {values.dtype}")
    bits = np.packbits(values, bitorder="little")
    return pa.Array.from_buffers(pa.bool_(), len(values), [None, pa.py_buffer(bits)])


def integers(values: Any) -> np.ndarray:
    """An integer array or chunked array with no nulls (what `pc.index_in` gives when every value
    is found) as an int64 numpy array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = pc.cast(_combined(values), pa.int64())
    if array.null_count:
        raise ValueError("integers() takes an array with no nulls")
    result: np.ndarray = np.frombuffer(array.buffers()[1], np.int64, len(array), array.offset * 8).copy()
    return result


def flags(values: Any) -> np.ndarray:
    """A boolean array or chunked array with no nulls (what `pc.is_in` gives) as a numpy bool array."""
    import pyarrow as pa
    import pyarrow.compute as pc

    array = pc.cast(_combined(values), pa.uint8())
    if array.null_count:
        raise ValueError("flags() takes an array with no nulls")
    return np.frombuffer(array.buffers()[1], np.uint8, len(array), array.offset).astype(bool)


def _combined(values: Any) -> Any:
    return values.combine_chunks() if hasattr(values, "combine_chunks") else values

"""readers/arrays.py: arrays built and read without pandas, and the same values as pyarrow's own
conversions (checked in a process of its own: pandas, once imported, stays)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit.readers.arrays import flags, integers, strings


def test_the_same_values_as_pyarrows_own_conversions() -> None:
    names = ["a", "", "ñandú", "n00001000/img_00000", "x" * 300]
    assert strings(names).to_pylist() == names and strings(names).type == pa.string()
    assert strings([]).to_pylist() == []
    column = pa.chunked_array([pa.array(["a", "b"]), pa.array(["c", "a", "zz"])])
    found = pc.index_in(column, value_set=pa.array(["a", "b", "c", "zz"]))
    assert integers(found).tolist() == found.to_numpy().tolist() == [0, 1, 2, 0, 3]
    member = pc.is_in(column, value_set=pa.array(["a"]))
    assert flags(member).tolist() == [True, False, False, True, False]
    sliced = pa.array([True, False, True, True])[1:]
    assert flags(sliced).tolist() == [False, True, True]
    assert integers(pa.array(np.arange(10, dtype=np.int32))[3:6]).tolist() == [3, 4, 5]


def test_pandas_stays_out() -> None:
    code = (
        "import sys, pyarrow.compute as pc\n"
        "from shardkit.readers.arrays import flags, integers, strings\n"
        "names = strings(['a', 'b', 'a'])\n"
        "integers(pc.index_in(names, value_set=strings(['a', 'b'])))\n"
        "flags(pc.is_in(names, value_set=strings(['b'])))\n"
        "assert 'pandas' not in sys.modules, 'pandas was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_nulls_are_refused_not_read_as_zero() -> None:
    import pytest

    with pytest.raises(ValueError, match="no nulls"):
        integers(pa.array([1, None, 3]))
    with pytest.raises(ValueError, match="no nulls"):
        flags(pa.array([True, None]))

"""readers/arrays.py: arrays built and read without pandas, and the same values as pyarrow's own
conversions (checked in a process of its own: pandas, once imported, stays)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardkit.readers.arrays import booleans, flags, int64s, integers, strings


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


def test_a_change_of_an_output_and_a_selection_import_no_pandas(packed_sample, tmp_path) -> None:
    """remove, compact, merge and open_shards(select=...) with keys read and write index.parquet
    through these arrays: pandas (0.4-0.6 s of imports) stays out of their processes. (A condition,
    an Expression or --where, is evaluated by pyarrow.dataset, whose import brings pandas.)"""
    import shutil

    source = packed_sample("webdataset", 64, 7)
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(source, first)
    shutil.copytree(source, second)
    code = (
        "import sys\n"
        "from shardkit import open_shards\n"
        "from shardkit.changes.compact import compact\n"
        "from shardkit.changes.merge import merge\n"
        "from shardkit.changes.remove import remove\n"
        f"first, second = {str(first)!r}, {str(second)!r}\n"
        "keys = [open_shards(first)[i].key for i in (0, 3, 9)]\n"
        "assert len(open_shards(first, select=keys)) == 3\n"
        "remove(first, keys, reason='a takedown')\n"
        "compact(first, shard_size=20)\n"
        f"merge([first, second], {str(tmp_path / 'both')!r}, prefix_keys=True)\n"
        "assert 'pandas' not in sys.modules, 'pandas was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_int64s_and_booleans_are_pyarrows_own_arrays() -> None:
    numbers = np.array([5, -1, 2**40, 0], np.int64)
    assert int64s(numbers).equals(pa.array(numbers)) and int64s(numbers[::2]).to_pylist() == [5, 2**40]
    assert int64s(np.arange(3, dtype=np.int32)).type == pa.int64()
    for length in (0, 1, 7, 8, 9, 17):
        mask = np.arange(length) % 3 == 1
        assert booleans(mask).equals(pa.array(mask)), length
    table = pa.table({"n": list(range(10))})
    assert table.take(int64s(np.array([9, 0]))).column("n").to_pylist() == [9, 0]
    assert table.filter(booleans(np.arange(10) > 6)).column("n").to_pylist() == [7, 8, 9]


def test_text_utf8_cannot_hold_and_arrays_of_another_shape_are_refused() -> None:
    import pytest

    from shardkit.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'a\\udcff': not text"):
        strings(["fine", "a\udcff"])
    for wrong in (np.zeros((2, 2), np.int64), np.zeros(3, np.uint64), np.zeros(3, float)):
        with pytest.raises(ValueError, match="int64s"):
            int64s(wrong)
    with pytest.raises(ValueError, match="booleans"):
        booleans(np.zeros(3, np.int64))
    assert int64s(np.arange(3, dtype=np.uint32)).to_pylist() == [0, 1, 2]

"""readers/where.py: `--where` conditions parsed into pyarrow Expressions (never evaluated as
Python), checked against the rows they select on a real table, and refused in one line naming
where they stop making sense; `shardkit remove --where` takes records out by one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from shardkit.checks.verify import verify
from shardkit.core.errors import ConfigError
from shardkit.core.manifest import read_manifest
from shardkit.readers import open_shards
from shardkit.readers.where import parse_where

ROWS = pa.table({
    "key": ["a/1", "a/2", "b/1", "b/2", "c/1"],
    "label": [0, 1, 1, None, 3],
    "source": ["artist-118/x.jpg", "artist-118/y.png", "other/z.jpg", "other/it's.jpg", "c/1.jpg"],
    "width": [10, 64, 640, 20, 5],
})  # fmt: skip


def _keys(text: str) -> list[str]:
    return ds.dataset(ROWS).to_table(filter=parse_where(text)).column("key").to_pylist()


@pytest.mark.parametrize(
    ("text", "keys"),
    [
        ("label == 1", ["a/2", "b/1"]),
        ("label != 1", ["a/1", "c/1"]),
        ("width >= 64 and label == 1", ["a/2", "b/1"]),
        ("width < 20 or label == 3", ["a/1", "c/1"]),
        # (a null label makes "label == 3" null, and "not" of null is null, as in SQL: b/2 is left out)
        ("not (width < 20 or label == 3)", ["a/2", "b/1"]),
        ("source startswith 'artist-118/'", ["a/1", "a/2"]),
        ('source endswith ".png"', ["a/2"]),
        ("source contains 'it\\'s'", ["b/2"]),
        ("key in ('a/1', 'c/1', 'nope')", ["a/1", "c/1"]),
        ("key not in ('a/1', 'c/1')", ["a/2", "b/1", "b/2"]),
        ("label is null", ["b/2"]),
        # (a record with no label is neither in nor out of a list, as with != : SQL's nulls)
        ("label not in (0, 3)", ["a/2", "b/1"]),
        ("not (label in (0, 3))", ["a/2", "b/1"]),
        ("label is not null and width > 1e1", ["a/2", "b/1"]),
        ("LABEL == 0 or label == -1", "error"),
    ],
)
def test_a_condition_selects_the_rows_it_says(text: str, keys: list[str] | str) -> None:
    if keys == "error":  # (column names are the index's, as written)
        with pytest.raises(pa.ArrowInvalid):
            _keys(text)
        return
    assert _keys(text) == keys


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "needs a condition"),
        ("label ==", "ends where a value"),
        ("label = 3", "cannot read '= 3'"),
        ("label == 3 and", "ends where a column name"),
        ("(label == 3", "ends where ')'"),
        ("label == 3)", "')' at character 11"),
        ("__import__('os').system('true')", 'cannot read ".system('),
        ("__import__('os')", "'(' at character 11, where =="),
        ("label startswith 3", "'3' at character 18, where a text in quotes"),
        ("label ~ 3", "cannot read '~ 3'"),
        ("label == 99999999999999999999999", "cannot read"),
        ("and == 3", "'and' at character 1, where a column name"),
        ("(" * 200 + "label == 1" + ")" * 200, "at most 64 parentheses"),
        ("not " * 1000 + "label == 1", "at most 64 parentheses"),
        ("label in (1, 'a')", "all numbers, all texts or all true/false"),
        ("source == '\udcff'", "not valid UTF-8"),
        ("label == \u0663", "cannot read"),
        ("label in ()", "')' at character 11, where a value"),
    ],
)
def test_a_condition_that_does_not_parse_is_refused_saying_where(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=f"--where: .*{__import__('re').escape(said)}"):
        parse_where(text)


def test_remove_takes_the_records_a_condition_selects(shardkit, packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    before = [(sample.key, sample.label) for sample in open_shards(out, decode="bytes")]
    done = shardkit("remove", out, "--where", "label == 1 and key contains '_0000'", "--reason", "class 1 opt-out")
    assert done.returncode == 0, done.stderr
    gone = {key for key, label in before if label == 1 and "_0000" in key}
    after = [(sample.key, sample.label) for sample in open_shards(out, decode="bytes")]
    assert gone and after == [(key, label) for key, label in before if key not in gone]
    assert read_manifest(out).totals["removed"] == len(gone) and verify(out).ok
    both = shardkit("remove", out, "--where", "label == 2", "--keys", tmp_path / "k.txt", "--reason", "x")
    assert both.returncode == 1 and "one of --keys, --where and --like" in both.stderr
    nothing = shardkit("remove", out, "--where", "label == 99", "--reason", "x")
    assert nothing.returncode == 0 and "no record meets the condition" in " ".join(nothing.stdout.split())
    bad = shardkit("remove", out, "--where", "label ==", "--reason", "x")
    assert bad.returncode == 1 and "--where: the condition ends where a value" in " ".join(bad.stderr.split())


def test_two_long_lists_that_differ_in_the_middle_are_two_removes(packed_sample, tmp_path: Path) -> None:
    """pyarrow's repr of an `in` list shortens it: the digest that tells an interrupted remove from
    another must not (or remove B would finish remove A)."""
    from shardkit.changes.remove import _request

    keys = [f"k{i}" for i in range(30)]
    other = [*keys[:15], "different", *keys[16:]]
    assert _request(None, parse_where(f"key in {tuple(keys)}"), "r", False) != _request(
        None, parse_where(f"key in {tuple(other)}"), "r", False
    )
    assert _request(None, f"key in {tuple(keys)}", "r", False) != _request(None, f"key in {tuple(other)}", "r", False)

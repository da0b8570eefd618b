"""index.parquet and errors.jsonl from strangers: a manifest re-sealed over an index or a log that
lies is reported (verify) or refused in one line (duplicates), never a traceback, and never read
into memory or onto disk past what the manifest says the output holds."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.manifest import Manifest, info_of, read_manifest, write_json_atomic


@pytest.fixture
def copy(tar_packed: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tar_packed, tmp_path / "copy"))


def reseal(folder: Path, **changes: object) -> Manifest:
    """The manifest re-sealed over index.parquet as it is now (and `changes`): what a stranger who
    edited the index and knew to fix the manifest would hand over."""
    manifest = read_manifest(folder)
    data = (folder / "index.parquet").read_bytes()
    index = info_of("index.parquet", manifest.index.count if manifest.index else 0, data)
    sealed = replace(manifest, index=index, **changes).sealed()  # type: ignore[arg-type]
    write_json_atomic(folder / "manifest.json", sealed.to_json())
    return sealed


def rewrite_index(folder: Path, edit) -> None:
    """index.parquet read, changed by `edit` (a pyarrow Table to a Table), written back and sealed."""
    import pyarrow.parquet as pq

    table = edit(pq.read_table(folder / "index.parquet"))
    pq.write_table(table, folder / "index.parquet")
    reseal(folder)


def set_column(table, name: str, values: list, kind=None):
    import pyarrow as pa

    at = table.schema.get_field_index(name)
    array = pa.array(values, type=kind if kind is not None else table.schema.field(name).type)
    return table.set_column(at, pa.field(name, array.type), array)


def index_problems(folder: Path) -> list[str]:
    report = verify(folder, workers=1)
    return [problem.detail for problem in report.problems if problem.kind == "index"]


@pytest.mark.parametrize(
    ("column", "value", "kind"),
    [("position", None, None), ("key", None, None), ("shard", None, None),
     ("position", "0", "string"), ("key", 7, "int64"), ("position", -1, None)],
)  # fmt: skip
def test_verify_reports_an_index_column_with_nulls_or_the_wrong_type(
    copy: Path, column: str, value: object, kind: str | None
) -> None:
    import pyarrow as pa

    def edit(table):
        values = table.column(column).to_pylist()
        values[3] = value
        if kind is not None:  # the whole column of another type, one row changed
            values = [value if i == 3 else (str(v) if kind == "string" else i) for i, v in enumerate(values)]
        return set_column(table, column, values, getattr(pa, kind)() if kind else None)

    rewrite_index(copy, edit)
    problems = index_problems(copy)
    assert len(problems) == 1 and f"column {column!r}" in problems[0], problems


@pytest.mark.parametrize(
    ("column", "value", "said"),
    [("shard", "elsewhere.tar", "a shard the manifest lacks"), ("position", 5, "column 'position' is not 0 to"),
     ("position", 1 << 40, "column 'position' is not 0 to")],
)  # fmt: skip
def test_verify_reports_index_rows_no_shard_holds(copy: Path, column: str, value: object, said: str) -> None:
    def edit(table):
        values = table.column(column).to_pylist()
        values[3] = value
        return set_column(table, column, values)

    rewrite_index(copy, edit)
    problems = index_problems(copy)
    assert problems and said in problems[0], problems


def test_verify_reports_an_index_without_a_column_it_reads(copy: Path) -> None:
    rewrite_index(copy, lambda table: table.drop_columns(["position"]))
    assert index_problems(copy) == ["index.parquet: 0 columns named 'position', not one"]


def test_duplicates_refuses_an_index_with_more_rows_than_records_before_reading_it(copy: Path) -> None:
    """A small index holding a million copies of one row, re-sealed: refused in one line from the
    file's metadata (it took 2.2 GB for 3 M rows and reported one group of them all)."""
    import resource

    import pyarrow.parquet as pq

    from shardkit.checks.duplicates import find_duplicates
    from shardkit.core.errors import ConfigError

    table = pq.read_table(copy / "index.parquet")
    pq.write_table(table.take([0] * 1_000_000), copy / "index.parquet", compression="zstd")
    assert (copy / "index.parquet").stat().st_size < 1 << 20
    reseal(copy)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ConfigError) as caught:
        find_duplicates([copy])
    message = str(caught.value)
    assert "\n" not in message and "index.parquet" in message and "1,000,000 rows" in message, message
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KiB: not read whole
    assert index_problems(copy) == ["index.parquet: 1,000,000 rows, the manifest says 60 records"]

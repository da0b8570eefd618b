"""index.parquet and errors.jsonl from strangers: a manifest re-sealed over an index or a log that
lies is reported (verify) or refused in one line (duplicates), never a traceback, and never read
into memory or onto disk past what the manifest says the output holds."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardkit.checks.verify import verify
from shardkit.core.manifest import Manifest, info_of, read_manifest, write_json_atomic

from .servers import http_server, serving


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


ROW = b'{"path": "x.jpg", "reason": "cannot decode", "stage": "decode"}\n'


@contextlib.contextmanager
def endless_errors_server(folder: Path) -> Iterator[tuple[str, list[int]]]:
    """http.server serving `folder`, but errors.jsonl as a body that never ends (no length, rows
    until the client hangs up); yields its URL and a one-item list: the bytes of it sent."""
    from http.server import SimpleHTTPRequestHandler

    sent = [0]

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self) -> None:
            if not self.path.endswith("/errors.jsonl"):
                super().do_GET()
                return
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            block = ROW * 1024
            with contextlib.suppress(OSError):
                while sent[0] < 4 << 30:  # (a stop for a client that never stops)
                    self.wfile.write(block)
                    sent[0] += len(block)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url, sent


@contextlib.contextmanager
def temp_watched(tmp_path: Path) -> Iterator[list[int]]:
    """Temporary folders made under a folder of the test's, its bytes sampled while the block runs:
    yields a one-item list, the most bytes seen there at once."""
    base = tmp_path / "temp"
    base.mkdir()
    peak, done = [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _bytes_under(base))
            done.wait(0.005)

    saved, tempfile.tempdir = tempfile.tempdir, str(base)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield peak
    finally:
        done.set()
        watcher.join()
        tempfile.tempdir = saved


def _bytes_under(base: Path) -> int:
    """The bytes of the files under `base` now. Folders come and go while it walks (verify's
    temporary folder is removed as it ends): one that vanished mid-walk counts as empty, and the
    walk goes on, so the watcher samples until the block ends."""
    total = 0
    for folder, _, names in os.walk(base):  # (os.walk skips a folder it can no longer list)
        for name in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(folder, name), follow_symlinks=False).st_size
    return total


def errors_log_problems(report) -> list[str]:
    """The errors-log problems, each without the folder or URL before `errors.jsonl`."""
    return [p.detail[p.detail.rindex("errors.jsonl") :] for p in report.problems if p.kind == "errors-log"]


def test_verify_url_stops_an_endless_errors_log_at_the_manifests_count(tar_packed: Path, tmp_path: Path) -> None:
    """errors.jsonl that never ends: read as a stream, no copy on disk, ended at the first row
    past the manifest's totals.errors (it wrote 513 MiB into the temporary folder first)."""
    import resource

    errors = read_manifest(tar_packed).totals["errors"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with endless_errors_server(tar_packed) as (url, sent), temp_watched(tmp_path) as peak:
        report = verify(url, workers=1)
    assert errors_log_problems(report) == [f"errors.jsonl: more than the {errors:,} rows the manifest's totals say"]
    assert peak[0] < 4 << 20, f"{peak[0]:,} bytes in the temporary folder"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 << 10  # KiB
    assert sent[0] < 64 << 20, f"{sent[0]:,} bytes sent"


def test_verify_url_reads_an_oversized_errors_log_no_further_than_its_count(tar_packed: Path, tmp_path: Path) -> None:
    """A real http.server serving an errors.jsonl of 200,000 rows where the manifest says 1."""
    folder = Path(shutil.copytree(tar_packed, tmp_path / "copy"))
    (folder / "errors.jsonl").write_bytes((folder / "errors.jsonl").read_bytes() + ROW * 200_000)
    errors = read_manifest(folder).totals["errors"]
    with http_server(folder) as url, temp_watched(tmp_path) as peak:
        report = verify(url, workers=1)
    assert errors_log_problems(report) == [f"errors.jsonl: more than the {errors:,} rows the manifest's totals say"]
    assert peak[0] < 4 << 20, f"{peak[0]:,} bytes in the temporary folder"
    local = verify(folder, workers=1)
    assert errors_log_problems(local) == errors_log_problems(report)


def test_verify_s3_reads_an_oversized_errors_log_no_further_than_its_count(
    s3, tar_packed: Path, tmp_path: Path
) -> None:
    """The same through S3 (SeaweedFS on loopback): the log streamed from its presigned URL."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for entry in sorted(tar_packed.iterdir()):
        body = entry.read_bytes() + (ROW * 200_000 if entry.name == "errors.jsonl" else b"")
        fs.pipe_file(f"data/endless-log/{entry.name}", body)
    errors = read_manifest(tar_packed).totals["errors"]
    with temp_watched(tmp_path) as peak:
        report = verify("s3://data/endless-log", workers=1, storage_options=s3.options)
    assert errors_log_problems(report) == [f"errors.jsonl: more than the {errors:,} rows the manifest's totals say"]
    assert peak[0] < 4 << 20, f"{peak[0]:,} bytes in the temporary folder"
    assert [problem.kind for problem in report.problems] == ["errors-log"], report.problems

"""A table of URLs in parts (a local folder of table files, a glob of them) packed as one source:
the parts in natural order, rows in order within each, keys naming the part and the row, one label
vocabulary and one duplicate check across the parts; a part that cannot be read refused before any
work; a Spark folder's own files passed over; an added part seen by --resume; probe and verify
--source walking the parts as pack does. Images come from a loopback HTTP server of the test's own."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from shardkit.core.errors import SourceError
from shardkit.core.manifest import read_manifest
from shardkit.packing.sources import open_source, walk
from shardkit.packing.sources.url_parts import natural_order, part_key_format
from shardkit.readers import open_shards
from tests.helpers import read_errors
from tests.servers import serving
from tests.test_web_pack import FAST, _jpeg


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    """A server of JPEGs: /ok/N.jpg and /copy/N.jpg are image N; any other path is a 404. A range
    is answered as asked (a probe reads headers by ranges)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            kind, _, name = self.path.strip("/").partition("/")
            stem = name.split(".")[0]
            found = kind in ("ok", "copy") and stem.isdigit()
            body = _jpeg(int(stem)) if found else b"no"
            first, _, last = self.headers.get("Range", "").removeprefix("bytes=").partition("-")
            if found and first.isdigit():
                end = min(int(last or len(body) - 1), len(body) - 1)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {first}-{end}/{len(body)}")
                body = body[int(first) : end + 1]
            else:
                self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/jpeg" if found else "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as url:
        yield url


def _parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _rows(base: str, count: int) -> list[dict[str, Any]]:
    species = ["cat", "dog"]
    return [
        {"url": f"{base}/ok/{i}.jpg", "caption": f"photo {i}", "species": species[i % 2], "n": str(i)}
        for i in range(count)
    ]


def _split(folder: Path, rows: list[dict[str, Any]], cuts: list[int], name: str = "part-{}.parquet") -> list[Path]:
    edges = [0, *cuts, len(rows)]
    return [_parquet(folder / name.format(i), rows[a:b]) for i, (a, b) in enumerate(itertools.pairwise(edges))]


def _records(out: Path) -> list[tuple[str, bytes, int | None, Any, Any, Any]]:
    return [(s.key, s.image, s.label, s.text, s.fields, s.meta) for s in open_shards(out, decode="bytes")]


def _files(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def test_a_folder_of_parts_packs_the_records_one_table_of_its_rows_packs(base: str, tmp_path: Path, shardkit) -> None:
    rows = _rows(base, 10)
    rows[8]["url"] = rows[1]["url"]  # a URL an earlier part named: packed once
    rows[9]["species"] = "emu"  # a class only the last part holds: one vocabulary
    rows[5]["url"] = f"{base}/gone/5.jpg"  # a 404
    _parquet(tmp_path / "whole.parquet", rows)
    _split(tmp_path / "laion", rows, [4, 7])
    args = ["--shard-size", "4", "--label-column", "species", *FAST]
    assert shardkit("pack", tmp_path / "whole.parquet", tmp_path / "one", *args).returncode == 0
    done = shardkit("pack", tmp_path / "laion", tmp_path / "parts", *args)
    assert done.returncode == 0, done.stderr
    one, parts = _records(tmp_path / "one"), _records(tmp_path / "parts")
    assert [record[1:] for record in one] == [record[1:] for record in parts]  # the records' bytes alike
    assert [record[0] for record in one] == ["000000000", "000000001", "000000002", "000000003", "000000004",
                                             "000000006", "000000007", "000000009"]  # fmt: skip
    keys = [record[0] for record in parts]
    assert keys == ["00000-000000000", "00000-000000001", "00000-000000002", "00000-000000003",
                    "00001-000000000", "00001-000000002", "00002-000000000", "00002-000000002"]  # fmt: skip
    assert keys == sorted(keys)
    manifest = read_manifest(tmp_path / "parts")
    assert manifest.classes == read_manifest(tmp_path / "one").classes == ["cat", "dog", "emu"]
    assert manifest.totals["inputs"] == 10
    errors = {row["path"]: row["reason"] for row in read_errors(tmp_path / "parts")}
    assert errors[rows[1]["url"]] == "part-2.parquet row 2: the URL is named by an earlier row too"
    assert errors == {
        rows[1]["url"]: "part-2.parquet row 2: the URL is named by an earlier row too",
        f"{base}/gone/5.jpg": "HTTP 404",
    }


def test_a_glob_takes_its_parts_in_natural_order(base: str, tmp_path: Path, shardkit) -> None:
    rows = _rows(base, 6)
    for number, chunk in ((2, rows[:2]), (10, rows[2:4]), (1, rows[4:])):  # part-10 comes after part-2
        _parquet(tmp_path / "laion" / f"part-{number}.parquet", chunk)
    (tmp_path / "laion" / "notes.txt").write_text("not matched by the glob")
    done = shardkit("pack", f"{tmp_path}/laion/part-*.parquet", tmp_path / "out", *FAST)
    assert done.returncode == 0, done.stderr
    assert [s.fields["n"] for s in open_shards(tmp_path / "out")] == ["4", "5", "0", "1", "2", "3"]
    assert sorted(["part-10", "part-2", "part-1"], key=natural_order) == ["part-1", "part-2", "part-10"]
    none = shardkit("pack", f"{tmp_path}/laion/shard-*.parquet", tmp_path / "out2")
    assert none.returncode == 1 and none.stderr.count("\n") == 1 and "no table part matches" in none.stderr
    assert not (tmp_path / "out2").exists()


def test_one_table_keeps_its_keys_and_parts_keys_sort_as_the_plan(tmp_path: Path) -> None:
    assert [f.format(41) for f in part_key_format([1_000])] == ["000000041"]
    assert [f.format(41) for f in part_key_format([12_345_678_901])] == ["00000000041"]
    formats = part_key_format([3, 1_000_000_001, 0])
    assert [f.format(7) for f in formats] == ["00000-0000000007", "00001-0000000007", "00002-0000000007"]
    many = part_key_format([10] * 123_456)
    keys = [many[part].format(row) for part in (0, 9, 10, 99_999, 123_455) for row in (0, 9)]
    assert keys == sorted(keys) and keys[-1] == "123455-000000009"


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        ("corrupt", "part-1.parquet: not a readable parquet file"),
        ("no url", "part-1.parquet: no 'url' column"),
        ("stray", "README.md: not a table part"),
        ("folder", None),
    ],
)
def test_a_bad_part_is_named_in_one_line_and_nothing_is_written(
    base: str, tmp_path: Path, shardkit, bad: str, said: str | None
) -> None:
    folder = tmp_path / "laion"
    _split(folder, _rows(base, 6), [2, 4])
    if bad == "corrupt":
        (folder / "part-1.parquet").write_bytes(b"PAR1 not really")
    elif bad == "no url":
        _parquet(folder / "part-1.parquet", [{"link": f"{base}/ok/1.jpg"}])
    elif bad == "stray":
        (folder / "README.md").write_text("LAION parts\n")
    else:  # a sub-folder: not a folder of parts, so the folder convention speaks
        (folder / "more").mkdir()
        (folder / "more" / "part-9.parquet").write_bytes(b"")
    done = shardkit("pack", folder, tmp_path / "out", *FAST)
    assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert (said or "no images found") in done.stderr
    assert not (tmp_path / "out").exists()


def test_a_spark_folder_packs_past_its_own_files(base: str, tmp_path: Path, shardkit) -> None:
    folder = tmp_path / "spark"
    paths = _split(folder, _rows(base, 5), [3], name="part-0000{}-1a2b.snappy.parquet")
    (folder / "_SUCCESS").write_bytes(b"")
    (folder / "_committed_123").write_text("{}")
    for path in paths:
        (folder / f".{path.name}.crc").write_bytes(b"crc\0\1")
    _parquet(folder / "part-00002-1a2b.snappy.parquet", [])  # an empty partition: no rows, its schema
    done = shardkit("pack", folder, tmp_path / "out", *FAST)
    assert done.returncode == 0, done.stderr
    assert [s.key for s in open_shards(tmp_path / "out")] == [
        "00000-000000000", "00000-000000001", "00000-000000002", "00001-000000000", "00001-000000001"
    ]  # fmt: skip
    assert read_errors(tmp_path / "out") == []
    empty = tmp_path / "empty"
    _parquet(empty / "part-0.parquet", [])
    _parquet(empty / "part-1.parquet", [])
    refused = shardkit("pack", empty, tmp_path / "out2")
    assert refused.returncode == 1 and "its 2 table parts have no rows" in refused.stderr


def test_resume_refuses_a_folder_a_part_was_added_to(base: str, tmp_path: Path, shardkit) -> None:
    rows = _rows(base, 9)
    folder = tmp_path / "laion"
    _split(folder, rows[:6], [3])
    out = tmp_path / "out"
    args = ["--shard-size", "4", *FAST]
    assert shardkit("pack", folder, out, *args).returncode == 0
    again = shardkit("pack", folder, out, *args, "--resume")
    assert again.returncode == 0 and "already complete" in again.stdout
    before = _files(out)
    _parquet(folder / "part-2.parquet", rows[6:])
    refused = shardkit("pack", folder, out, *args, "--resume")
    assert refused.returncode == 1
    assert refused.stderr == (
        f"error: {out}: holds a finished pack made with other settings or inputs; use --overwrite to replace it\n"
    )
    assert _files(out) == before


def test_a_part_changed_while_it_is_read_is_refused(base: str, tmp_path: Path) -> None:
    folder = tmp_path / "laion"
    paths = _split(folder, _rows(base, 6), [3])
    found = walk(folder)
    items = iter(found.items)
    assert next(items).key == "00000-000000000"
    _parquet(paths[1], _rows(base, 4)[1:])  # the second part rewritten after the first read
    with pytest.raises(SourceError, match=r"part-1\.parquet: changed while it was being read"):
        list(items)


def test_probe_and_verify_source_walk_the_parts_as_pack_does(base: str, tmp_path: Path, shardkit) -> None:
    rows = _rows(base, 8)
    rows[3]["url"] = f"{base}/gone/3.jpg"
    rows[6]["url"] = rows[0]["url"]
    rows[7]["url"] = "ftp://example.com/7.jpg"
    folder = tmp_path / "laion"
    _split(folder, rows, [3, 5])
    report = tmp_path / "probe.json"
    probed = shardkit("probe", folder, "--json", report, "--retries", "0")
    assert probed.returncode == 0, probed.stderr
    got = json.loads(report.read_text())
    assert got["images"] == 5 and got["table"]["rows"] == 8
    assert got["table"]["name"] == f"{folder} (3 parts)" and "species" in got["table"]["columns"]
    out = tmp_path / "out"
    assert shardkit("pack", folder, out, *FAST).returncode == 0
    assert read_manifest(out).records == 5
    checked = shardkit("verify", out, "--source", folder)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    globbed = shardkit("verify", out, "--source", f"{folder}/part-*.parquet")
    assert globbed.returncode == 0, globbed.stdout + globbed.stderr
    _parquet(folder / "part-3.parquet", [{"url": f"{base}/ok/20.jpg"}])  # a row the pack never saw
    lost = shardkit("verify", out, "--source", folder)
    assert lost.returncode == 1 and f"{base}/ok/20.jpg" in lost.stdout


def test_a_remote_glob_and_flags_a_folder_of_parts_cannot_take_are_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"^s3://b/laion/part-\*\.parquet: a glob of remote tables is not read"):
        open_source("s3://b/laion/part-*.parquet")
    _parquet(tmp_path / "laion" / "part-0.parquet", [{"url": "http://x/1.jpg"}])
    with pytest.raises(SourceError, match="takes neither --metadata nor --sidecars"):
        open_source(tmp_path / "laion", sidecars=True)
    assert type(open_source(tmp_path / "laion")).__name__ == "UrlSource"
    assert type(open_source(f"{tmp_path}/laion/*.parquet")).__name__ == "UrlSource"
    _parquet(tmp_path / "laion" / "metadata.parquet", [{"file_name": "a.jpg"}])  # the table convention's folder
    assert type(open_source(tmp_path / "laion")).__name__ == "TableSource"


def test_duplicates_groups_copies_across_parts(base: str, tmp_path: Path, shardkit) -> None:
    rows = _rows(base, 4)
    rows.append({"url": f"{base}/copy/1.jpg", "caption": "the bytes of row 1", "species": "dog", "n": "4"})
    _split(tmp_path / "laion", rows, [2])
    report = tmp_path / "dups.json"
    done = shardkit("duplicates", tmp_path / "laion", "--json", report)
    assert done.returncode == 0, done.stderr
    groups = json.loads(report.read_text())["groups"]
    assert [sorted(group["files"]) for group in groups] == [[f"{base}/copy/1.jpg", f"{base}/ok/1.jpg"]]

"""Packing a table of image URLs: a real loopback HTTP server of the test's own, with faults
(503 then 200, 404, HTML at 200, a host that answers slowly), and the output read back: every
row packed or listed, records in the table's order, the same bytes whatever the workers and
whatever order the downloads finish in, and --resume trying again only what failed transiently."""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from PIL import Image

from shardkit.core.manifest import read_manifest
from shardkit.readers import open_shards
from tests.helpers import read_errors
from tests.servers import serving

FAST = ["--retries", "2", "--backoff", "0.05", "--timeout", "5"]


def _jpeg(index: int) -> bytes:
    """A small real photo-like JPEG, distinct per index (every tenth a larger one, so a probe's
    header read is a small part of it)."""
    rng = random.Random(index)
    if index % 10 == 9:  # noise: a JPEG of a photo's size
        image = Image.frombytes("RGB", (320, 240), rng.randbytes(320 * 240 * 3))
    else:
        image = Image.new("RGB", (48 + index % 7, 40 + index % 5), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(6):
        x, y = rng.randrange(40), rng.randrange(32)
        image.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, x + 8, y + 8))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


class Site:
    """What the server serves and remembers: the requests per path, and which paths fail for now."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.failing: set[str] = set()  # answer 503 while listed here
        self.lock = threading.Lock()
        self.jitter = 0.0  # up to this many seconds before each answer (scrambles the finish order)
        self.ranges = 0  # range requests answered


@pytest.fixture
def site() -> Iterator[tuple[Site, str]]:
    state = Site()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path
            with state.lock:
                state.hits[path] += 1
                tries = state.hits[path]
                failing = path in state.failing
            if state.jitter:
                time.sleep(random.uniform(0, state.jitter))
            kind, _, name = path.strip("/").partition("/")
            index = int(name.split(".")[0]) if name.split(".")[0].isdigit() else 0
            if failing or (kind == "flaky" and tries == 1):
                self._answer(503, b"busy", "text/plain")
            elif kind in ("ok", "flaky", "copy"):
                self._answer(200, _jpeg(index), "image/jpeg")
            elif kind == "hang":  # headers, then nothing: only the deadline ends it
                self.send_response(200)
                self.send_header("Content-Type", "image/jpeg")
                self.send_header("Content-Length", "100000")
                self.end_headers()
                self.wfile.flush()
                time.sleep(30)
            elif kind == "html":
                self._answer(200, b"<!doctype html><html><body>not here</body></html>", "text/html")
            else:
                self._answer(404, b"no", "text/plain")

        def _answer(self, status: int, body: bytes, kind: str) -> None:
            asked = self.headers.get("Range", "")
            if status == 200 and asked.startswith("bytes="):  # a range, as real servers give
                state.ranges += 1
                first, _, last = asked[len("bytes=") :].partition("-")
                start, end = int(first), min(int(last or len(body) - 1), len(body) - 1)
                part = body[start : end + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(body)}")
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(part)))
                self.end_headers()
                self.wfile.write(part)
                return
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as base:
        yield state, base


def _table(path: Path, rows: list[dict[str, object]]) -> Path:
    names = list(dict.fromkeys(name for row in rows for name in row))
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=names)
    writer.writeheader()
    writer.writerows(rows)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.getvalue().encode()))
    else:
        path.write_text(text.getvalue())
    return path


def _rows(base: str, count: int) -> list[dict[str, object]]:
    return [{"url": f"{base}/ok/{i}.jpg", "caption": f"photo {i}", "n": i} for i in range(count)]


def _digests(folder: Path) -> dict[str, str]:
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.iterdir())
        if path.is_file() and path.name != "manifest.json"
    }


def test_every_row_is_packed_or_listed_in_table_order(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    state, base = site
    rows = _rows(base, 12)
    rows[2]["url"] = f"{base}/flaky/2.jpg"  # 503 once: recovered by a retry
    rows[4]["url"] = f"{base}/gone/4.jpg"  # 404: final
    rows[6]["url"] = f"{base}/html/6"  # an HTML page at 200: not an image
    rows[8]["url"] = "ftp://example.com/8.jpg"  # never downloaded
    rows[9]["url"] = rows[0]["url"]  # a second row naming one URL
    rows[10]["url"] = base.replace("http://", "http://user:secret@") + "/gone/10.jpg"  # credentials: never shown
    table = _table(tmp_path / "urls.csv", rows)
    out = tmp_path / "out"
    done = shardkit("pack", table, out, "--shard-size", "5", "--workers", "2", *FAST)
    assert done.returncode == 0, done.stderr
    manifest = read_manifest(out)
    errors = read_errors(out)
    assert manifest.totals["inputs"] == 12 == manifest.records + len(errors)
    by_row = {row["reason"].split(":")[0] if row["stage"] == "discover" else row["path"]: row for row in errors}
    assert by_row[f"{base}/gone/4.jpg"]["stage"] == "download"
    assert by_row[f"{base}/gone/4.jpg"]["cause"] == "404"
    assert "transient" not in by_row[f"{base}/gone/4.jpg"]
    assert by_row[f"{base}/html/6"]["stage"] == "download"
    assert {row["reason"].split(":")[0] for row in errors if row["stage"] == "discover"} == {
        "urls.csv line 10",
        "urls.csv line 11",
    }
    assert state.hits["/flaky/2.jpg"] == 2  # one 503, then the image
    shown = json.dumps(errors) + (out / "manifest.json").read_text()
    assert "secret" not in shown and "user:" not in shown
    assert "***@" in json.dumps(errors)
    samples = list(open_shards(out))
    kept = [i for i in range(12) if i not in (4, 6, 8, 9, 10)]
    assert [s.key for s in samples] == [f"{i:09d}" for i in kept]
    assert [s.text for s in samples] == [f"photo {i}" for i in kept]
    assert [s.fields["n"] for s in samples] == [str(i) for i in kept]
    assert [s.meta["source"] for s in samples] == [rows[i]["url"] for i in kept]
    assert manifest.totals["download:404"] == 2 and manifest.totals["transient"] == 0


def test_the_same_bytes_whatever_the_workers_and_finish_order(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    state, base = site
    state.jitter = 0.03  # downloads finish out of order
    rows = _rows(base, 24)
    rows[5]["url"] = f"{base}/gone/5.jpg"
    table = _table(tmp_path / "urls.csv", rows)
    outputs = []
    for workers, threads in ((1, "1"), (2, "8")):
        out = tmp_path / f"out{workers}"
        args = ["--shard-size", "7", "--workers", str(workers), "--download-threads", threads, "--resize", "32"]
        done = shardkit("pack", table, out, *args, *FAST)
        assert done.returncode == 0, done.stderr
        outputs.append(_digests(out))
    assert outputs[0] == outputs[1]
    assert len([name for name in outputs[0] if name.endswith(".tar")]) == 4


def test_gzipped_csv_jsonl_and_parquet_tables_pack_alike(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    _, base = site
    rows = _rows(base, 6)
    tables = [_table(tmp_path / "urls.csv.gz", rows), tmp_path / "urls.parquet", tmp_path / "urls.jsonl.gz"]
    pq.write_table(pa.Table.from_pylist([{**row, "n": str(row["n"])} for row in rows]), tables[1])
    tables[2].write_bytes(
        gzip.compress("".join(json.dumps({**row, "n": str(row["n"])}) + "\n" for row in rows).encode())
    )
    seen = []
    for number, table in enumerate(tables):
        out = tmp_path / f"out{number}"
        done = shardkit("pack", table, out, *FAST)
        assert done.returncode == 0, done.stderr
        seen.append([(s.key, s.text, s.fields, s.meta["source"]) for s in open_shards(out)])
    assert seen[0] == seen[1] == seen[2]
    assert len(seen[0]) == 6


def test_resume_tries_again_only_what_failed_transiently(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    state, base = site
    rows = _rows(base, 15)
    table = _table(tmp_path / "urls.csv", rows)
    state.failing = {"/ok/7.jpg", "/ok/8.jpg"}  # down for the whole first run: 503 on every try
    out = tmp_path / "out"
    args = ["--shard-size", "5", "--workers", "2", "--retries", "1", "--backoff", "0.01", "--timeout", "5"]
    first = shardkit("pack", table, out, *args)
    assert first.returncode == 0, first.stderr
    errors = read_errors(out)
    assert sorted(row["path"] for row in errors) == [f"{base}/ok/7.jpg", f"{base}/ok/8.jpg"]
    assert all(row["transient"] is True and row["cause"] == "5xx" for row in errors)
    assert read_manifest(out).totals["transient"] == 2
    assert "of which transient" in first.stdout and "--resume" in first.stdout and "5xx 2" in first.stdout
    assert state.hits["/ok/7.jpg"] == 2  # the first try and one retry
    before = dict(state.hits)
    state.failing = set()
    again = shardkit("pack", table, out, *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert read_errors(out) == []
    assert read_manifest(out).records == 15
    asked = {path for path, count in state.hits.items() if count > before.get(path, 0)}
    assert asked == {"/ok/7.jpg", "/ok/8.jpg"}  # only those rows: their shard kept the others
    clean = tmp_path / "clean"
    assert shardkit("pack", table, clean, *args).returncode == 0
    assert _digests(out) == _digests(clean)
    third = shardkit("pack", table, out, *args, "--resume")
    assert third.returncode == 0 and "already complete" in third.stdout


def test_resume_of_a_finished_pack_whose_table_changed_is_refused(
    site: tuple[Site, str], tmp_path: Path, shardkit
) -> None:
    """As a finished folder pack with other inputs: refused in one line, the output as it was,
    whether or not rows failed transiently (their state kept for a --resume)."""
    state, base = site
    args = ["--shard-size", "5", "--workers", "1", "--retries", "0", "--timeout", "5"]
    for failing in (set(), {"/ok/7.jpg"}):
        out = tmp_path / f"out{len(failing)}"
        table = _table(tmp_path / f"urls{len(failing)}.csv", _rows(base, 12))
        state.failing = failing
        assert shardkit("pack", table, out, *args).returncode == 0
        state.failing = set()
        before = {path: path.read_bytes() for path in out.rglob("*") if path.is_file()}
        _table(table, _rows(base, 14))  # two rows more
        again = shardkit("pack", table, out, *args, "--resume")
        assert again.returncode == 1
        assert again.stderr == (
            f"error: {out}: holds a finished pack made with other settings or inputs; use --overwrite to replace it\n"
        )
        assert {path: path.read_bytes() for path in out.rglob("*") if path.is_file()} == before


def test_bad_tables_are_refused_in_one_line(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    _, base = site
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = tmp_path / "links.parquet"
    pq.write_table(pa.table({"link": [f"{base}/ok/1.jpg"], "caption": ["x"]}), table)
    done = shardkit("pack", table, tmp_path / "out")
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "no 'url' column" in done.stderr and "--url-column" in done.stderr
    renamed = shardkit("pack", table, tmp_path / "out2", "--url-column", "link", *FAST)
    assert renamed.returncode == 0, renamed.stderr
    deduped = shardkit("pack", table, tmp_path / "out3", "--url-column", "link", "--dedup", "exact")
    assert deduped.returncode != 0 and "--dedup" in deduped.stderr and "Traceback" not in deduped.stderr


def test_verify_source_accounts_for_every_row(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    _, base = site
    rows = _rows(base, 8)
    rows[3]["url"] = f"{base}/gone/3.jpg"
    rows[5]["url"] = "file:///etc/passwd"
    table = _table(tmp_path / "urls.csv", rows)
    out = tmp_path / "out"
    assert shardkit("pack", table, out, *FAST).returncode == 0
    checked = shardkit("verify", out, "--source", table)
    assert checked.returncode == 0, checked.stdout + checked.stderr


RULE = "each time it is named, it is packed or listed once, packed at most once"


def _recount(out: Path, errors: list[dict[str, str]]) -> None:
    """errors.jsonl rewritten with `errors`, and the manifest's totals counting them (as the tamper
    of one row would leave them consistent, so that only the source check can tell)."""
    from dataclasses import replace

    from shardkit.core.manifest import write_json_atomic

    (out / "errors.jsonl").write_text("".join(json.dumps(row) + "\n" for row in errors))
    manifest = read_manifest(out)
    totals = {**manifest.totals, "errors": len(errors), "inputs": manifest.records + len(errors)}
    write_json_atomic(out / "manifest.json", replace(manifest, totals=totals).sealed().to_json())


def test_verify_source_accounts_for_each_repeated_row_once(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    """A scraped table repeats URLs: each repeated row is listed in errors.jsonl and the URL packed
    once, so a URL named 3 times is accounted for 3 times, and that is right; one listing fewer or
    more is a row lost or a row counted twice, named in one line."""
    from shardkit.checks.verify import verify

    _, base = site
    rows = _rows(base, 12)
    rows[3]["url"] = f"{base}/gone/3.jpg"  # 404: listed
    rows[5]["url"] = rows[7]["url"] = rows[0]["url"]  # one URL in 3 rows: packed once, listed twice
    rows[6]["url"] = rows[3]["url"]  # a failing URL again: both its rows listed
    with_user = base.replace("http://", "http://{}@")
    rows[8]["url"] = with_user.format("ann:one") + "/ok/8.jpg"  # the same URL but for its credentials:
    rows[9]["url"] = with_user.format("bob:two") + "/ok/8.jpg"  # two URLs, both packed, shown alike
    rows[10]["url"] = rows[8]["url"]  # ...and a repeat of one: listed
    rows[11]["url"] = f"{base}/ok/1.jpg#again"  # a fragment makes another URL: packed as its own row
    table = _table(tmp_path / "urls.csv", rows)
    out = tmp_path / "out"
    assert shardkit("pack", table, out, "--shard-size", "4", *FAST).returncode == 0
    errors = read_errors(out)
    shown = {url: url.replace("ann:one@", "***@") for url in (rows[0]["url"], rows[3]["url"], rows[8]["url"])}
    assert Counter(row["path"] for row in errors) == {
        shown[rows[0]["url"]]: 2,
        shown[rows[3]["url"]]: 2,
        shown[rows[8]["url"]]: 1,
    }
    assert [s.meta["source"] for s in open_shards(out)].count(shown[rows[8]["url"]]) == 2
    checked = shardkit("verify", out, "--source", table)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    dropped = [row for row in errors if "line 9:" not in row["reason"]]  # row 7's listing (line 9) removed
    assert len(dropped) == len(errors) - 1
    _recount(out, dropped)
    problems = [(p.kind, p.detail) for p in verify(out, source=table).problems]
    said = "is named 3 times in the source but packed once and listed once in errors.jsonl"
    assert problems == [("lost", f"{rows[0]['url']} {said}: {RULE}")]
    twice = [*errors, next(row for row in errors if row["path"] == shown[rows[3]["url"]])]  # a failing row listed again
    _recount(out, twice)
    problems = [(p.kind, p.detail) for p in verify(out, source=table).problems]
    said = "is named 2 times in the source but packed 0 times and listed 3 times in errors.jsonl"
    assert problems == [("duplicate-source", f"{rows[3]['url']} {said}: {RULE}")]
    failed = shardkit("verify", out, "--source", table, "--json", tmp_path / "report.json")
    assert failed.returncode == 1 and "FAILED" in failed.stdout
    assert [p["detail"] for p in json.loads((tmp_path / "report.json").read_text())["problems"]] == [problems[0][1]]


def test_verify_source_refuses_a_repeated_url_packed_twice(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    """A URL that 3 rows name is packed once: packed twice and listed once is 3 accounts, and wrong."""
    from shardkit.checks.verify import verify

    _, base = site
    rows = _rows(base, 4)
    with_user = base.replace("http://", "http://{}@")
    rows[1]["url"] = rows[3]["url"] = with_user.format("ann:one") + "/ok/1.jpg"
    rows[2]["url"] = with_user.format("bob:two") + "/ok/1.jpg"  # another URL (its credentials): packed too
    table = _table(tmp_path / "urls.csv", rows)
    out = tmp_path / "out"
    assert shardkit("pack", table, out, *FAST).returncode == 0
    assert verify(out, source=table).ok
    rows[2]["url"] = rows[1]["url"]  # now the table names one URL 3 times, which pack would pack once
    _table(table, rows)
    shown = rows[1]["url"].replace("ann:one@", "***@")
    problems = [(p.kind, p.detail) for p in verify(out, source=table).problems]
    said = "is named 3 times in the source but packed 2 times and listed once in errors.jsonl"
    assert problems == [("duplicate-source", f"{shown} {said}: {RULE}")]


def test_probe_of_a_url_table_reads_headers_by_ranges(site: tuple[Site, str], tmp_path: Path, shardkit) -> None:
    state, base = site
    rows = _rows(base, 20)
    rows[3]["url"] = f"{base}/gone/3.jpg"
    rows[4]["url"] = f"{base}/html/4"
    table = _table(tmp_path / "urls.csv", rows)
    folder = tmp_path / "same"
    folder.mkdir()
    for i in range(20):
        if i not in (3, 4):
            (folder / f"{i:02d}.jpg").write_bytes(_jpeg(i))
    remote, local = tmp_path / "remote.json", tmp_path / "local.json"
    done = shardkit("probe", table, "--json", remote, "--retries", "1")
    assert done.returncode == 0, done.stderr
    assert shardkit("probe", folder, "--json", local).returncode == 0
    got, want = json.loads(remote.read_text()), json.loads(local.read_text())
    for key in ("images", "bytes", "percentiles", "formats", "modes", "short_side_histogram", "recommendation"):
        assert got[key] == want[key], key
    assert got["images"] == 18 and got["files"] == 20 and got["table"]["rows"] == 20
    assert got["header_bytes"] < got["bytes"] / 4 and state.ranges >= 18
    (problem,) = got["problems"].values()
    assert problem["count"] == 2 and any("HTTP 404" in example for example in problem["examples"])


@pytest.mark.slow  # (3.1 s: waits out deadlines)
def test_a_hung_server_a_dead_host_and_bad_bytes_cost_their_rows_not_the_run(
    site: tuple[Site, str], tmp_path: Path, shardkit
) -> None:
    _, base = site
    with socket.socket() as closed:  # a port nothing listens on: every connection refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    rows = _rows(base, 14)
    rows[1]["url"] = f"{base}/hang/1.jpg"
    for i in (2, 3, 4, 5):
        rows[i]["url"] = f"{dead}/{i}.jpg"
    rows[6]["sha256"] = "0" * 64  # not the image's
    rows[7]["sha256"] = hashlib.sha256(_jpeg(7)).hexdigest().upper()  # the image's, in capitals
    table = _table(tmp_path / "urls.csv", rows)
    out = tmp_path / "out"
    started = time.monotonic()
    done = shardkit(
        "pack", table, out, "--retries", "1", "--backoff", "0.05", "--timeout", "1.5", "--max-pixels", "20000"
    )
    assert done.returncode == 0, done.stderr
    assert time.monotonic() - started < 25  # the hung row's two tries of 1.5 s, not its 30 s
    errors = {row["path"]: row for row in read_errors(out)}
    assert errors[f"{base}/hang/1.jpg"]["cause"] == "timeout" and errors[f"{base}/hang/1.jpg"]["transient"]
    assert all(errors[f"{dead}/{i}.jpg"]["transient"] for i in (2, 3, 4, 5))
    assert errors[f"{base}/ok/6.jpg"]["cause"] == "sha256" and "transient" not in errors[f"{base}/ok/6.jpg"]
    assert errors[f"{base}/ok/9.jpg"]["stage"] == "header" and "pixels" in errors[f"{base}/ok/9.jpg"]["reason"]
    assert len(errors) == 7 and read_manifest(out).records == 7
    assert "7" in [s.key.lstrip("0") for s in open_shards(out)]


def test_duplicates_of_a_url_table_downloads_and_groups_the_copies(
    site: tuple[Site, str], tmp_path: Path, shardkit
) -> None:
    _, base = site
    rows = _rows(base, 6)
    rows.append({"url": f"{base}/copy/2.jpg", "caption": "the same bytes as row 2", "n": 6})
    table = _table(tmp_path / "urls.csv", rows)
    report = tmp_path / "dups.json"
    done = shardkit("duplicates", table, "--json", report)
    assert done.returncode == 0, done.stderr
    groups = json.loads(report.read_text())["groups"]
    assert [sorted(group["files"]) for group in groups] == [[f"{base}/copy/2.jpg", f"{base}/ok/2.jpg"]]

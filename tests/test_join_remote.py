"""`open_shards(OUT, join=URL)` (readers/joined): a table at a URL is read through storage like every
remote read, so a passing failure is retried, the call's storage options reach it, and a missing or
unreachable table is one line naming the URL. Real servers on loopback (tests/servers.serving)."""

from __future__ import annotations

import shutil
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import SimpleHTTPRequestHandler
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from shardkit.core.errors import ConfigError, StorageError
from shardkit.readers import open_shards

from .servers import serving


@pytest.fixture(scope="module")
def tar(packed_sample: Any) -> Path:
    path: Path = packed_sample("webdataset", 32, 7)
    return path


def table_csv(out: Path) -> tuple[str, dict[str, int]]:
    """A join table of every other key of `out`, as CSV text, and the score it gives each key."""
    keys = pq.read_table(out / "index.parquet", columns=["key"]).column("key").to_pylist()[::2]
    scores = {key: i for i, key in enumerate(keys)}
    return "key,score\n" + "".join(f"{key},{score}\n" for key, score in scores.items()), scores


@contextmanager
def folder_server(folder: Path, faults: dict[str, list[int]], seen: list[tuple[str, str | None]]) -> Iterator[str]:
    """`folder` over http; the first requests of a path in `faults` are answered with the statuses
    listed there, in order; `seen` gets (path, its X-Token header) of each request."""
    lock = threading.Lock()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            with lock:
                seen.append((self.path, self.headers.get("X-Token")))
                planned = faults.get(self.path)
                status = planned.pop(0) if planned else None
            if status is None:
                super().do_GET()
            else:
                self.send_error(status)

    with serving(Handler) as url:
        yield url


def test_a_table_at_a_url_is_joined_and_a_passing_failure_retried(tar: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "10")
    text, scores = table_csv(tar)
    served = tmp_path / "served"
    served.mkdir()
    (served / "scores table.csv").write_text(text)
    seen: list[tuple[str, str | None]] = []
    with folder_server(served, {"/scores%20table.csv": [503]}, seen) as url:
        ds = open_shards(tar, decode="bytes", join=f"{url}/scores%20table.csv")
    assert [path for path, _ in seen] == ["/scores%20table.csv"] * 2  # the 503, then the table
    local = open_shards(tar, decode="bytes", join=served / "scores table.csv")
    for sample, same in zip(ds, local, strict=True):
        assert sample.fields == same.fields == {"score": scores.get(sample.key)}


def test_the_storage_options_of_the_call_reach_the_table(tar: Path, tmp_path: Path) -> None:
    text, scores = table_csv(tar)
    served = tmp_path / "served"
    shutil.copytree(tar, served / "out")
    (served / "t.csv").write_text(text)
    seen: list[tuple[str, str | None]] = []
    options = {"headers": {"X-Token": "secret"}}
    with folder_server(served, {}, seen) as url:
        ds = open_shards(
            f"{url}/out", decode="bytes", join=f"{url}/t.csv", storage_options=options, cache_dir=tmp_path / "cache"
        )
        got = {sample.key: sample.fields for sample in ds}
    assert ("/t.csv", "secret") in seen
    assert got == {key: {"score": scores.get(key)} for key in got} and len(got) == len(ds)


def test_a_missing_or_unreachable_table_is_one_line_naming_it(tar: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "0.3")
    with folder_server(tmp_path, {}, []) as url, pytest.raises(ConfigError) as caught:
        open_shards(tar, join=f"{url}/missing.parquet")
    assert str(caught.value) == f"join: {url}/missing.parquet: no such file or folder"
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageError) as refused:
        open_shards(tar, join=f"http://127.0.0.1:{port}/t.parquet")
    said = str(refused.value)
    assert said.startswith(f"http://127.0.0.1:{port}/t.parquet: downloading failed") and "gave up after" in said
    assert "\n" not in said

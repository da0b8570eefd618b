"""The downloader of URL tables (storage/download, storage/webget) against a real fault server on
loopback (tests/servers.FaultServer): what each failure is said as, what is retried and how often
(counted by the server), the deadline, the caps, the order and limits of `Downloader.fetch`, and
the per-host breaker. No mocks."""

from __future__ import annotations

import io
import itertools
import logging
import os
import pickle
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from email.utils import formatdate

import numpy as np
import pytest
from PIL import Image

from shardkit.core.config import WebConfig
from shardkit.core.version import __version__
from shardkit.storage.download import (
    Downloader,
    DownloadError,
    download,
    fetch_head,
    fetch_range,
    redact,
    retry_wait,
    url_problem,
)
from shardkit.storage.webget import disallowed, retry_after

from .servers import FaultServer, free_port

WEB = WebConfig(retries=2, backoff=0.01, timeout=2.0, max_bytes=1 << 20, threads=4, per_host=2)


def encoded(fmt: str, seed: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


JPEG = encoded("JPEG", 1)


@pytest.fixture(scope="module")
def server() -> Iterator[FaultServer]:
    with FaultServer(JPEG) as faults:
        yield faults


@pytest.fixture
def fresh() -> Iterator[FaultServer]:
    """A server of the test's own: its counts and most requests at once are the test's alone."""
    with FaultServer(JPEG) as faults:
        yield faults


def failure(url: str, web: WebConfig = WEB, sha256: str | None = None) -> DownloadError:
    with pytest.raises(DownloadError) as caught:
        download(url, web, sha256)
    return caught.value


# --- one URL ------------------------------------------------------------------------------------


def test_an_image_comes_whole_asking_as_shardkit_for_no_encoding(server: FaultServer) -> None:
    png = encoded("PNG", 2)
    with FaultServer(png) as png_server:
        assert download(png_server.url("/image/"), WEB) == png
    assert download(server.url("/image/whole"), WEB) == JPEG + b"whole"
    headers = server.hits_of("/image/whole")[0].headers
    assert headers["User-Agent"] == f"shardkit/{__version__}" and headers["Accept-Encoding"] == "identity"


def test_a_503_is_tried_again_until_it_passes(server: FaultServer) -> None:
    assert download(server.url("/flaky/passes?fails=2"), WEB) == JPEG
    assert server.counts["/flaky/passes?fails=2"] == 3


@pytest.mark.parametrize(("status", "cause"), [(503, "5xx"), (500, "5xx"), (429, "429"), (408, "408")])
def test_transient_statuses_are_tried_retries_times_then_said_transient(
    server: FaultServer, status: int, cause: str
) -> None:
    path = f"/flaky/spent?fails=99&status={status}"
    error = failure(server.url(path))
    said = (error.reason, error.cause, error.transient, error.status)
    assert said == (f"HTTP {status} (tried 3 times)", cause, True, status)
    assert server.counts[path] == 1 + WEB.retries


@pytest.mark.parametrize(
    ("status", "cause"), [(404, "404"), (410, "410"), (403, "403"), (401, "401"), (400, "4xx"), (418, "4xx")]
)
def test_final_statuses_are_asked_once(server: FaultServer, status: int, cause: str) -> None:
    error = failure(server.url(f"/status/{status}"))
    assert (error.reason, error.cause, error.transient, error.status) == (f"HTTP {status}", cause, False, status)
    assert server.counts[f"/status/{status}"] == 1


def test_retry_after_is_waited_instead_of_the_backoff(server: FaultServer) -> None:
    path = "/flaky/later?fails=1&status=429&retry_after=1"
    assert download(server.url(path), WEB) == JPEG  # backoff 0.01 s: without Retry-After, ~0.02 s apart
    first, second = server.hits_of(path)
    assert second.started - first.finished >= 0.9


def test_the_wait_before_a_retry() -> None:
    rng = random.Random(7)
    web = replace(WEB, backoff=0.5)
    waits = [retry_wait(DownloadError("HTTP 503"), 2, web, rng) for _ in range(2000)]
    assert 0 <= min(waits) < 0.1 and 1.9 < max(waits) <= 2.0  # full jitter: uniform(0, 0.5 * 2**2)
    assert max(retry_wait(DownloadError("x"), 30, web, rng) for _ in range(200)) <= 60  # capped
    told = DownloadError("HTTP 429", retry_after=retry_after("3600"))
    assert retry_wait(told, 1, web, rng) == 60  # a longer Retry-After: a minute
    assert retry_after("7") == 7.0 and retry_after("soon") is None and retry_after(None) is None
    in_30_s = retry_after(formatdate(time.time() + 30, usegmt=True))
    assert in_30_s is not None and 28 <= in_30_s <= 31


def test_a_web_page_at_200_is_no_image(server: FaultServer) -> None:
    error = failure(server.url("/html"))
    assert (error.reason, error.cause, error.transient) == ("not an image (text/html at 200)", "not-image", False)
    assert server.counts["/html"] == 1


def test_a_body_cut_short_is_tried_again_and_never_taken(server: FaultServer) -> None:
    assert download(server.url("/drop/once?fails=1"), WEB) == JPEG
    error = failure(server.url("/drop/always?fails=99"))
    half = len(JPEG) // 2
    assert error.reason == f"body cut short ({half:,} of {len(JPEG):,} bytes) (tried 3 times)"
    assert (error.cause, error.transient) == ("cut", True)
    assert server.counts["/drop/always?fails=99"] == 3


@pytest.mark.parametrize("route", ["/trickle", "/hang", "/slow-headers"])
def test_a_try_ends_at_its_deadline_however_the_bytes_come(server: FaultServer, route: str) -> None:
    web = replace(WEB, timeout=0.5, retries=0)
    started = time.monotonic()
    error = failure(server.url(route), web)
    # (the server would take 50 s: a byte every 50 ms; each byte resets a socket timeout)
    assert time.monotonic() - started < 10
    assert (error.reason, error.cause, error.transient) == ("timed out after 0.5 s", "timeout", True)


def test_redirects_are_followed_five_times_and_never_elsewhere(server: FaultServer) -> None:
    assert download(server.url("/chain/5"), WEB) == JPEG
    for path, reason in [("/chain/6", "more than 5 redirects"), ("/loop/a", "redirect loop"),
                         ("/ftp", "redirect to ftp://…")]:  # fmt: skip
        error = failure(server.url(path))
        assert (error.reason, error.cause, error.transient) == (reason, "redirect", False)
    assert server.counts["/loop/a"] == 1 and server.counts["/loop/b"] == 1


def test_a_gzip_bomb_is_inflated_only_up_to_the_cap(server: FaultServer) -> None:
    assert download(server.url("/gzip-image"), WEB) == JPEG  # gzipped despite identity: inflated
    error = failure(server.url("/bomb"))  # 64 MiB inside
    assert (error.reason, error.cause, error.transient) == ("over the 1MiB cap", "too-big", False)


@pytest.mark.parametrize("route", ["/huge", "/endless"])
def test_a_body_over_the_cap_is_refused(server: FaultServer, route: str) -> None:
    error = failure(server.url(route))  # /huge says 1 GiB: refused unread; /endless says nothing
    assert (error.reason, error.cause, error.transient) == ("over the 1MiB cap", "too-big", False)


def test_noai_refuses_unless_told_to_ignore_it(server: FaultServer) -> None:
    error = failure(server.url("/noai"))
    assert (error.reason, error.cause, error.transient) == ("X-Robots-Tag: noai", "noai", False)
    assert download(server.url("/noai"), replace(WEB, respect_noai=False)) == JPEG


@pytest.mark.parametrize(
    ("values", "refused"),
    [(["noai"], "noai"), (["NoImageAI"], "noimageai"), (["noindex, nofollow"], "noindex"),
     (["noimageindex"], "noimageindex"), (["shardkit: noai"], "noai"),
     (["all", "shardkit: noimageai, nofollow"], "noimageai"),
     (["otherbot: noai"], ""), (["nofollow, noarchive"], ""), (["unavailable_after: 25 Jun 2010 15:00:00 PST"], ""),
     ([], "")],
)  # fmt: skip
def test_the_directives_that_refuse_are_img2datasets_to_all_or_to_us(values: list[str], refused: str) -> None:
    assert disallowed(values) == refused


def test_credentials_are_sent_and_never_said(server: FaultServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    host = server.base.removeprefix("http://")
    assert download(f"http://user:pa%20ss@{host}/auth", WEB) == JPEG
    error = failure(f"http://user:wrong-secret@{host}/auth")
    assert (error.reason, error.cause, error.transient) == ("HTTP 401", "401", False)
    said = " ".join([error.reason, str(error), repr(error), caplog.text])
    assert "wrong-secret" not in said and "pa%20ss" not in said and "pa ss" not in said
    assert redact(f"http://user:wrong-secret@{host}/auth?x=1") == f"http://***@{host}/auth?x=1"
    assert redact("https://h/a@b.jpg") == "https://h/a@b.jpg" and redact("/local/path") == "/local/path"


def test_credentials_do_not_follow_a_redirect_to_another_host(server: FaultServer, fresh: FaultServer) -> None:
    host = server.base.removeprefix("http://")
    elsewhere = fresh.url("/image/elsewhere")
    assert download(f"http://user:pa%20ss@{host}/redirect?to={elsewhere}", WEB) == JPEG + b"elsewhere"
    assert "Authorization" not in fresh.hits_of("/image/elsewhere")[0].headers


@pytest.mark.parametrize(
    ("url", "problem"),
    [("http://example.com/a.jpg", ""), ("HTTPS://example.com:8443/a b.jpg?x=1", ""),
     ("file:///etc/passwd", "file:// is not http(s)"), ("ftp://example.com/a.jpg", "ftp:// is not http(s)"),
     ("/data/a.jpg", "not a URL (a local path?)"), ("example.com/a.jpg", "not a URL (a local path?)"),
     ("http:///a.jpg", "no host in the URL"), ("http://example.com/a\n.jpg", "control characters in the URL"),
     ("http://example.com:99999/a.jpg", "not a valid URL (its host or port)"), ("", "no URL"),
     ("http://example.com/" + "a" * 8200, "URL over 8 KiB (8,219 characters)")],
)  # fmt: skip
def test_what_is_no_url_to_download(url: str, problem: str) -> None:
    assert url_problem(url) == problem
    if problem:
        error = failure(url)
        assert (error.reason, error.cause, error.transient) == (problem, "url", False)


def test_a_refused_connection_is_transient_after_its_retries() -> None:
    error = failure(f"http://127.0.0.1:{free_port()}/a.jpg")  # nobody listens there
    assert (error.reason, error.cause, error.transient) == ("connection refused (tried 3 times)", "connection", True)


def test_a_host_that_does_not_exist_is_final() -> None:
    # the download's own 2 s would call a resolver slow to say "no such host" a timeout
    error = failure("http://no-such-host.invalid/a.jpg", replace(WEB, timeout=30.0))
    assert error.cause == "dns"


def test_the_sha256_is_checked_when_given(server: FaultServer) -> None:
    import hashlib

    digest = hashlib.sha256(JPEG + b"hashed").hexdigest()
    assert download(server.url("/image/hashed"), WEB, digest.upper()) == JPEG + b"hashed"
    error = failure(server.url("/image/mismatch"), sha256=digest)
    assert (error.reason, error.cause, error.transient) == ("sha256 mismatch", "sha256", False)
    assert server.counts["/image/mismatch"] == 1


@pytest.mark.parametrize("ranges", ["yes", "no"])
def test_the_head_and_a_range_with_or_without_range_support(server: FaultServer, ranges: str) -> None:
    whole = JPEG + b"head"
    url = server.url(f"/image/head?ranges={ranges}")
    assert fetch_head(url, WEB, 16) == (whole[:16], len(whole))
    assert fetch_range(url, WEB, 100, 50) == whole[100:150]
    assert fetch_range(url, WEB, len(whole) - 4, 50) == whole[-4:]  # past the end: what there is
    sent = [hit.headers.get("Range") for hit in server.hits_of(f"/image/head?ranges={ranges}")]
    assert sent == ["bytes=0-15", "bytes=100-149", f"bytes={len(whole) - 4}-{len(whole) + 45}"]
    assert failure(server.url("/html")).cause == "not-image"
    with pytest.raises(DownloadError, match="X-Robots-Tag: noai"):
        fetch_head(server.url("/noai"), WEB)
    with pytest.raises(DownloadError, match="over the 1MiB cap"):
        fetch_head(server.url("/huge"), WEB)


def test_a_head_shorter_than_a_magic_number_is_still_checked(server: FaultServer) -> None:
    png = encoded("PNG", 3)
    with FaultServer(png) as png_server:
        assert fetch_head(png_server.url("/image/"), WEB, 4) == (png[:4], len(png))  # (PNG's is 8 bytes)
    with pytest.raises(DownloadError, match="not an image"):
        fetch_head(server.url("/html"), WEB, 4)


def test_download_errors_survive_pickling() -> None:
    error = DownloadError("HTTP 503 (tried 6 times)", "5xx", True, 503)
    again = pickle.loads(pickle.dumps(error))
    assert (again.reason, again.cause, again.transient, again.status) == ("HTTP 503 (tried 6 times)", "5xx", True, 503)


def test_the_pool_is_the_process_own() -> None:
    from shardkit.storage.client import http_client

    parent = http_client()
    pid = os.fork()
    if pid == 0:  # the child: a pool of its own, not the parent's sockets
        os._exit(0 if http_client() is not parent else 1)
    assert os.waitpid(pid, 0)[1] == 0 and http_client() is parent


# --- many URLs ----------------------------------------------------------------------------------


def test_results_come_in_the_order_asked_whatever_order_they_finish(fresh: FaultServer) -> None:
    delays = [0.6, 0.0, 0.3, 0.0, 0.0, 0.2]
    paths = [f"/image/{i}?delay={delay}" for i, delay in enumerate(delays)]
    with Downloader(replace(WEB, threads=8, per_host=8)) as downloader:
        results = list(downloader.fetch((fresh.url(path), None) for path in paths))
    assert results == [JPEG + f"{i}".encode() for i in range(len(delays))]
    finished = sorted(paths, key=lambda path: fresh.done_hits_of(path)[0].finished)
    assert finished != paths  # (the server finished them out of order)


@pytest.mark.parametrize(("threads", "per_host"), [(2, 8), (8, 2)])
def test_no_more_at_once_than_threads_nor_per_host(fresh: FaultServer, threads: int, per_host: int) -> None:
    with Downloader(replace(WEB, threads=threads, per_host=per_host)) as downloader:
        urls = [(fresh.url(f"/image/{i}?delay=0.1"), None) for i in range(8)]
        assert all(isinstance(result, bytes) for result in downloader.fetch(urls))
    assert fresh.most_active == 2


def test_a_slow_url_does_not_hold_back_other_hosts(server: FaultServer, fresh: FaultServer) -> None:
    requests = [(fresh.url("/image/slow?delay=0.6"), None)] + [(server.url(f"/image/quick{i}"), None) for i in range(6)]
    with Downloader(replace(WEB, threads=4, per_host=1)) as downloader:
        assert len(list(downloader.fetch(requests))) == 7
    slow = fresh.done_hits_of("/image/slow?delay=0.6")[0]
    assert max(server.done_hits_of(f"/image/quick{i}")[0].finished for i in range(6)) < slow.finished


def test_the_look_ahead_is_bounded(server: FaultServer) -> None:
    pulled = []

    def endless() -> Iterator[tuple[str, None]]:
        for i in itertools.count():
            pulled.append(i)
            yield server.url(f"/image/{i % 3}?delay={0.3 if i == 0 else 0}"), None

    with Downloader(replace(WEB, threads=2), window=5) as downloader:
        results = downloader.fetch(endless())
        assert next(results) == JPEG + b"0"
        assert len(pulled) <= 6  # the window, and the one that waits for room
        assert [next(results) for _ in range(4)] == [JPEG + b"1", JPEG + b"2", JPEG + b"0", JPEG + b"1"]


def test_closing_ends_a_fetch_still_waiting(fresh: FaultServer) -> None:
    downloader = Downloader(WEB)
    # the answer waits until the server ends (after the test): close() comes first however late its timer runs
    results = downloader.fetch([(fresh.url("/image/closed?delay=60"), None)])
    threading.Timer(0.05, downloader.close).start()
    with pytest.raises(RuntimeError, match="closed"):
        next(results)


def test_retries_and_failures_in_a_fetch(fresh: FaultServer) -> None:
    requests = [(fresh.url("/flaky/r?fails=1"), None), (fresh.url("/status/404"), None), ("ftp://x/y.jpg", None),
                (fresh.url("/image/ok"), "0" * 64)]  # fmt: skip
    with Downloader(WEB) as downloader:
        first, missing, bad, mismatch = downloader.fetch(requests)
    assert first == JPEG and fresh.counts["/flaky/r?fails=1"] == 2
    assert isinstance(missing, DownloadError) and missing.reason == "HTTP 404"
    assert isinstance(bad, DownloadError) and bad.cause == "url"
    assert isinstance(mismatch, DownloadError) and mismatch.cause == "sha256"


def test_a_host_that_answers_nothing_fails_its_rows_at_once(fresh: FaultServer) -> None:
    web = replace(WEB, retries=3, backoff=0.05, threads=4, per_host=2)
    with Downloader(web) as downloader:
        results = list(downloader.fetch((fresh.url(f"/reset/{i}?fails=99"), None) for i in range(30)))
    assert all(isinstance(result, DownloadError) and result.transient for result in results)
    tries = sum(fresh.routes.values())
    assert tries < 30  # fewer tries than rows; without the breaker 30 x 4
    unreachable = [result for result in results if isinstance(result, DownloadError) and result.cause == "unreachable"]
    assert len(unreachable) >= 30 - tries
    assert unreachable[0].reason.startswith("host unreachable (connection closed before an answer, ")


def test_a_probe_that_gets_an_answer_closes_the_breaker(fresh: FaultServer) -> None:
    web = replace(WEB, retries=0, backoff=0.2, threads=1, per_host=1)  # a probe 0.2 s after it opens
    with Downloader(web) as downloader:
        first = list(downloader.fetch((fresh.url(f"/outage/{i}?until=3"), None) for i in range(5)))
        assert [result.cause for result in first if isinstance(result, DownloadError)] == ["connection"] * 3 + [
            "unreachable"
        ] * 2
        time.sleep(0.3)
        second = list(downloader.fetch((fresh.url(f"/outage/{i}?until=3"), None) for i in range(3)))
    assert second == [JPEG + f"{i}".encode() for i in range(3)]
    assert fresh.routes["outage"] == 6

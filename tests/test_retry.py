"""The one retry policy (storage/retry): its window form (storage's requests) and its count form
(a URL table's images) give the waits and the number of tries each caller had, and `retrying` ends
in one StorageError naming the URL."""

from __future__ import annotations

import random
import time

import pytest

from shardkit.core.config import WebConfig
from shardkit.core.errors import StorageError
from shardkit.storage.download import url_policy
from shardkit.storage.retry import RetryPolicy, retrying, storage_policy


def waits(policy: RetryPolicy, elapsed_after: list[float]) -> list[float | None]:
    """The policy's answer after each failed try, the tries having ended at these elapsed times."""
    return [policy.next_wait(tries, elapsed=elapsed) for tries, elapsed in enumerate(elapsed_after, 1)]


def test_the_window_form_doubles_its_wait_up_to_four_seconds_and_stops_at_the_window() -> None:
    policy = RetryPolicy.windowed(30.0)
    assert [policy.wait(retry) for retry in range(1, 8)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert waits(policy, [0.0, 0.25, 0.75, 1.75, 3.75, 7.75, 11.75]) == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert policy.next_wait(9, elapsed=26.0) == 4.0 and policy.next_wait(9, elapsed=26.01) is None
    assert RetryPolicy.windowed(0.0).next_wait(1) is None  # no window: the first failure is final


def test_the_window_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SHARDKIT_RETRY_SECONDS", raising=False)
    assert storage_policy().window == 30.0
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "2.5")
    assert storage_policy() == RetryPolicy.windowed(2.5)


def test_the_count_form_draws_full_jitter_takes_retry_after_and_counts_tries() -> None:
    web = WebConfig(retries=2, backoff=0.5)
    policy = url_policy(web)
    rng = random.Random(3)
    drawn = [policy.wait(2, rng) for _ in range(2000)]
    assert 0 <= min(drawn) < 0.1 and 1.9 < max(drawn) <= 2.0  # uniform(0, 0.5 * 2**2)
    assert policy.wait(1, rng, asked=7.0) == 7.0 and policy.wait(1, rng, asked=3600.0) == 60.0
    assert policy.next_wait(2, rng) is not None and policy.next_wait(3, rng) is None  # 1 try + 2 retries
    assert policy.next_wait(3, rng, asked=1.0) is None  # a Retry-After adds no try
    assert policy.bound(web.retries) == 2.0 and policy.bound(30) == 60.0  # (the breaker's probe interval)


def test_a_transient_failure_is_retried_within_the_window_then_said_with_the_url(monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "0.3")
    tries: list[float] = []

    def refused() -> bytes:
        tries.append(time.monotonic())
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(StorageError) as caught:
        retrying("s3://bucket/x.tar", "reading", refused)
    # the first failure waits 0.25 s (within 0.3 s); the second's 0.5 s would pass it
    assert len(tries) == 2 and 0.24 <= tries[1] - tries[0] < 2.0
    said = str(caught.value)
    assert said.startswith("s3://bucket/x.tar: reading failed (ConnectionRefusedError") and "gave up after 0s" in said


def test_absence_and_denied_access_are_final_at_once(monkeypatch) -> None:
    monkeypatch.setenv("SHARDKIT_RETRY_SECONDS", "30")
    calls = []

    def missing() -> None:
        calls.append(1)
        raise FileNotFoundError("no such object")

    def denied() -> None:
        calls.append(1)
        raise PermissionError(403, "HTTP 403 Forbidden")

    with pytest.raises(FileNotFoundError):
        retrying("s3://bucket/x", "reading", missing)
    with pytest.raises(StorageError, match="access denied"):
        retrying("s3://bucket/x", "reading", denied)
    assert len(calls) == 2

"""The one retry policy of remote requests, and the loop storage's own requests go through.

`RetryPolicy` says whether a failed request is tried again and how long to wait first, in one of
two forms: a window (shard reads, listings, uploads and `join=` tables: tried while the next try
would start within SHARDKIT_RETRY_SECONDS, waiting 0.25 s, 0.5 s, ... up to 4 s) or a count (the
images of a URL table: `--retries` more tries, each after a full-jitter draw or what a 429/503's
Retry-After asks, a minute at most). `retrying` runs a storage request under the window form: a
transient error retried, then one StoreUnreachable naming the URL; absence and denied access final
at once. The URL downloader (`download`) runs its tries under the count form."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..core.errors import ConfigError, ShardkitError, StorageError, StoreUnreachable, describe

T = TypeVar("T")
RETRY_SECONDS = 30.0  # how long a remote that keeps failing is retried before the error is final
WINDOW_LONGEST_WAIT = 4.0  # the window form's longest wait between two tries
COUNT_LONGEST_WAIT = 60.0  # the count form's, whatever the backoff or a Retry-After says


@dataclass(frozen=True)
class RetryPolicy:
    """When a failed request is tried again. The wait before retry n (1, 2, ...) is at most
    `base * 2**n` and `longest`: that bound itself, or with `jitter` a uniform draw below it (full
    jitter: tries from many clients spread out); a server's Retry-After replaces it, still at most
    `longest`. No retry once `tries` tries were made (the count form), nor when the next try would
    start more than `window` seconds after the first one (the window form)."""

    base: float
    longest: float
    tries: int | None = None
    window: float | None = None
    jitter: bool = False

    @classmethod
    def windowed(cls, seconds: float) -> RetryPolicy:
        """The window form: 0.25 s, 0.5 s, 1 s, ... 4 s between tries, for up to `seconds`."""
        return cls(base=0.125, longest=WINDOW_LONGEST_WAIT, window=seconds)

    @classmethod
    def counted(cls, retries: int, backoff: float) -> RetryPolicy:
        """The count form: `retries` more tries after the first, the first retry's mean wait `backoff`."""
        return cls(base=backoff, longest=COUNT_LONGEST_WAIT, tries=retries + 1, jitter=True)

    def bound(self, retry: int) -> float:
        """The longest wait before retry number `retry`."""
        return min(self.longest, self.base * 2.0**retry)

    def wait(self, retry: int, rng: random.Random | None = None, asked: float | None = None) -> float:
        """Seconds before retry number `retry`: what the server `asked` (Retry-After), else the
        bound or, with jitter, a draw from `rng` below it."""
        if asked is not None:
            return min(self.longest, asked)
        bound = self.bound(retry)
        if not self.jitter:
            return bound
        return (rng or random.Random()).uniform(0.0, bound)

    def next_wait(
        self, tries: int, rng: random.Random | None = None, asked: float | None = None, elapsed: float = 0.0
    ) -> float | None:
        """The wait before the next try after `tries` failed ones, the first started `elapsed`
        seconds ago; None when the policy gives up."""
        if self.tries is not None and tries >= self.tries:
            return None
        wait = self.wait(tries, rng, asked)
        if self.window is not None and elapsed + wait > self.window:
            return None
        return wait


def retry_seconds() -> float:
    """The retry window: SHARDKIT_RETRY_SECONDS, or 30 s."""
    text = os.environ.get("SHARDKIT_RETRY_SECONDS")
    try:
        return max(0.0, float(text)) if text else RETRY_SECONDS
    except ValueError:
        raise ConfigError(f"SHARDKIT_RETRY_SECONDS must be a number of seconds, not {text!r}") from None


def storage_policy() -> RetryPolicy:
    """The policy of storage's own requests: the window form, its length read from the environment."""
    return RetryPolicy.windowed(retry_seconds())


_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, ShardkitError, ImportError)
# botocore's own exceptions (named, not imported: most reads never load botocore): no credentials
# anywhere is not a passing fault, and retrying it for the whole window only delays the one fix
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def retrying(url: str, what: str, action: Callable[[], T]) -> T:
    """`action()`, tried again under the storage policy while it fails with a transient error (a
    refused connection, a timeout, a 5xx); then StoreUnreachable naming the URL and the seconds
    waited. A missing object or denied access is final at once (FileNotFoundError, PermissionError)."""
    policy = storage_policy()
    started, tries = time.monotonic(), 0
    while True:
        try:
            return action()
        except PermissionError as error:
            raise StorageError(f"{url}: access denied ({describe(error, with_type=True)})") from None
        except _PERMANENT:
            raise
        except ValueError as error:  # a URL the client refuses (http.client.InvalidURL): never transient
            raise StorageError(f"{url}: {what} failed ({describe(error, with_type=True)})") from None
        except Exception as error:
            if type(error).__name__ in _NO_CREDENTIALS:
                raise StorageError(
                    f"{url}: no credentials ({describe(error, with_type=True)}); set AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY or AWS_PROFILE, or pass --storage-option key=... --storage-option secret=..."
                ) from None
            tries += 1
            wait = policy.next_wait(tries, elapsed=time.monotonic() - started)
            if wait is None:
                waited = time.monotonic() - started
                raise StoreUnreachable(
                    f"{url}: {what} failed ({describe(error, with_type=True)}); gave up after {waited:.0f}s"
                ) from None
            time.sleep(wait)

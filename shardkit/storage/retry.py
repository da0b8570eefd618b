"""The retry window every remote request goes through: transient errors retried with backoff, then
one StorageError naming the URL; absence and denied access final at once."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from ..core.errors import ConfigError, ShardkitError, StorageError, describe

T = TypeVar("T")
RETRY_SECONDS = 30.0  # how long a remote that keeps failing is retried before the error is final


def retry_seconds() -> float:
    """The retry window: SHARDKIT_RETRY_SECONDS, or 30 s."""
    text = os.environ.get("SHARDKIT_RETRY_SECONDS")
    try:
        return max(0.0, float(text)) if text else RETRY_SECONDS
    except ValueError:
        raise ConfigError(f"SHARDKIT_RETRY_SECONDS must be a number of seconds, not {text!r}") from None


_PERMANENT = (FileNotFoundError, IsADirectoryError, NotADirectoryError, ShardkitError, ImportError)
# botocore's own exceptions (named, not imported: most reads never load botocore): no credentials
# anywhere is not a passing fault, and retrying it for the whole window only delays the one fix
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"}


def retrying(url: str, what: str, action: Callable[[], T]) -> T:
    """`action()`, retried with exponential backoff while it fails with a transient error (a
    refused connection, a timeout, a 5xx) for up to the retry window; then one StorageError naming
    the URL. A missing object or denied access is final at once (FileNotFoundError, PermissionError)."""
    window = retry_seconds()
    started, delay = time.monotonic(), 0.25
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
            if time.monotonic() - started + delay > window:
                waited = time.monotonic() - started
                raise StorageError(
                    f"{url}: {what} failed ({describe(error, with_type=True)}); gave up after {waited:.0f}s"
                ) from None
            time.sleep(delay)
            delay = min(delay * 2, 4.0)

"""Shared pieces of the Ray tests: loopback-only settings and finding task processes."""

from __future__ import annotations

import os
from pathlib import Path

# Ray binds to the machine's first interface unless told it is a single-machine setup; the tests
# keep every Ray socket on 127.0.0.1. Token auth would need a token file shared by all processes.
LOOPBACK_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


def task_pids(title: str = "ray::_on_ray_node") -> list[int]:
    """Worker processes that are running one of our shard tasks right now (Ray sets the title)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(title.encode()):
            pids.append(int(entry.name))
    return pids


def set_env() -> dict[str, str | None]:
    saved = {key: os.environ.get(key) for key in LOOPBACK_ENV}
    os.environ.update(LOOPBACK_ENV)
    return saved


def restore_env(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value

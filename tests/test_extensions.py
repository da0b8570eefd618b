"""The compiled kernels are built wherever CI requires them (SHARDKIT_REQUIRE_EXTENSIONS: no
compiler or headers would leave shardkit correct but at Python speed, silently); elsewhere a
missing one is a skip that says so."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

from shardkit.core.codecs import crop_kernel, header_scanner, tar_walker


@pytest.mark.parametrize(
    ("load", "module", "without"),
    [
        (header_scanner, "_scan", "probe would run at pure-Python speed"),
        (tar_walker, "_tar", "the loader would read tars at Python speed"),
        (crop_kernel, "_crop", "the loader would run through Pillow"),
    ],
)
def test_each_kernel_is_built_where_ci_requires_it(load: Callable[[], Any], module: str, without: str) -> None:
    if os.environ.get("SHARDKIT_REQUIRE_EXTENSIONS"):
        assert load() is not None, f"shardkit.core.{module} did not compile: {without}"
    elif load() is None:
        pytest.skip(f"shardkit.core.{module} was not compiled")

"""A seeded slice of scripts/fuzz_shards.py: damaged outputs of every format, read every way, give
a clean read or a shardkit error; never another exception, a crash or a hang."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fuzz_shards.py"


def test_damaged_outputs_raise_only_shardkit_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--cases", "150", "--seed", "7", "--workers", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    summary = result.stdout.splitlines()[-2]
    assert summary.startswith("150 cases:") and "0 FAILED, 0 CRASHED, 0 HUNG" in summary, summary
    assert " 0 refused" not in summary  # the damage reached the readers

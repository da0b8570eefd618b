"""tests/warm_starts.py, the kill tests' starter: a run says what a cold `python -m shardkit` says,
with the same exit code, in the run's own folder and environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.warm_starts import REPO, WarmStarter


@pytest.mark.slow  # (the machinery of the slow kill tests; a pack and cold starts to compare with)
def test_a_warm_run_is_a_cold_runs_exit_code_and_output(sample_dataset: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    commands = [
        ["probe", str(tmp_path / "missing")],  # one line, exit 1
        ["pack", str(sample_dataset), str(tmp_path / "out"), "--resize", "32", "--workers", "1"],
        ["verify", "out"],  # (relative to the run's folder)
        ["pack", str(sample_dataset), str(tmp_path / "out2"), "--shard-size", "0"],  # refused
    ]
    with WarmStarter() as starter:
        warm = [starter.run(command, env, cwd=tmp_path) for command in commands]
    shardkit = [sys.executable, "-m", "shardkit"]
    cold = [
        subprocess.run([*shardkit, *command], env=env, cwd=tmp_path, capture_output=True, text=True)
        for command in commands[:1] + commands[3:]
    ]
    assert [run.returncode for run in warm] == [cold[0].returncode, 0, 0, cold[1].returncode]
    assert cold[0].returncode != 0 and cold[1].returncode != 0
    for hot, started in zip([warm[0], warm[3]], cold, strict=True):
        assert (hot.returncode, hot.stdout, hot.stderr) == (started.returncode, started.stdout, started.stderr)
    assert "missing" in warm[0].stderr and len(warm[0].stderr.splitlines()) == 1
    assert (tmp_path / "out" / "manifest.json").is_file() and "ok" in (warm[2].stdout + warm[2].stderr).lower()

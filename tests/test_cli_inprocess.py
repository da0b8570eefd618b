"""The in-process `shardkit` fixture (tests/inprocess.py) the CLI tests use: it says and exits as the
real process does, and leaves the test process as it found it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.inprocess import signal_state

# (arguments, exit code): a refusal (1), a usage error from click (2), a success (0)
SAME = [(["probe", "/definitely/not/here"], 1), (["pack", ".", "o", "--format", "zip"], 2), (["--version"], 0)]


@pytest.mark.parametrize(("arguments", "code"), SAME)
def test_it_says_and_exits_as_the_real_process(shardkit, python_command, tmp_path, arguments, code) -> None:
    real = subprocess.run([*python_command, *arguments], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    here = shardkit(*arguments, cwd=tmp_path)
    assert (here.returncode, here.stdout, here.stderr) == (real.returncode, real.stdout, real.stderr)
    assert here.returncode == code
    assert not (tmp_path / "o").exists()


def test_it_leaves_signals_hooks_argv_folder_and_environment_as_they_were(shardkit, sample_dataset, tmp_path):
    before = signal_state()
    hook, argv, cwd = sys.unraisablehook, list(sys.argv), os.getcwd()
    os.environ.pop("SHARDKIT_TEST_VARIABLE", None)
    done = shardkit("probe", sample_dataset, "--workers", "1", cwd=tmp_path, env={"SHARDKIT_TEST_VARIABLE": "1"})
    assert done.returncode == 0, done.stderr
    refused = shardkit("probe", tmp_path / "missing")
    assert refused.returncode == 1 and "no such file or folder" in refused.stderr
    assert signal_state() == before
    assert (sys.unraisablehook, sys.argv, os.getcwd()) == (hook, argv, cwd)
    assert "SHARDKIT_TEST_VARIABLE" not in os.environ


def test_a_bug_is_a_traceback_not_an_exit_code(shardkit, monkeypatch) -> None:
    """An exception the CLI does not turn into one line gets out to the test, as a traceback would."""
    import typer

    def broken(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(typer.Typer, "__call__", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        shardkit("--version")

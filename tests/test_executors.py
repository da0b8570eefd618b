"""Local executors with real processes: a job that kills its process is contained and named."""

from __future__ import annotations

import os
import signal

import pytest

from shardkit.core.errors import WorkerDiedError
from shardkit.runtime.pools import map_local, map_local_surviving_crashes, run_alone


def square_or_die(value: int) -> int:
    if value == 3:
        os.kill(os.getpid(), signal.SIGSEGV)  # what a native crash on a hostile file looks like
    if value == 5:
        raise ValueError("five is not allowed")
    return value * value


def square(value: int) -> int:
    return value * value


def test_a_crashing_job_is_named_and_the_others_still_run() -> None:
    jobs = [0, 1, 2, 3, 4, 6, 7]
    results = dict(map_local_surviving_crashes(square_or_die, jobs, 2, lambda index, how: f"job {index}: {how}"))
    assert results == {0: 0, 1: 1, 2: 4, 3: "job 3: killed by SIGSEGV", 4: 16, 5: 36, 6: 49}


def test_one_crashing_job_on_one_worker_never_takes_this_process_down() -> None:
    assert list(map_local_surviving_crashes(square_or_die, [3], 1, lambda i, how: how)) == [(0, "killed by SIGSEGV")]


def test_run_alone_returns_results_and_reraises_errors() -> None:
    assert run_alone(square_or_die, 4) == (16, None)
    with pytest.raises(ValueError, match="five"):
        run_alone(square_or_die, 5)


def variable(name: str) -> str | None:
    return os.environ.get(name)


def test_workers_see_the_environment_the_driver_has_when_they_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forkserver's children inherit the forkserver's environment, fixed when it started: a
    variable set since (AWS credentials set after a first pack in the same process) must still
    reach the workers of the next pool, as it reaches a forked or spawned child."""
    name = "SHARDKIT_TEST_SET_LATE"
    monkeypatch.delenv(name, raising=False)
    assert dict(map_local(variable, [name, name], 2)) == {0: None, 1: None}  # (the forkserver runs now)
    monkeypatch.setenv(name, "set after the forkserver started")
    assert dict(map_local(variable, [name, name], 2)) == {0: "set after the forkserver started"} | {
        1: "set after the forkserver started"
    }
    assert run_alone(variable, name) == ("set after the forkserver started", None)
    monkeypatch.delenv(name)
    assert dict(map_local(variable, [name, name], 2)) == {0: None, 1: None}


def test_plain_map_local_reports_a_dead_worker() -> None:
    with pytest.raises(WorkerDiedError):
        list(map_local(square_or_die, [1, 3, 4], 2))


def test_the_forkserver_preloads_modules_that_exist() -> None:
    """multiprocessing skips a preload name that does not import without a word: every worker
    would then import the job modules itself (a rename once did that)."""
    import importlib

    from shardkit.runtime.processes import FORKSERVER_PRELOAD, PACK_PRELOAD

    for name in FORKSERVER_PRELOAD + PACK_PRELOAD:
        importlib.import_module(name)


BLAS_SCRIPT = """
import os
from shardkit.runtime.pools import map_local

def blas_threads(_):
    import numpy  # (imported by the forkserver's preloads already)
    return os.environ.get("OPENBLAS_NUM_THREADS")

if __name__ == "__main__":
    print(sorted({value for _, value in map_local(blas_threads, [0, 1, 2, 3], 2)}))
    print(os.environ.get("OPENBLAS_NUM_THREADS"))  # this process's own: a library user's, untouched
"""


CLI_BLAS_SCRIPT = """
import os, sys
sys.argv = ["shardkit", "--help"]
from shardkit.__main__ import run
try:
    run()
except SystemExit:
    pass
print(os.environ.get("OPENBLAS_NUM_THREADS"))
"""


@pytest.mark.parametrize(("given", "cli", "library"), [(None, "1", "[None]\nNone"), ("3", "3", "['3']\n3")])
def test_the_cli_gets_one_blas_thread_a_library_user_none(tmp_path, given: str | None, cli: str, library: str) -> None:
    """numpy's OpenBLAS started a thread per core in the forkserver, spinning ~0.1 s of CPU that
    two busy workers needed (core/blas.py): the CLI's process, and so its forkserver and workers,
    get one unless the user set a count. A library user's process and workers are left as they
    are: the forkserver is the process's one, shared with the user's own pools."""
    import subprocess
    import sys

    env = {name: value for name, value in os.environ.items() if name != "OPENBLAS_NUM_THREADS"}
    if given is not None:
        env["OPENBLAS_NUM_THREADS"] = given
    outputs = []
    for script in (CLI_BLAS_SCRIPT, BLAS_SCRIPT):
        path = tmp_path / "blas.py"
        path.write_text(script)
        done = subprocess.run([sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip())
    assert outputs[0].splitlines()[-1] == cli  # (after the help text)
    assert outputs[1] == library  # the workers' values, then the process's own


def test_started_is_called_once_the_workers_have_their_first_jobs() -> None:
    """What pack starts then (pyarrow's import, which holds the GIL) must keep out of the walk and
    the pool's start: `started` comes after the first 2 x workers jobs are submitted, before any
    result; in this process (workers=1), before the first job."""
    events: list[str] = []

    def jobs(count: int):
        for number in range(count):
            events.append(f"drawn {number}")
            yield number

    for index, _ in map_local(square, jobs(6), 2, started=lambda: events.append("started")):
        events.append(f"result {index}")
    assert events[:5] == ["drawn 0", "drawn 1", "drawn 2", "drawn 3", "started"]
    assert events.count("started") == 1 and len(events) == 6 + 6 + 1
    events.clear()
    done = list(map_local(square, jobs(3), 1, started=lambda: events.append("started")))
    # (drawn 0 and 1 to see that there is more than one job; the rest as they run)
    assert events == ["drawn 0", "drawn 1", "started", "drawn 2"] and done == [(0, 0), (1, 1), (2, 4)]
    events.clear()  # no jobs (a resume that reuses every shard): called all the same
    assert list(map_local(square, jobs(0), 2, started=lambda: events.append("started"))) == []
    assert events == ["started"]

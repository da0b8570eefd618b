"""Nothing left running: a pack stopped by a signal (or its driver killed outright) takes its
forkserver and worker processes with it, and leaves a state that --resume finishes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler
from pathlib import Path

import pytest

from shardkit.core.manifest import read_manifest
from shardkit.synthetic import write_image
from tests.servers import serving

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def slow_source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 full-size JPEGs (hard links of 16): about two seconds of packing on 2 workers."""
    root = tmp_path_factory.mktemp("slow")
    for i in range(16):
        write_image(root / "c00" / f"{i:03d}.jpg", 1024, 768, seed=i)
    for c in range(1, 15):
        (root / f"c{c:02d}").mkdir()
        for original in (root / "c00").iterdir():
            os.link(original, root / f"c{c:02d}" / original.name)
    return root


def pack_command(python_command, source: Path, out: Path, *extra: str) -> list[str]:
    return [*python_command, "pack", str(source), str(out), "--resize", "none", "--workers", "2",
            "--shard-size", "20", *extra]  # fmt: skip


@pytest.fixture(scope="module")
def clean_run(python_command_module, slow_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "out"
    subprocess.run(pack_command(python_command_module, slow_source, out), check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def python_command_module() -> list[str]:
    import sys

    return [sys.executable, "-m", "shardkit"]


def group_alive(group: int) -> list[int]:
    """Processes of a process group that are still running (zombies excluded)."""
    alive = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == group and fields[0] != "Z":
            alive.append(int(entry))
    return alive


def wait_for_handler(pid: int, signum: int, seconds: float) -> bool:
    """Whether process `pid` catches `signum` (a handler of its own, /proc's SigCgt) within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("SigCgt:") and int(line.split()[1], 16) >> (signum - 1) & 1:
                    return True
        time.sleep(0.002)
    return False


def wait_for_group(group: int, seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while (alive := group_alive(group)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


def start_and_wait_for_a_shard(command: list[str], out: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out.exists() and list(out.glob("shard-*.tar"))):
        time.sleep(0.01)
    assert len(group_alive(process.pid)) >= 4, "expected the driver, a forkserver and two workers"
    return process


def shard_hashes(output: Path) -> dict[str, str]:
    return {shard.name: shard.sha256 for shard in read_manifest(output).shards}


@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("SIGTERM to the driver", 143),  # Kubernetes, docker stop
        ("SIGTERM to the group", 143),  # systemd, SLURM
        ("SIGINT to the group", 130),  # Ctrl-C in a terminal
        ("SIGHUP to the driver", 129),  # the terminal went away
    ],
)
def test_a_signal_stops_the_pack_and_every_worker(
    python_command, slow_source: Path, clean_run: Path, tmp_path: Path, how: str, code: int
) -> None:
    out = tmp_path / "out"
    process = start_and_wait_for_a_shard(pack_command(python_command, slow_source, out), out)
    name, _, target = how.split(" ", 2)
    signum = getattr(signal, name)
    os.killpg(process.pid, signum) if target == "the group" else os.kill(process.pid, signum)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == code, stderr
    assert "Traceback" not in stderr and "--resume" in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert wait_for_group(process.pid, 5) == []
    assert not (out / "manifest.json").exists()
    assert not list((out / ".shardkit" / "tmp").glob("*")), "half-written shards were left behind"
    assert list(out.glob("shard-*.tar")), "no complete shard was kept"
    if how == "SIGTERM to the driver":  # the state every stop leaves is the same: resume it once
        resumed = subprocess.run(
            pack_command(python_command, slow_source, out, "--resume"), capture_output=True, text=True
        )
        assert resumed.returncode == 0, resumed.stderr
        assert shard_hashes(out) == shard_hashes(clean_run)
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean_run.iterdir())


def test_workers_exit_within_seconds_of_a_killed_driver(python_command, slow_source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    process = start_and_wait_for_a_shard(pack_command(python_command, slow_source, out), out)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(10)
    assert wait_for_group(process.pid, 5) == [], "workers outlived their driver"


@pytest.mark.parametrize("command", ["pack", "verify"])
def test_a_stop_while_the_workers_start_exits_with_one_line(
    python_command, slow_source: Path, clean_run: Path, tmp_path: Path, command: str
) -> None:
    """SIGTERM to the whole group while the pool starts (forkserver and workers being started, their
    start data half sent), at a spread of instants: exit 143, one line, nothing left running.
    Before: a worker the pool did not know yet printed its own traceback (SemLock FileNotFoundError,
    EOFError) in about half the runs, and a forkserver killed first made the driver fail with
    EOFError ("Aborted.", exit code 1)."""
    for attempt in range(8):
        if command == "pack":
            argv = pack_command(python_command, slow_source, tmp_path / f"out{attempt}")
        else:
            argv = [*python_command, "verify", str(clean_run), "--deep", "--workers", "2"]
        launched = time.monotonic()
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        # Before Python runs shardkit's first line (20 ms warm) SIGTERM's default action kills it
        # (-15): a start starved for 0.25 s on a loaded machine is not what this test is about.
        assert wait_for_handler(process.pid, signal.SIGTERM, 30), "the command never installed its handlers"
        # 0.25 to 0.46 s from the launch: where the stress script (scripts/stress_signals.py) saw
        # the old failures, on this machine, the CLI loaded and the pool starting.
        time.sleep(max(0.0, launched + 0.25 + 0.03 * attempt - time.monotonic()))
        os.killpg(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 143, (attempt, stderr)
        assert len(stderr.strip().splitlines()) == 1 and "stopped by SIGTERM" in stderr, (attempt, stderr)
        assert wait_for_group(process.pid, 5) == []


def test_a_killed_pack_leaves_nothing_outside_its_output(python_command, slow_source: Path, tmp_path: Path) -> None:
    """kill -9 of the driver: multiprocessing's folder for the forkserver's socket (TMPDIR/pymp-*)
    went with it; before, every killed run left one behind."""
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="tmp", dir="/tmp"))  # short: see the next test
    out = tmp_path / "out"
    command = pack_command(python_command, slow_source, out)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
        env={**os.environ, "TMPDIR": str(temp)},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(out.glob("shard-*.tar")) and process.poll() is None:
        time.sleep(0.01)
    assert process.poll() is None, process.communicate()[1]
    assert list(temp.glob("pymp-*")), "expected the forkserver's folder while the pack runs"
    os.kill(process.pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert wait_for_group(process.pid, 10) == []
    assert list(temp.iterdir()) == []
    temp.rmdir()


def test_a_pack_under_a_long_tmpdir_starts_its_workers(python_command, tmp_path: Path) -> None:
    """The forkserver's socket lives under TMPDIR, and a Unix socket path holds 107 bytes: under a
    long TMPDIR (a SLURM job's scratch folder) pack failed with "AF_UNIX path too long"."""
    from shardkit.synthetic import write_image

    temp = tmp_path / ("scratch-" + "x" * 80)
    temp.mkdir()
    for i in range(8):
        write_image(tmp_path / "src" / f"{i}.jpg", 64, 48, seed=i)
    command = [*python_command, "pack", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2",
               "--shard-size", "2"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "TMPDIR": str(temp)})
    assert done.returncode == 0, done.stderr
    assert list(temp.iterdir()) == []


def typer_that_signals(tmp_path: Path, kill: str) -> dict[str, str]:
    """An environment whose `import typer` runs `kill` (a statement using os), then sleeps: a stop
    timed to the CLI's first import, after `__main__` installed its early handlers."""
    stand_in = tmp_path / "path"
    stand_in.mkdir()
    (stand_in / "typer.py").write_text(f"import os, time\n{kill}\ntime.sleep(30)\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(stand_in), os.environ.get("PYTHONPATH", "")])}


def test_a_stop_while_the_command_loads_exits_with_its_code(python_command, tmp_path: Path) -> None:
    """A stop signal in the 0.3 s the CLI takes to import (typer, rich) ended the process by the
    default action (-15, no line). Timed here with a stand-in for typer on PYTHONPATH that sends
    the signal as it is imported."""
    env = typer_that_signals(tmp_path, f"os.kill(os.getpid(), {int(signal.SIGTERM)})")
    done = subprocess.run(
        [*python_command, "probe", str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    )
    assert (done.returncode, done.stderr) == (143, "stopped by SIGTERM\n")


@pytest.mark.parametrize(("signum", "group"), [(signal.SIGTERM, True), (signal.SIGHUP, False), (signal.SIGINT, True)])
def test_a_stop_while_a_pack_loads_leaves_no_forkserver_folder(
    python_command, tmp_path: Path, signum: int, group: bool
) -> None:
    """A pack starts its forkserver before the CLI's imports, and a stop in that window exits with no
    exit handler: multiprocessing's folder for the forkserver's socket (TMPDIR/pymp-*) stayed
    behind when the same SIGTERM ended the forkserver too, or when the forkserver had not yet
    imported its own exit handler (2 runs in 60 of scripts/stress_signals.py). Timed with a
    stand-in for typer that sends the signal as it is imported, as above."""
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="tmp", dir="/tmp"))  # short: the socket's path has a limit
    kill = f"os.killpg(0, {int(signum)})" if group else f"os.kill(os.getpid(), {int(signum)})"
    env = {**typer_that_signals(tmp_path, kill), "TMPDIR": str(temp)}
    for i in range(4):
        write_image(tmp_path / "src" / f"{i}.jpg", 64, 48, seed=i)
    process = subprocess.Popen(
        [*python_command, "pack", str(tmp_path / "src"), str(tmp_path / "out"), "--workers", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env,
    )  # fmt: skip
    _, stderr = process.communicate(timeout=60)
    said = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
    assert (process.returncode, stderr) == (128 + signum, said + "\n")
    assert wait_for_group(process.pid, 10) == []
    assert list(temp.iterdir()) == []
    temp.rmdir()


def test_a_stop_inside_the_import_of_the_process_machinery_exits_cleanly() -> None:
    """The early handler looks for the forkserver's folder through runtime.processes; a signal inside
    that module's import found it half made (an AttributeError traceback, exit 1: stress_signals)."""
    code = (
        "import sys, types; "
        "sys.modules['shardkit.runtime.processes'] = types.ModuleType('shardkit.runtime.processes'); "
        "from shardkit.__main__ import _remove_forkserver_folder; _remove_forkserver_folder(); print('ok')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "ok\n"), done.stderr


def test_a_forkserver_whose_driver_is_gone_removes_its_folder(tmp_path: Path) -> None:
    """The forkserver's exit handler is registered by its first preload import; a driver gone
    before that import (a stop in its first 0.1 s) left the folder to nobody. A live driver's
    folder is never touched: a pytest worker that imported the preloads itself (a test does)
    once removed its own forkserver's socket that way, and its next pool could not start."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that was a process and is no more

    def imported_with(driver: int, folder: Path) -> None:
        env = {**os.environ, "SHARDKIT_FORKSERVER_TEMP": f"{driver}:{folder}"}  # a driver that is not the parent
        code = "import shardkit.runtime.forkserver_exit"
        subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)

    for name, driver, kept in (("pymp-gone", gone.pid, False), ("pymp-alive", os.getpid(), True),
                               ("not-multiprocessings", gone.pid, True)):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "listener").write_text("")
        imported_with(driver, folder)
        assert folder.exists() == kept, name


@contextlib.contextmanager
def shards_held_back(folder: Path) -> Iterator[tuple[str, threading.Event]]:
    """An HTTP server on loopback serving `folder` that holds every shard's download until the
    test is done: a verify of it is surely checking (its workers waiting on a shard) when the
    signal comes, however loaded the machine. Yields the URL and an event set once a shard is asked for."""
    asked, release = threading.Event(), threading.Event()

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def do_GET(self) -> None:
            if self.path.endswith(".tar"):
                asked.set()
                release.wait(60)
            with contextlib.suppress(OSError):  # the client was killed meanwhile
                super().do_GET()

        def log_message(self, *args) -> None:
            pass

    with serving(Handler) as url:
        try:
            yield url, asked
        finally:
            release.set()  # (before the shutdown: a handler held back would keep it waiting)


def test_verify_stops_its_checkers_on_sigterm(python_command, clean_run: Path) -> None:
    with shards_held_back(clean_run) as (url, asked):
        process = subprocess.Popen(
            [*python_command, "verify", url, "--deep", "--workers", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert asked.wait(60), "verify never asked for a shard"
        assert len(group_alive(process.pid)) >= 4, "expected the driver, a forkserver and the checkers"
        os.kill(process.pid, signal.SIGTERM)
        _, stderr = process.communicate(timeout=30)
    assert process.returncode == 143, stderr
    assert "Traceback" not in stderr and stderr.strip() == "stopped by SIGTERM", stderr
    assert wait_for_group(process.pid, 5) == []


@pytest.mark.parametrize("how", ["done", "failed", "stopped"])
def test_a_signal_after_the_work_exits_with_its_code(how: str) -> None:
    """A stop signal can land after the command's work, while it prints its report or exits: it
    still ends the process with 128 + the signal (click would have called it "Aborted!", exit 1)."""
    work = {"done": "pass", "failed": "raise ShardkitError('bad')", "stopped": "os.kill(os.getpid(), signal.SIGINT)"}
    script = (
        "import os, signal, time, typer\n"
        "from shardkit.cli.common import user_errors\n"
        "from shardkit.core.errors import ShardkitError\n"
        "def main():\n"
        "    try:\n"
        "        with user_errors():\n"
        f"            {work[how]}\n"
        "    finally:\n"
        "        print('report', flush=True)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        time.sleep(10)\n"
        "typer.run(main)\n"
    )
    import sys

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 143, result.stderr
    assert "Aborted" not in result.stderr and "Traceback" not in result.stderr
    assert result.stdout == "report\n" and "stopped" in result.stderr and "SIGTERM" in result.stderr


SWALLOWED = """
import os, signal, weakref, typer
from shardkit.cli.common import user_errors
def main():
    with user_errors():
        class Thing:
            pass
        thing = Thing()
        def callback(_):  # the signal's handler runs in here, where an exception cannot get out
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100000):
                pass
        reference = weakref.ref(thing, callback)
        del thing
        print("carried on", flush=True)
typer.run(main)
"""


REPLACED = """
import os, signal, time, typer
from shardkit.cli.common import user_errors
def main():
    with user_errors():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        except KeyboardInterrupt:  # what a library's wait may do with our Stopped
            raise KeyboardInterrupt from None
typer.run(main)
"""


def test_a_stop_a_library_turned_into_keyboardinterrupt_keeps_its_signal() -> None:
    done = subprocess.run([sys.executable, "-c", REPLACED], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (143, "stopped by SIGTERM\n")


def test_a_stop_swallowed_by_a_weakref_callback_still_stops() -> None:
    """The handler raises Stopped wherever the main thread is; inside a weakref callback Python
    swallows it ("Exception ignored") and the work went on to exit 0 (1 of 200 random stops)."""
    done = subprocess.run([sys.executable, "-c", SWALLOWED], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (143, "carried on\n", "stopped by SIGTERM\n")


LATE_SIGNAL = """
import atexit, os, signal, sys
def last():  # registered first, so it runs last of the exit handlers: as late as Python code can
    print(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
atexit.register(last)
from shardkit.cli.common import user_errors
with user_errors():
    pass
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 1])
def test_a_stop_signal_while_python_finalizes_leaves_the_exit_code(code: int) -> None:
    """Finalization gives every signal with a Python handler its default action back, so a stop
    signal then killed the process (-15) whatever it had decided: from the exit handlers on, stop
    signals are ignored."""
    done = subprocess.run([sys.executable, "-c", LATE_SIGNAL, str(code)], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout, done.stderr) == (code, "True\n", "")


@pytest.mark.parametrize("second", ["SIGINT", "SIGTERM"])
def test_a_second_stop_signal_exits_at_once(python_command, slow_source: Path, clean_run: Path, tmp_path, second):
    """Ctrl-C pressed twice (or a SIGTERM after it): never a hang or a traceback; the second one
    exits at once, the workers follow, and --resume finishes the pack. Nothing is left in TMPDIR:
    the second stop's os._exit skipped the handler that removes the forkserver's folder, and a
    SIGTERM to the group ended the forkserver before its own did (a /tmp/pymp-* each time)."""
    import tempfile

    temp = Path(tempfile.mkdtemp(prefix="tmp", dir="/tmp"))  # short: the socket's path has a limit
    for attempt in range(4):  # the second signal lands at a different point of the clean-up each time
        out = tmp_path / f"out{attempt}"
        env = {**os.environ, "TMPDIR": str(temp)}
        process = start_and_wait_for_a_shard(pack_command(python_command, slow_source, out), out, env)
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.002 * attempt)
        os.killpg(process.pid, getattr(signal, second))
        _, stderr = process.communicate(timeout=30)
        assert process.returncode in (130, 128 + getattr(signal, second)), stderr
        assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
        assert wait_for_group(process.pid, 5) == []
        assert list(temp.iterdir()) == [], (attempt, stderr)
    temp.rmdir()
    resumed = subprocess.run(pack_command(python_command, slow_source, out, "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert shard_hashes(out) == shard_hashes(clean_run)


def test_a_table_pack_killed_outright_resumes_to_the_same_bytes(
    python_command, slow_source: Path, tmp_path: Path
) -> None:
    """kill -9 in the middle of a pack of a metadata table (captions, a label column): --resume
    ends with the shards and index of an uninterrupted run."""
    import json
    import shutil

    source = tmp_path / "src"
    shutil.copytree(slow_source, source, copy_function=os.link)
    names = sorted(path.relative_to(source).as_posix() for path in source.rglob("*.jpg"))
    rows = [{"file_name": name, "caption": f"caption {i} ✓", "label": name[:3], "n": i} for i, name in enumerate(names)]
    (source / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    clean = tmp_path / "clean"
    subprocess.run(
        pack_command(python_command, source, clean, "--label-column", "label"), check=True, capture_output=True
    )
    out = tmp_path / "out"
    process = start_and_wait_for_a_shard(pack_command(python_command, source, out, "--label-column", "label"), out)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)
    assert not (out / "manifest.json").exists()
    resumed = subprocess.run(
        pack_command(python_command, source, out, "--label-column", "label", "--resume"), capture_output=True, text=True
    )
    assert resumed.returncode == 0, resumed.stderr
    assert shard_hashes(out) == shard_hashes(clean)
    assert read_manifest(out).index.sha256 == read_manifest(clean).index.sha256


def test_the_forkserver_starts_first_only_for_a_pack_that_may_start_workers() -> None:
    from shardkit.__main__ import _starts_workers

    assert _starts_workers(["pack", "SRC", "OUT"]) and _starts_workers(["pack", "SRC", "OUT", "--workers", "2"])
    for words in (
        ["pack", "SRC", "OUT", "--workers", "1"], ["pack", "SRC", "OUT", "--workers=1"],
        ["pack", "SRC", "OUT", "--executor", "ray"], ["pack", "SRC", "OUT", "--executor=ray"],
        ["pack", "--help"], ["probe", "SRC"], ["verify", "OUT"], [],
    ):  # fmt: skip
        assert not _starts_workers(words), words


NESTED_PACK = """
import multiprocessing, os, sys, time
from pathlib import Path

def gone(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True

def packs(src, out, answer):
    import multiprocessing.forkserver
    from shardkit.core.pack_options import pack_config
    from shardkit.packing.pack import pack
    pack(pack_config(src, out, workers=2, shard_size=4))
    answer.send((multiprocessing.forkserver._forkserver._forkserver_pid, multiprocessing.util.get_temp_dir()))

if __name__ == "__main__":
    context = multiprocessing.get_context("forkserver")
    first = context.Process(target=os.getpid)  # the parent's own forkserver, socket and temp folder
    first.start(); first.join()
    folder = multiprocessing.util.get_temp_dir()
    mine, theirs = context.Pipe()
    child = context.Process(target=packs, args=(*sys.argv[1:3], theirs))  # (made after: carries the folder)
    child.start(); child.join()
    assert child.exitcode == 0, child.exitcode
    server, child_folder = mine.recv()
    deadline = time.monotonic() + 30
    while not gone(server) and time.monotonic() < deadline:  # the child's forkserver ends after it
        time.sleep(0.01)
    assert gone(server), "the child's forkserver never ended"
    assert os.path.isdir(folder), "the child's pack removed its parent's temp folder"
    assert child_folder != folder and not os.path.exists(child_folder), (child_folder, folder)
    again = context.Process(target=os.getpid)  # the parent's forkserver still takes requests
    again.start(); again.join()
    assert again.exitcode == 0
    print("ok")
"""


def test_a_pack_in_a_multiprocessing_child_leaves_its_parent_s_temp_folder(tmp_path: Path) -> None:
    """A multiprocessing child carries its parent's temp folder (the one with the parent's forkserver
    socket), and pack's forkserver in such a child (a user's own worker running pack) removed that
    folder once the child ended: the parent could start no process again, and its exit printed a
    FileNotFoundError traceback (found by scripts/fuzz_shards.py, whose workers run verify)."""
    for i in range(8):
        write_image(tmp_path / "src" / f"{i}.jpg", 64, 48, seed=i)
    script = tmp_path / "nested.py"
    script.write_text(NESTED_PACK)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "src"), str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120, start_new_session=True,
    )  # fmt: skip
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")
    assert len(read_manifest(tmp_path / "out").shards) == 2


UNGUARDED = """
import sys
import shardkit
from shardkit.core.pack_options import pack_config

try:  # at the top level, with no `if __name__ == "__main__":`
    if sys.argv[1] == "pack":
        shardkit.pack(pack_config(sys.argv[2], sys.argv[3], workers=2, shard_size=4))
    else:
        print(shardkit.verify(sys.argv[2], workers=2))
except shardkit.ShardkitError as error:
    print(f"{type(error).__name__}: {error}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.parametrize("call", ["pack", "verify"])
def test_a_script_calling_shardkit_unguarded_is_told_what_to_change(tmp_path: Path, call: str) -> None:
    """Each worker process imports the main script again: an unguarded pack() at its top level ran
    again in every worker, met the driver's output lock, and the driver said "a worker process died
    ... run out of memory" under a traceback per worker; verify() called a whole shard "crashed"."""
    for i in range(8):
        write_image(tmp_path / "src" / f"{i}.jpg", 64, 48, seed=i)
    out = tmp_path / "out"
    if call == "verify":
        subprocess.run([sys.executable, "-m", "shardkit", "pack", str(tmp_path / "src"), str(out), "--shard-size", "4"],
                       check=True, capture_output=True)  # fmt: skip
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    arguments = [str(tmp_path / "src"), str(out)] if call == "pack" else [str(out)]
    done = subprocess.run([sys.executable, str(script), call, *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", (done.stdout, done.stderr)
    assert done.stderr == (
        f"ConfigError: each worker process imports {script} again (Python's multiprocessing does), and its "
        'top-level code called shardkit again there: put that call under `if __name__ == "__main__":`\n'
    )


def test_a_task_error_nobody_retrieved_prints_no_traceback(tmp_path: Path) -> None:
    """What fsspec's S3 client leaves when a store dies mid-request: an asyncio task whose exception
    nobody retrieves. In a command's process and in a worker it prints nothing (the failure is said
    in one line elsewhere); a program that sets up logging still gets the record."""
    script = tmp_path / "leftover.py"
    script.write_text(
        "import asyncio, gc, logging, sys\n"
        "from shardkit.runtime.processes import quiet_unretrieved_task_errors\n"
        "if sys.argv[1] == 'logged':\n"
        "    logging.basicConfig(level=logging.ERROR, format='logged: %(message)s')\n"
        "else:\n"
        "    quiet_unretrieved_task_errors()\n"
        "async def fail():\n"
        "    raise ConnectionResetError('Cannot write to closing transport')\n"
        "async def main():\n"
        "    asyncio.ensure_future(fail())\n"
        "    await asyncio.sleep(0.05)\n"
        "asyncio.run(main())\n"
        "gc.collect()\n"
    )
    import subprocess

    quiet = subprocess.run([sys.executable, str(script), "quiet"], capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    logged = subprocess.run([sys.executable, str(script), "logged"], capture_output=True, text=True, timeout=60)
    assert "logged: Task exception was never retrieved" in logged.stderr

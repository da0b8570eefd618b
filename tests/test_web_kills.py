"""A pack of a table of URLs on lanes (several shards a worker at once, runtime/lanes.py) attacked
while it runs: kill -9 of its whole process group just after one of its steps (tests/step_kills.py),
SIGINT and SIGTERM to the group while rows wait out a Retry-After, SIGKILL to one worker. Each time
a --resume, with the server then answering every row that failed transiently, gives the clean
pack's bytes.

The faults are the server's and deterministic per row, so that every run ends alike: while it is
`faulty`, rows 1, 9 and 18 (shards 0, 2, 4) answer 429 with a Retry-After on their first request of
a run and 200 after, row 22 (shard 5) answers 503 always (transient after its one retry), and row
13 (shard 3) answers 404 in every run (a failure for good). The clean pack is a pack against the
faulty server and then a --resume against the healthy one: the --resume downloads row 22 again and
writes shard 5 anew from its earlier records."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from PIL import Image

from tests.inprocess import Cli
from tests.servers import serving
from tests.step_kills import hooked_env
from tests.test_processes import group_alive, wait_for_group

pytestmark = pytest.mark.slow  # kills and stops packs

ROWS = 30
SLOWED = (1, 9, 18)  # 429 with a Retry-After on a run's first request (faulty)
REFUSED = 22  # 503 always (faulty): transient
MISSING = 13  # 404 always: failed for good
FLAGS = ("--shard-size", "4", "--workers", "2", "--retries", "1", "--backoff", "0.05", "--timeout", "5")


def _jpeg(row: int) -> bytes:
    rng = random.Random(row)
    image = Image.new("RGB", (40 + row % 9, 32 + row % 5), tuple(rng.randrange(256) for _ in range(3)))
    out = io.BytesIO()
    image.save(out, "JPEG", quality=90)
    return out.getvalue()


@dataclass
class Web:
    """The server's behaviour for the next run (`begin`) and what it saw of the current one."""

    faulty: bool = True
    retry_after: int = 1
    asked: set[int] = field(default_factory=set)  # rows asked for in this run
    slowed: threading.Event = field(default_factory=threading.Event)  # every SLOWED row answered 429
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, faulty: bool, retry_after: int = 1) -> None:
        with self.lock:
            self.faulty, self.retry_after = faulty, retry_after
            self.asked = set()
            self.slowed = threading.Event()

    def answer(self, row: int) -> tuple[int, bytes, dict[str, str]]:
        with self.lock:
            first = row not in self.asked
            self.asked.add(row)
            if self.faulty and row in SLOWED and first and all(r in self.asked for r in SLOWED):
                self.slowed.set()  # (set before the last 429 goes out: that row waits from now)
        if row == MISSING:
            return 404, b"no such image", {}
        if self.faulty and row == REFUSED:
            return 503, b"busy", {}
        if self.faulty and row in SLOWED and first:
            return 429, b"slow down", {"Retry-After": str(self.retry_after)}
        return 200, _jpeg(row), {}


@pytest.fixture(scope="module")
def web() -> Iterator[tuple[Web, str]]:
    state = Web()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            status, body, headers = state.answer(int(self.path.rsplit("/", 1)[1].split(".")[0]))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as base:
        yield state, base


@pytest.fixture(scope="module")
def table(web: tuple[Web, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("table") / "urls.csv"
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["url", "caption"])
        writer.writerows([f"{web[1]}/img/{row}.jpg", f"row {row}"] for row in range(ROWS))
    return path


@pytest.fixture(scope="module")
def short_tmp() -> Iterator[Path]:
    """TMPDIR for the packs run here: a kill of the whole group takes the forkserver too, which
    then leaves its socket's folder (pymp-*) behind; here, not in /tmp."""
    folder = Path(tempfile.mkdtemp(prefix="webkills", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def hashes(folder: Path) -> dict[str, str | None]:
    """Every path under `folder` (hidden ones too) with its bytes' sha256 (None for folders)."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
    }


def differences(found: dict[str, str | None], expected: dict[str, str | None]) -> list[str]:
    return sorted(set(found) ^ set(expected)) + sorted(
        name for name in set(found) & set(expected) if found[name] != expected[name]
    )


def pack_command(table: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "shardkit", "pack", str(table), str(out), *FLAGS, *extra]


def run_pack(
    table: Path, out: Path, temp: Path, *extra: str, hook: Path | None = None, **variables: str
) -> subprocess.CompletedProcess[str]:
    """The pack as a subprocess in a session of its own; with `hook`, under tests/step_kills.py."""
    env = {**os.environ, **(hooked_env(hook, [out], **variables) if hook else {}), "TMPDIR": str(temp)}
    return subprocess.run(
        pack_command(table, out, *extra), capture_output=True, text=True, env=env, start_new_session=True,
        timeout=120, cwd=out.parent,
    )  # fmt: skip


def resume(shardkit: Cli, web: Web, table: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """A --resume against the healthy server, in the test's process (its forkserver started once)."""
    web.begin(faulty=False)
    return shardkit("pack", table, out, *FLAGS, "--resume")


def errors_of(out: Path) -> dict[str, bool]:
    """errors.jsonl's rows: key -> transient."""
    lines = (out / "errors.jsonl").read_text().splitlines()
    return {row["key"]: bool(row.get("transient")) for row in map(json.loads, lines)}


@dataclass(frozen=True)
class Clean:
    hashes: dict[str, str | None]
    steps: list[str]  # the steps of the faulty pack, as the hook logged them


@pytest.fixture(scope="module")
def clean(web: tuple[Web, str], table: Path, short_tmp: Path, tmp_path_factory: pytest.TempPathFactory) -> Clean:
    """The clean pack (faulty, then --resume healthy), its first run's steps logged. (A kill before
    shard 5 is done makes the --resume write it fresh: its bytes then match the rewritten one's.)"""
    state, _ = web
    root = tmp_path_factory.mktemp("clean")
    out, log = root / "out", root / "steps.log"
    state.begin(faulty=True)
    first = run_pack(table, out, short_tmp, hook=root / "hook", log=str(log))
    assert first.returncode == 0, first.stderr
    assert errors_of(out) == {f"{MISSING:09d}": False, f"{REFUSED:09d}": True}
    assert (out / ".shardkit" / "state.json").exists()  # kept for the --resume
    state.begin(faulty=False)
    again = run_pack(table, out, short_tmp, "--resume")
    assert again.returncode == 0, again.stderr
    assert errors_of(out) == {f"{MISSING:09d}": False}
    return Clean(hashes(out), [line.split(" ", 1)[1] for line in log.read_text().splitlines()])


# The steps a kill follows (just after), in the order a pack takes them; "resume": a step of the
# --resume of a faulty pack that ran to its end, the pack itself not killed.
STEPS = [
    ("pack", "create out/.shardkit/tmp/shard-000005.tar.PID.tmp"),  # lanes running: a shard begun
    ("pack", "replace out/.shardkit/done/shard-000005.tar.json"),  # a worker's done marker, its shard not in place
    ("pack", "create out/.shardkit/errors/shard-000005.tar.jsonl"),  # in place; the driver's error part made, empty
    ("pack", "replace out/shard-000000.tar"),  # a shard whose row waited out a Retry-After, in place
    ("pack", "replace out/manifest.json"),  # finished, a row transient: its state kept
    ("resume", "replace out/shard-000005.tar"),  # the shard written again, its row downloaded, in place
]


@pytest.mark.parametrize(("phase", "step"), STEPS, ids=[f"{phase}: {step}" for phase, step in STEPS])
def test_a_pack_killed_at_a_step_resumes_to_the_clean_pack(
    shardkit: Cli,
    web: tuple[Web, str],
    table: Path,
    clean: Clean,
    short_tmp: Path,
    tmp_path: Path,
    phase: str,
    step: str,
) -> None:
    state, _ = web
    out, hook = tmp_path / "out", tmp_path / "hook"
    if phase == "pack":
        assert step in clean.steps, f"the pack took no step {step!r}: {clean.steps}"
    else:
        state.begin(faulty=True)
        assert run_pack(table, out, short_tmp).returncode == 0
    state.begin(faulty=phase == "pack")
    killed = run_pack(table, out, short_tmp, *(["--resume"] if phase == "resume" else []), hook=hook, at=step)
    assert killed.returncode == -signal.SIGKILL, f"not killed at {step} ({killed.returncode}): {killed.stderr}"
    resumed = resume(shardkit, state, table, out)
    assert resumed.returncode == 0, resumed.stderr
    assert hashes(out) == clean.hashes, differences(hashes(out), clean.hashes)


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def workers_of(driver: int) -> list[int]:
    """The pack's worker processes: those of its group that are not the driver's own children (the
    forkserver, the resource tracker) but the forkserver's."""
    found = []
    for pid in group_alive(driver):
        try:
            if pid != driver and parent_of(pid) != driver:
                found.append(pid)
        except OSError:  # (gone meanwhile)
            continue
    return found


def started_waiting(web: Web, table: Path, out: Path, temp: Path) -> subprocess.Popen[str]:
    """A pack against the faulty server, once its lanes run with the SLOWED rows waiting out a
    30 s Retry-After and a shard of another row is in place."""
    web.begin(faulty=True, retry_after=30)
    process = subprocess.Popen(
        pack_command(table, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, "TMPDIR": str(temp)}, cwd=out.parent,
    )  # fmt: skip
    try:
        assert web.slowed.wait(60), "the rows that answer 429 were never asked for"
        deadline = time.monotonic() + 30
        while not list(out.glob("shard-*.tar")) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert list(out.glob("shard-*.tar")), "no shard of the rows that need no wait was written"
        assert process.poll() is None, process.communicate()
        assert len(workers_of(process.pid)) == 2, "expected two workers running"
    except BaseException:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise
    return process


@pytest.mark.parametrize(
    ("signum", "code"), [pytest.param(signal.SIGINT, 130, id="SIGINT"), pytest.param(signal.SIGTERM, 143, id="SIGTERM")]
)
def test_a_stop_while_rows_wait_out_a_retry_after_ends_every_process_and_resumes(
    shardkit: Cli,
    web: tuple[Web, str],
    table: Path,
    clean: Clean,
    short_tmp: Path,
    tmp_path: Path,
    signum: int,
    code: int,
) -> None:
    """A stop to the whole group (Ctrl-C, systemd, SLURM) while lanes run shards whose rows wait
    out a Retry-After: the pack ends within seconds, not when the wait is over, with one line."""
    state, _ = web
    out = tmp_path / "out"
    process = started_waiting(state, table, out, short_tmp)
    os.killpg(process.pid, signum)
    stopped = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    took = time.monotonic() - stopped
    assert process.returncode == code, stderr
    assert took < 5, f"the pack took {took:.1f} s to stop"
    assert len(stderr.strip().splitlines()) == 1 and "Traceback" not in stderr and "--resume" in stderr, stderr
    assert wait_for_group(process.pid, 5) == []
    assert not (out / "manifest.json").exists()
    resumed = resume(shardkit, state, table, out)
    assert resumed.returncode == 0, resumed.stderr
    assert hashes(out) == clean.hashes, differences(hashes(out), clean.hashes)


def test_a_worker_killed_while_rows_wait_fails_the_pack_in_one_line_and_resumes(
    shardkit: Cli, web: tuple[Web, str], table: Path, clean: Clean, short_tmp: Path, tmp_path: Path
) -> None:
    """kill -9 of one worker (the kernel's OOM killer) while its lanes run: the driver says a
    worker died, in one line, and leaves no process behind; a --resume finishes the pack."""
    state, _ = web
    out = tmp_path / "out"
    process = started_waiting(state, table, out, short_tmp)
    os.kill(workers_of(process.pid)[0], signal.SIGKILL)
    killed = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    took = time.monotonic() - killed
    assert process.returncode == 1, stderr
    assert took < 5, f"the pack took {took:.1f} s to fail"
    assert len(stderr.strip().splitlines()) == 1 and "worker" in stderr and "died" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert wait_for_group(process.pid, 5) == []
    resumed = resume(shardkit, state, table, out)
    assert resumed.returncode == 0, resumed.stderr
    assert hashes(out) == clean.hashes, differences(hashes(out), clean.hashes)

"""kill -9 of a pack at each of its steps, then --resume: the output is a clean pack's, byte for
byte, its hidden files and folders included. Each kill is the step's own (tests/step_kills.py: the
pack's whole process group gets SIGKILL just after the step), while a process spins beside it.

The source packs into three shards of 32 on two workers: shard 0 is written whole by a worker,
shards 1 and 2 (the last) are encoded in parts on the workers and joined by the driver."""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit.synthetic import write_image
from tests.step_kills import hooked_env, unfinished_said
from tests.warm_starts import WarmStarter

FLAGS = ("--shard-size", "32", "--resize", "32", "--workers", "2")

# The steps a kill follows, in the order a pack takes them (the first logged step each pattern
# matches; `only`: a step of that format alone). {ext}: the format's shard suffix.
STEPS: list[tuple[str, str | None]] = [
    (r"scandir src/c0", None),  # the walk, half way
    (r"replace out/\.shardkit/state\.json", None),  # walked; no shard begun
    (r"replace out/\.shardkit/index/shard-000000\{ext}\.jsonl", None),  # a worker's shard: its index part
    (r"replace out/\.shardkit/done/shard-000000\{ext}\.json", None),  # its done marker, the shard not in place
    (r"replace out/shard-000000\.idx", "webdataset"),  # its DALI index in place, the shard not
    (r"replace out/shard-000000\{ext}", None),  # in place
    (r"create out/\.shardkit/tmp/shard-000001\.tar\.part1\.PID\.tmp", "webdataset"),  # a part begun by its worker
    (r"replace out/shard-000001\{ext}", None),  # a shard joined from its parts, in place
    (r"unlink out/\.shardkit/tmp/shard-000002\.tar\.part0\.PID\.tmp", "webdataset"),  # the last's parts appended
    (r"replace out/\.shardkit/done/shard-000002\{ext}\.json", None),
    (r"replace out/shard-000002\{ext}", None),  # every shard in place
    (r"replace out/index\.parquet", None),  # the finish begun
    (r"replace out/manifest\.json", None),  # finished; the cleanup not begun
    (r"unlink out/\.shardkit/state\.json", None),  # the cleanup
    (r"unlink out/\.shardkit/done/shard-00000\d\{ext}\.json", None),
    (r"rmdir out/\.shardkit/tmp", None),  # all but the working folder itself gone (the lock too)
]
SUFFIX = {"lmdb": ".lmdb", "webdataset": ".tar"}


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (hidden ones too) with its bytes (None for folders)."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


def differences(found: dict[str, bytes | None], expected: dict[str, bytes | None]) -> list[str]:
    return sorted(set(found) ^ set(expected)) + sorted(
        name for name in set(found) & set(expected) if found[name] != expected[name]
    )


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("kills") / "src"
    for number in range(96):
        write_image(root / f"c{number % 2}" / f"{40 + number % 7}x{30 + number % 5}_{number:02d}.jpg",
                    40 + number % 7, 30 + number % 5, seed=number)  # fmt: skip
    return root


@pytest.fixture
def busy() -> Iterator[None]:
    """A process spinning on a core for the whole test: the pack's processes wait for CPU."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """TMPDIR for the killed packs: a kill of the whole group takes the forkserver too, which then
    leaves its socket's folder (pymp-*) behind; here, not in /tmp."""
    folder = Path(tempfile.mkdtemp(prefix="kills", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def killed_pack(
    warm: WarmStarter, source: Path, out: Path, hook: Path, temp: Path, format: str, *extra: str, **variables: str
) -> subprocess.CompletedProcess[str]:
    """`shardkit pack` of `source` into `out` under the hook, a process group of its own (started
    warm: tests/warm_starts.py)."""
    env = {**hooked_env(hook, [out, source], **variables), "TMPDIR": str(temp)}
    return warm.run(["pack", str(source), str(out), "--format", format, *FLAGS, *extra], env, cwd=out.parent)


def steps_of(log: Path, format: str) -> list[str]:
    """The steps STEPS names, as this pack's log names them."""
    logged = [line.split(" ", 1)[1] for line in log.read_text().splitlines()]
    chosen = []
    for pattern, only in STEPS:
        if only not in (None, format):
            continue
        wanted = re.compile(pattern.replace(r"\{ext}", re.escape(SUFFIX[format])) + "$")
        found = next((step for step in logged if wanted.match(step)), None)
        assert found is not None, f"the pack took no step {pattern!r}: {logged}"
        chosen.append(found)
    return chosen


@pytest.mark.slow  # kills a process at each step
@pytest.mark.parametrize("format", ["lmdb", "webdataset"])
def test_a_pack_killed_at_any_step_resumes_to_the_clean_pack(
    shardkit, source: Path, tmp_path: Path, busy: None, short_tmp: Path, format: str, warm: WarmStarter
) -> None:
    clean, out, log, hook = tmp_path / "clean", source.parent / "out", tmp_path / "steps.log", tmp_path / "hook"
    shutil.rmtree(out, ignore_errors=True)
    assert shardkit("pack", source, clean, "--format", format, *FLAGS).returncode == 0
    expected = snapshot(clean)
    logged = killed_pack(warm, source, out, hook, short_tmp, format, log=str(log))
    assert logged.returncode == 0, logged.stderr
    assert snapshot(out) == expected  # (the hook itself changes nothing)
    failed = []
    for step in steps_of(log, format):
        shutil.rmtree(out)
        killed = killed_pack(warm, source, out, hook, short_tmp, format, at=step)
        assert killed.returncode == -signal.SIGKILL, f"{step}: not killed there ({killed.returncode}) {killed.stderr}"
        if wrong := unfinished_said(out):
            failed.append(f"{step}: the killed output: {wrong}")
        resumed = shardkit("pack", source, out, "--format", format, *FLAGS, "--resume")
        if resumed.returncode != 0:
            failed.append(f"{step}: --resume failed: {resumed.stderr.strip()}")
        elif snapshot(out) != expected:
            failed.append(f"{step}: differs from the clean pack in {differences(snapshot(out), expected)}")
    shutil.rmtree(out)
    assert not failed, "\n".join(failed)


@pytest.mark.slow  # kills a process
def test_a_resume_of_a_pack_killed_in_its_cleanup_leaves_what_a_clean_pack_does(
    shardkit, source: Path, tmp_path: Path, short_tmp: Path, warm: WarmStarter
) -> None:
    """Killed once its state file is gone: the working folder's rest (the lock, done markers) is
    removed by the --resume that finds the pack finished, as the pack itself would have."""
    clean, out, hook = tmp_path / "clean", source.parent / "out", tmp_path / "hook"
    shutil.rmtree(out, ignore_errors=True)
    assert shardkit("pack", source, clean, "--format", "lmdb", *FLAGS).returncode == 0
    killed = killed_pack(warm, source, out, hook, short_tmp, "lmdb", at="unlink out/.shardkit/state.json")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "manifest.json").exists() and (out / ".shardkit" / "lock").exists()
    for _ in range(2):  # and again: nothing is left for a second one either
        resumed = shardkit("pack", source, out, "--format", "lmdb", *FLAGS, "--resume")
        assert resumed.returncode == 0 and "already complete" in resumed.stdout, resumed.stderr
        assert snapshot(out) == snapshot(clean)
    shutil.rmtree(out)


@pytest.mark.slow  # kills a process twice
def test_a_cleanup_killed_then_a_resume_killed_still_resumes(
    shardkit, source: Path, tmp_path: Path, short_tmp: Path, warm: WarmStarter
) -> None:
    """The pack killed as its cleanup removes the done markers, then the --resume killed once it has
    taken the manifest away (where it would): no shard of the folder is left unrecorded, so the
    next --resume finishes it rather than refuse a shard "shardkit did not write"."""
    clean, out, hook = tmp_path / "clean", source.parent / "out", tmp_path / "hook"
    shutil.rmtree(out, ignore_errors=True)
    assert shardkit("pack", source, clean, "--format", "lmdb", *FLAGS).returncode == 0
    cleanup = tmp_path / "cleanup.log"
    assert killed_pack(warm, source, out, hook, short_tmp, "lmdb", log=str(cleanup)).returncode == 0
    first_marker = next(step for step in steps_of(cleanup, "lmdb") if step.startswith("unlink out/.shardkit/done/"))
    shutil.rmtree(out)
    killed = killed_pack(warm, source, out, hook, short_tmp, "lmdb", at=first_marker)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    again = killed_pack(warm, source, out, hook, short_tmp, "lmdb", "--resume", at="unlink out/manifest.json")
    assert again.returncode in (0, -signal.SIGKILL), again.stderr  # (0: it found the pack finished)
    resumed = shardkit("pack", source, out, "--format", "lmdb", *FLAGS, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert snapshot(out) == snapshot(clean)
    shutil.rmtree(out)

"""Output faults on a real filesystem: a full disk and a read-only one (tmpfs mounts, so these tests
need root; elsewhere they are skipped with the reason). Every fault is one line naming the output and
the cause, exit 1, no traceback, no manifest; and a resume after the fault is fixed is a clean run."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardkit.core.manifest import read_manifest
from shardkit.synthetic import write_image

pytestmark = pytest.mark.slow


def mount_tmpfs(where: Path, size: str, *options: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", ",".join((f"size={size}", *options)), "tmpfs", str(where)],
        capture_output=True, text=True,
    )  # fmt: skip
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {result.stderr.strip()}")


def remount(where: Path, *options: str) -> None:
    subprocess.run(["mount", "-o", ",".join(("remount", *options)), str(where)], check=True)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "1m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture(scope="module")
def big_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 photos of ~40 KB each stored as they are: ~1.6 MB of shards, more than the small disk holds."""
    root = tmp_path_factory.mktemp("big")
    for i in range(40):
        write_image(root / f"{i:02d}.jpg", 320, 240, seed=i, quality=97)
    return root


def run(python_command: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*python_command, *args], capture_output=True, text=True, timeout=180)


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "Segmentation" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for needle in needles:
        assert needle in result.stderr, result.stderr


def flags(name: str, workers: str) -> list[str]:
    return ["--format", name, "--workers", workers, "--shard-size", "5", "--resize", "none", "--encode", "original"]


@pytest.fixture(scope="module")
def clean_packs(big_images: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted result per format (the same bytes whatever the worker count)."""
    import sys

    packs = {}
    for name in ("webdataset", "lmdb", "hdf5"):
        out = tmp_path_factory.mktemp("clean") / name
        command = [sys.executable, "-m", "shardkit", "pack", str(big_images), str(out), *flags(name, "2")]
        subprocess.run(command, check=True, capture_output=True)
        packs[name] = out
    return packs


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("name", ["webdataset", "lmdb", "hdf5"])
def test_a_full_disk_is_one_line_and_resume_finishes_the_pack(
    python_command, big_images: Path, clean_packs: dict[str, Path], small_disk: Path, name: str, workers: str
) -> None:
    flags_ = flags(name, workers)
    clean = clean_packs[name]
    out = small_disk / "out"
    full = run(python_command, "pack", str(big_images), str(out), *flags_)
    one_line_error(full, str(out), "no space left")
    assert not (out / "manifest.json").exists()
    assert not list((out / ".shardkit" / "tmp").glob("*")), "half-written shards were left behind"
    remount(small_disk, "size=64m")
    resumed = run(python_command, "pack", str(big_images), str(out), *flags_, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    clean_shards = {s.name: s.sha256 for s in read_manifest(clean).shards}
    assert {s.name: s.sha256 for s in read_manifest(out).shards} == clean_shards
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()


def test_an_lmdb_shard_opened_on_a_full_disk_is_no_space_left(small_disk: Path) -> None:
    """A disk that fills up between two shards: the next shard's writer fails as it makes its first
    pages, and says so as the OSError every writer raises (CI once showed lmdb's own error, with
    a worker's traceback, instead of the pack's one line)."""
    import errno
    import os

    from shardkit.formats import get_format

    fd = os.open(small_disk / "filler", os.O_WRONLY | os.O_CREAT)
    with pytest.raises(OSError):  # the disk filled to its last byte
        while True:
            os.write(fd, b"\0" * 4096)
    os.close(fd)
    with pytest.raises(OSError) as raised:
        get_format("lmdb").writer(str(small_disk / "shard-000001.lmdb.tmp"))
    assert raised.value.errno == errno.ENOSPC, raised.value


def test_a_read_only_output_is_refused_before_any_work(python_command, big_images: Path, tmp_path: Path) -> None:
    disk = tmp_path / "ro"
    mount_tmpfs(disk, "4m")
    try:
        finished = disk / "finished"
        assert run(python_command, "pack", str(big_images), str(finished), "--resize", "32").returncode == 0
        remount(disk, "ro")
        before = sorted(p.name for p in finished.iterdir())
        for target, extra in ((disk / "new", []), (finished, ["--overwrite"]), (finished, ["--resume"])):
            result = run(python_command, "pack", str(big_images), str(target), "--resize", "32", *extra)
            one_line_error(result, str(target), "read-only file system")
        assert sorted(p.name for p in finished.iterdir()) == before
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_manifest_that_is_a_folder_is_refused_before_any_work(python_command, big_images: Path, tmp_path: Path):
    out = tmp_path / "out"
    (out / "manifest.json").mkdir(parents=True)
    result = run(python_command, "pack", str(big_images), str(out), "--overwrite")
    one_line_error(result, "manifest.json", "not a regular file")
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]

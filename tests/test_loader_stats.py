"""loader.stats(): where a loader's time goes, and its verdict, on real shards, a real trickling
HTTP server and real sleeps standing for a training step."""

from __future__ import annotations

import functools
import time
from dataclasses import replace
from http.server import SimpleHTTPRequestHandler
from pathlib import Path

import pytest

from shardkit.core.config import PackConfig
from shardkit.core.errors import ConfigError
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.readers.stats import INPUT_BOUND, WAITS, LoaderStats
from shardkit.synthetic import write_image

from .servers import serving
from .stage_outputs import targets


def timed_epoch(loader, step: float = 0.0) -> float:
    """The test's own wall time of an epoch whose training step sleeps `step` seconds a batch."""
    start = time.perf_counter()
    for _ in loader:
        if step:
            time.sleep(step)
    return time.perf_counter() - start


def adds_up(stats: LoaderStats, wall: float) -> None:
    """The training thread's stages (its step and its waits) make up the wall time the test
    measured around the epoch: within 5% (the loop's own start before the first batch)."""
    parts = stats.step + sum(stats.waits.values())
    assert abs(parts - stats.seconds) <= 0.001 + 0.001 * stats.seconds  # (exact by the clock's own reads)
    assert stats.seconds <= wall
    assert wall - parts <= 0.05 * wall + 0.02, (wall, stats)


@pytest.fixture(scope="module")
def small(packed_sample) -> Path:
    """The session's sample: 60 images packed at 64 px, 7 records a shard (read only)."""
    return packed_sample("webdataset", 64, 7)


def test_a_training_step_slower_than_the_loader_is_compute_bound(small: Path) -> None:
    loader = open_shards(small).loader(8, 48, workers=2, output="numpy")
    batches = iter(loader)
    next(batches)  # the first batch waits for the pipeline to fill: the steady state is what is judged
    loader.stats(since_last=True)
    start = time.perf_counter()
    for _ in batches:
        time.sleep(0.1)
    wall = time.perf_counter() - start
    stats = loader.stats(since_last=True)
    assert stats.batches == 7 and stats.samples == 52
    assert stats.verdict == "compute-bound", stats
    assert stats.input_share < INPUT_BOUND and stats.step >= 0.7
    adds_up(stats, wall)


def test_a_trickling_object_store_is_input_bound_on_storage(small: Path, tmp_path: Path) -> None:
    class Trickling(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path.endswith(".tar"):
                time.sleep(0.2)  # each shard's answer starts late: storage is what the loader waits on
            super().do_GET()

    with serving(functools.partial(Trickling, directory=str(small))) as url:
        loader = open_shards(url, cache_dir=tmp_path / "cache").loader(8, 48, workers=2, output="numpy")
        wall = timed_epoch(loader)
    stats = loader.stats()
    assert stats.verdict == "input-bound" and stats.dominant == "storage", stats
    assert stats.waits["storage"] >= 0.5 * stats.seconds
    adds_up(stats, wall)


def test_large_stored_images_make_decode_dominant(tmp_path: Path) -> None:
    """Stored at 960 x 720 for 16 px crops: the one decode thread is the bottleneck, and the
    stored pixels per output pixel say why."""
    images = tmp_path / "images" / "a"
    images.mkdir(parents=True)
    for i in range(8):
        write_image(images / f"{i}.jpg", 960, 720, seed=i)
    pack(replace(PackConfig(str(images.parent), str(tmp_path / "out")), shard_size=4))
    loader = open_shards(tmp_path / "out").loader(4, 16, crop="center", workers=1, output="numpy")
    wall = timed_epoch(loader)
    stats = loader.stats()
    assert stats.verdict == "input-bound" and stats.dominant == "decode", stats
    assert stats.busy["decode"] > stats.waits["read"] + stats.waits["collate"]
    assert stats.pixels_per_output_pixel == pytest.approx(960 * 720 / 16**2)
    adds_up(stats, wall)


def test_without_threads_the_decode_is_the_training_threads_wait(small: Path) -> None:
    loader = open_shards(small).loader(8, 48, workers=0, output="numpy")
    wall = timed_epoch(loader)
    stats = loader.stats()
    assert stats.threads == 0 and stats.waits["decode"] >= stats.busy["decode"] > 0
    adds_up(stats, wall)


def test_stats_add_over_epochs_and_restart_since_the_last_call(small: Path) -> None:
    loader = open_shards(small).loader(16, 32, workers=2, output="numpy", drop_last=True)
    timed_epoch(loader)
    first = loader.stats(since_last=True)
    timed_epoch(loader)
    second = loader.stats(since_last=True)
    whole = loader.stats()
    assert first.batches == second.batches == 3 and whole.batches == 6 and whole.samples == 96
    assert whole.seconds == pytest.approx(first.seconds + second.seconds, abs=1e-6)
    assert set(whole.waits) == set(WAITS)
    assert loader.stats(since_last=True).batches == 0  # nothing since the last call


def test_a_loop_that_stops_early_ends_its_epoch_there(small: Path) -> None:
    loader = open_shards(small).loader(8, 32, workers=2, output="numpy")
    for n, _ in enumerate(loader):
        if n == 2:
            break
    time.sleep(0.2)  # after the loop: not the loader's time
    stats = loader.stats()
    assert stats.batches == 3 and stats.seconds < 0.2 + stats.step


def test_stats_read_from_another_thread_mid_step(small: Path) -> None:
    """A step in progress counts up to the call: a monitor thread sees the loop's time as it goes."""
    loader = open_shards(small).loader(8, 32, workers=2, output="numpy")
    for _ in loader:
        time.sleep(0.05)
        during = loader.stats()
        assert during.step + during.waited == pytest.approx(during.seconds, abs=1e-3)
        break


def test_targets_time_is_their_own(tmp_path_factory) -> None:
    """With mask= and boxes=, the targets' time is their stage's, taken out of decode's."""
    loader = open_shards(targets(tmp_path_factory)).loader(
        4, 32, workers=1, output="numpy", mask="seg.png", boxes="objects.bbox"
    )
    wall = timed_epoch(loader)
    stats = loader.stats()
    assert stats.batches == 2 and stats.busy["targets"] > 0 and stats.busy["decode"] > 0
    adds_up(stats, wall)


def test_stats_off_keeps_no_times_and_progress_needs_them(small: Path) -> None:
    dataset = open_shards(small)
    loader = dataset.loader(8, 32, workers=1, output="numpy", stats=False)
    assert sum(len(batch.keys) for batch in loader) == 60
    with pytest.raises(ConfigError, match="stats=False"):
        loader.stats()
    with pytest.raises(ConfigError, match="progress=True"):
        dataset.loader(8, 32, output="numpy", stats=False, progress=True)


def test_the_progress_line_says_the_rate_and_the_verdict(small: Path, capfd) -> None:
    loader = open_shards(small).loader(8, 32, workers=1, output="numpy", progress=True)
    for _ in loader:
        time.sleep(0.1)  # past the line's refresh (0.5 s), so it says a rate and a verdict
    err = capfd.readouterr().err
    assert "8/8" in err and "batches/s" in err and ("input-bound" in err or "compute-bound" in err)


def test_the_table_names_every_stage(small: Path) -> None:
    loader = open_shards(small).loader(8, 32, workers=1, output="numpy")
    timed_epoch(loader)
    text = str(loader.stats())
    assert text.splitlines()[0].startswith(("input-bound", "compute-bound"))
    for name in ("step", *(f"wait: {wait}" for wait in WAITS), "threads: decode"):
        assert name in text


def test_a_loader_not_iterated_yet_is_idle(small: Path) -> None:
    stats = open_shards(small).loader(8, 32, output="numpy").stats()
    assert (stats.verdict, stats.dominant, stats.batches, stats.seconds) == ("idle", "none", 0, 0.0)
    assert str(stats) == "idle: no batch was asked for in this span"

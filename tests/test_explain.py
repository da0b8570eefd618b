"""bench --explain's advice: each line drawn from a number of the run, none without its cause."""

from __future__ import annotations

from shardkit.checks.explain import advice
from shardkit.readers.stats import LoaderStats


def stats(waits: dict[str, float], busy: dict[str, float], threads: int = 1, cpu: float = 1.0, stored: int = 0):
    seconds = 10.0
    full = {"read": 0.0, "storage": 0.0, "decode": 0.0, "collate": 0.0, **waits}
    return LoaderStats(
        seconds=seconds, batches=100, samples=6400, step=seconds - sum(full.values()), waits=full,
        busy={"decode": 0.0, "targets": 0.0, "device": 0.0, **busy}, threads=threads, cpu_seconds=cpu,
        cores=8, stored_pixels=stored, output_pixels=1000,
    )  # fmt: skip


def test_decode_on_idle_cores_asks_for_threads_and_big_stored_images_for_a_resize() -> None:
    said = advice(stats({"decode": 9.0}, {"decode": 9.5}, threads=1, cpu=12.0, stored=9000), 224)
    assert said[0].startswith("the loader delivers 640 samples/s (10.0 batches/s)") and "100 ms" in said[0]
    assert any("more threads (workers=8)" in line and "this process used 15% of the 8 cores" in line for line in said)
    assert any("9.0 stored pixels" in line and "--resize 256" in line for line in said)


def test_decode_on_busy_cores_points_at_the_device() -> None:
    busy = stats({"decode": 9.0}, {"decode": 76.0}, threads=8, cpu=78.0, stored=1500)
    said = advice(busy, 224)
    assert any("loader(device='cuda')" in line for line in said)
    assert not any("more threads" in line or "--resize" in line for line in said)  # (neither has its cause)
    assert not any("device=" in line for line in advice(busy, 224, device="cuda"))  # (the path it ran on)


def test_storage_and_read_each_get_their_own_advice() -> None:
    remote = advice(stats({"storage": 7.0, "read": 0.5}, {"decode": 1.0}), 224)
    assert any("object storage dominates (70%" in line and "cache_dir=" in line for line in remote)
    local = advice(stats({"read": 6.0}, {"decode": 1.0}), 224)
    assert any("reading records dominates (60%" in line for line in local)
    assert not any("cache_dir=" in line for line in local)


def test_a_compute_bound_loader_gets_no_advice_on_its_stages() -> None:
    said = advice(stats({"read": 0.1, "collate": 0.05}, {"decode": 0.4}, threads=4, cpu=20.0), 224)
    assert said[1:] == ["the training loop waited 2% of its time: the model, not the input, bounds it"]

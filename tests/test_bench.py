from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardkit.checks.bench import bench
from shardkit.checks.bench_report import BASELINE
from shardkit.core.config import MAX_SIDE
from shardkit.core.errors import ConfigError


def test_bench_measures_every_pass_on_the_same_images(sample_dataset: Path, packed_sample) -> None:
    out = packed_sample("webdataset", 64, 16)
    calls: list[tuple[int, int]] = []
    report = bench(out, against=sample_dataset, repeat=2, progress=lambda done, total: calls.append((done, total)))
    names = [row.name for row in report.rows]
    # every pass run counted (a warm-up and 2 rounds each, then the paired overhead), in order
    total = 3 * len(names) + 1
    assert calls == [(done, total) for done in range(total + 1)]
    assert names[0] == BASELINE and "shards: bytes only (I/O)" in names and "shards: scale 1/2" in names
    assert all(row.images == 60 and len(row.seconds) == 2 and row.images_per_second > 0 for row in report.rows)
    assert report.ratio(BASELINE) == 1.0
    assert report.reader_overhead() is not None
    parallel = bench(out, workers=2, repeat=1, cold=True)
    assert all(row.workers == 2 and row.images == 60 for row in parallel.rows)


def test_bench_cli_writes_json(shardkit, sample_dataset: Path, packed_sample, tmp_path: Path) -> None:
    out = packed_sample("webdataset", 64, 16)
    report = tmp_path / "bench.json"
    result = shardkit("bench", out, "--against", sample_dataset, "--repeat", "1", "--json", report)
    assert result.returncode == 0, result.stderr
    assert "vs folder PIL" in result.stdout
    data = json.loads(report.read_text())
    assert data["images"] == 60 and data["speedup_vs_folder_pil"][BASELINE] == 1.0


def test_workers_share_records_not_whole_shards() -> None:
    from shardkit.checks.bench import worker_parts

    assert worker_parts([300], 2) == [[(0, 0, 150)], [(0, 150, 300)]]
    parts = worker_parts([5, 0, 7, 3], 3)
    assert [sum(stop - start for _, start, stop in part) for part in parts] == [5, 5, 5]
    assert sorted((s, i) for part in parts for s, a, b in part for i in range(a, b)) == sorted(
        (s, i) for s, n in enumerate([5, 0, 7, 3]) for i in range(n)
    )


@pytest.mark.slow  # (2.4 s: the fast suite stays under a minute)
def test_bench_train_measures_the_loader_and_its_device_path(sample_dataset: Path, packed_sample) -> None:
    """--train with --device: the CPU loader and the device path each run a whole epoch (device
    "cpu" here, the torch code a GPU runs), beside torchvision on the raw folder."""
    import pytest

    pytest.importorskip("torchvision")
    out = packed_sample("webdataset", 64, 16)
    report = bench(out, against=sample_dataset, repeat=1, train=48, device="cpu")
    rows = {row.name: row for row in report.rows}
    for name in ("train 48: folder + torchvision", "train 48: shards loader", "train 48: shards loader, cpu"):
        assert rows[name].images == 60 and rows[name].images_per_second > 0, name


@pytest.mark.parametrize("train", [7, MAX_SIDE + 1])
def test_bench_refuses_a_training_size_by_the_one_rule(tmp_path: Path, train: int) -> None:
    """The training size is bounded by core.config's rule, the one probe and pack use, and refused
    before anything is opened (the output here does not exist)."""
    with pytest.raises(ConfigError, match=f"train size must be between 8 and {MAX_SIDE} pixels, not {train}"):
        bench(tmp_path / "nothing", train=train)


def test_the_plot_draws_the_bytes_only_pass_on_its_own_axis(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from shardkit.checks.bench_report import IO_ONLY
    from shardkit.checks.plots import plot_bars

    path = tmp_path / "bench.png"
    plot_bars([BASELINE, "shards: Pillow", IO_ONLY], [300.0, 600.0, 9000.0], "t", "images/s", path, apart=[IO_ONLY])
    assert path.stat().st_size > 0


def test_bench_explain_says_where_the_loaders_time_goes(shardkit, packed_sample, tmp_path: Path) -> None:
    """--explain: one more epoch of the loader, stage by stage, and advice drawn from its numbers,
    in the table and in the JSON."""
    out = packed_sample("webdataset", 64, 16)
    report = tmp_path / "bench.json"
    result = shardkit("bench", out, "--repeat", "1", "--train", "32", "--explain", "--json", report)
    assert result.returncode == 0, result.stderr
    assert "where the training input's time goes" in result.stdout and "wait: decode" in result.stdout
    explained = json.loads(report.read_text())["explain"]
    assert explained["verdict"] == "input-bound"  # (nothing but the loader runs: it is all the time)
    assert explained["samples"] == 60 and explained["dominant"] in ("read", "decode", "collate")
    assert explained["advice"][0].startswith("the loader delivers")
    assert explained["step"] + sum(explained["waits"].values()) == pytest.approx(explained["seconds"], abs=1e-3)


def test_bench_explain_needs_a_training_size(shardkit, tmp_path: Path) -> None:
    result = shardkit("bench", tmp_path / "nothing", "--explain")
    assert result.returncode != 0 and "--explain explains the training input: give --train SIZE too" in result.stderr
    assert "Traceback" not in result.stderr

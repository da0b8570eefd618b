from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from shardkit.probe import probe, probe_records, recommend, summarize
from shardkit.synthetic import write_image


def test_probe_counts_sizes_and_problems(sample_dataset: Path) -> None:
    report = probe(sample_dataset, workers=1)
    assert report.files == 61 and report.images == 60
    assert report.problems["corrupt header"].count == 1
    assert report.rotated >= 1 and report.progressive >= 1
    assert report.formats["jpeg"] + report.formats.get("png", 0) == 60
    assert report.percentiles["short_side"]["min"] <= report.percentiles["short_side"]["p50"]
    assert sum(n for _, _, n in report.short_side_histogram) == 60


def test_parallel_probe_equals_serial(sample_dataset: Path) -> None:
    records = probe(sample_dataset, workers=1).records
    paths = [str(sample_dataset / r.relpath) for r in records]
    relpaths = [r.relpath for r in records]
    parallel = probe_records(paths, relpaths, workers=2, min_parallel=0)
    assert parallel == records


def test_wild_problems_are_each_listed(wild: Path) -> None:
    report = probe(wild)
    kinds = set(report.problems)
    assert {"empty file", "not an image", "corrupt header", "zero-size image"} <= kinds
    assert report.problems["over the pixel limit (decompression bomb?)"].examples[0].startswith("decompression_bomb")
    assert any("truncated_jpeg" in e for e in report.problems["truncated (no end marker)"].examples)


def test_extension_mismatch_is_flagged(tmp_path: Path) -> None:
    write_image(tmp_path / "real.png", 20, 20)
    (tmp_path / "real.png").rename(tmp_path / "fake.jpg")
    report = probe(tmp_path)
    assert report.problems["extension does not match content"].examples == ["fake.jpg: content is png"]


def test_recommendation_follows_the_classic_recipe() -> None:
    widths = np.full(100, 500.0)
    heights = np.full(100, 375.0)
    rec = recommend(widths, heights, np.full(100, 100_000.0), train_size=224)
    assert rec.resize == 256 and rec.shrink_share == 1.0
    assert rec.bytes_after_estimate == pytest.approx(100 * 100_000 * (256 / 375) ** 2, rel=1e-6)
    assert rec.decode_work_saved == pytest.approx(1 - (256 / 375) ** 2, abs=1e-4)


def test_recommendation_never_exceeds_what_most_images_have() -> None:
    small = recommend(np.full(10, 240.0), np.full(10, 300.0), np.ones(10), train_size=224)
    assert small.resize == 240 and small.shrink_share == 0.0
    tiny = recommend(np.full(10, 100.0), np.full(10, 120.0), np.ones(10), train_size=224)
    assert tiny.resize is None


def test_summary_of_nothing_readable(tmp_path: Path) -> None:
    (tmp_path / "bad.jpg").write_bytes(b"nope")
    report = probe(tmp_path)
    assert report.images == 0 and report.recommendation is None
    assert summarize([]).files == 0


def test_recommendation_uses_displayed_size(tmp_path: Path) -> None:
    for i in range(3):
        write_image(tmp_path / f"{i}.jpg", 600, 300, seed=i)
    assert probe(tmp_path, train_size=224).recommendation.resize == 256

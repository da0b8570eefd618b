from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from shardkit.packing.probe import (
    Counts,
    ProbeRecord,
    ProbeReport,
    counted_percentiles,
    counted_quantiles,
    probe,
    recommend,
)
from shardkit.synthetic import write_image
from tests.helpers import image_files, probe_records, summarize


def test_probe_counts_sizes_and_problems(sample_dataset: Path) -> None:
    report = probe(sample_dataset, workers=1)
    assert report.files == 61 and report.images == 60
    assert report.problems["corrupt header"].count == 1
    assert report.rotated >= 1 and report.progressive >= 1
    assert report.formats["jpeg"] + report.formats.get("png", 0) == 60
    assert report.percentiles["short_side"]["min"] <= report.percentiles["short_side"]["p50"]
    assert sum(n for _, _, n in report.short_side_histogram) == 60


def collected(source: Path, **options: object) -> tuple[ProbeReport, list[ProbeRecord]]:
    records: list[ProbeRecord] = []
    report = probe(source, on_chunk=lambda chunk: records.extend(chunk.records()), **options)
    return report, records


def test_parallel_probe_equals_serial(sample_dataset: Path) -> None:
    _, records = collected(sample_dataset, workers=1)
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


def test_counted_percentiles_are_numpys_to_the_last_bit() -> None:
    rng = np.random.default_rng(3)
    for trial in range(200):
        distinct = rng.integers(1, 40)
        values = np.unique(rng.integers(1, 5000, distinct)).astype(np.float64) / rng.choice([1, 3, 1024])
        counts = rng.integers(1, 50, len(values))
        expanded = np.repeat(values, counts)
        rng.shuffle(expanded)
        wanted = np.percentile(expanded, [1, 5, 25, 50, 75, 95, 99])
        found = counted_quantiles(values[::-1].copy(), counts[::-1].copy(), np.array([1, 5, 25, 50, 75, 95, 99]) / 100)
        assert found.tolist() == wanted.tolist(), trial
        summary = counted_percentiles(values, counts)
        assert summary["mean"] == pytest.approx(round(float(expanded.mean()), 3), abs=1e-3)
        assert (summary["min"], summary["max"]) == (expanded.min(), expanded.max())


def test_streamed_probe_reports_what_the_whole_list_gives(wild: Path, sample_dataset: Path) -> None:
    """Tiny chunks on two threads finish out of order: the records still come in walk order, and
    the streamed statistics equal those of the whole list summarized at once."""
    for source in (sample_dataset, wild):
        report, records = collected(source, workers=2, chunk_files=3)
        paths, relpaths, _ = image_files(source)
        assert [r.relpath for r in records] == relpaths
        assert records == probe_records(paths, relpaths, workers=1)
        whole = summarize(records, root=str(source))
        report.seconds, report.workers, report.worker_kind, report.skipped = 0.0, 1, whole.worker_kind, []
        report.labels = None  # (the walk's, not the records')
        assert report.duplicates is not None  # confirmed by reading files again: not in a summary of records
        report.duplicates = None
        assert report == whole


def test_problems_keep_a_few_examples_and_the_exact_count(tmp_path: Path) -> None:
    for i in range(12):
        (tmp_path / f"bad{i:02}.jpg").write_bytes(b"not a jpeg at all")
    write_image(tmp_path / "ok.jpg", 20, 20)
    report = probe(tmp_path, chunk_files=5)
    problem = report.problems["not an image"]
    assert problem.count == 12 and [e.split(":")[0] for e in problem.examples] == [f"bad{i:02}.jpg" for i in range(5)]


def test_the_census_grows_with_distinct_sizes_not_with_files() -> None:
    counts = Counts()
    rng = np.random.default_rng(0)
    for _ in range(40):
        counts.add(rng.choice([500, 375, 333], 25_000).astype(np.uint64), np.full(25_000, 7, np.int64))
        assert len(counts.values) <= 3 and len(counts._pending) < 11  # merged every 2**18 additions
    counts.merge()
    assert counts.values.tolist() == [333, 375, 500] and counts.counts.sum() == 1_000_000
    assert counts.weights.sum() == 7_000_000


def test_a_problem_s_kind_is_set_by_what_found_it_and_survives_a_process_boundary(tmp_path: Path) -> None:
    import pickle
    import struct
    import zlib

    from shardkit.packing.probe import FileProblem as Problem
    from shardkit.packing.probe import probe_file

    (tmp_path / "empty.jpg").write_bytes(b"")
    ihdr = struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0)  # a PNG 0 pixels wide
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    (tmp_path / "zero.png").write_bytes(b"\x89PNG\r\n\x1a\n" + chunk)
    kinds = {name: probe_file(str(tmp_path / name), name).error.kind for name in ("empty.jpg", "zero.png")}
    assert kinds == {"empty.jpg": "empty file", "zero.png": "zero-size image"}
    sent = pickle.loads(pickle.dumps(Problem("cannot read: denied", "cannot read (permissions, I/O)")))
    assert (sent, sent.kind) == ("cannot read: denied", "cannot read (permissions, I/O)")


def test_probe_counts_exact_copies_confirmed_by_their_bytes_and_links_as_one_file(tmp_path: Path) -> None:
    """Copies under any name and extension (one goes through the Python parser) are counted; links
    to a file are one file; a file of the same size and the same first 4 KiB (the head the scanner
    hashes) but other bytes after it is a candidate that the sha256 turns away."""
    from shardkit.checks.duplicates import find_duplicates

    src = tmp_path / "src"
    originals = [write_image(src / "a" / f"p{i}.jpg", 160, 120, seed=i, quality=95) for i in range(5)]
    data = [path.read_bytes() for path in originals]
    assert all(len(d) > 8192 for d in data)  # longer than the head: the altered copy below keeps it
    (src / "b").mkdir()
    (src / "b" / "copy.jpg").write_bytes(data[0])
    (src / "b" / "copy.png").write_bytes(data[0])  # an extension mismatch: the Python path's hash
    (src / "b" / "p1 again.jpg").write_bytes(data[1])
    (src / "b" / "link.jpg").symlink_to(originals[2])
    os.link(originals[3], src / "b" / "hard.jpg")
    altered = bytearray(data[4])
    altered[-100] ^= 0xFF  # same size, same head, other bytes
    (src / "b" / "altered.jpg").write_bytes(bytes(altered))
    for workers in (1, 2):
        calls: list[tuple[int, int]] = []
        copies = probe(
            src, workers=workers, chunk_files=3, copies_progress=lambda *c, out=calls: out.append(c)
        ).duplicates
        # the 7 candidates read whole: p0 and its 2 copies, p1 and its copy, p4 and its altered twin
        assert calls and calls[-1] == (7, 7)
        assert copies is not None
        assert (copies.files, copies.groups, copies.links) == (3, 2, 2)
        assert copies.bytes == 2 * len(data[0]) + len(data[1])
        assert copies.examples == [["a/p0.jpg", "b/copy.jpg", "b/copy.png"], ["a/p1.jpg", "b/p1 again.jpg"]]
    # what `shardkit duplicates` finds by hashing every file whole
    groups = [g for g in find_duplicates([src]).groups if g.kind == "exact" and g.match == "bytes"]
    assert sum(len(g.files) - 1 for g in groups) == 3


def test_probe_of_distinct_files_reports_no_copies(sample_dataset: Path) -> None:
    report = probe(sample_dataset)
    assert report.duplicates is not None and report.duplicates.files == 0 and report.duplicates.links == 0


def test_confirmation_reads_only_the_files_the_scan_counted(tmp_path: Path) -> None:
    """Copies are named by a second walk: a name that reaches another file by then (the folder
    changed between the walks) is not read as the file counted, so it confirms nothing."""
    from shardkit.core.headers import read_head
    from shardkit.packing.probe import confirm_copies

    a = write_image(tmp_path / "a.jpg", 64, 48, seed=1)
    b = tmp_path / "b.jpg"
    b.write_bytes(a.read_bytes())
    key = 7  # any: both share it, as candidates do
    names = [(key, read_head(str(p))[1], str(p), p.name) for p in (a, b)]
    assert confirm_copies(names, workers=1).files == 1
    (tmp_path / "new.jpg").write_bytes(a.read_bytes())
    os.replace(tmp_path / "new.jpg", b)  # the same bytes, but another file since the scan (its own inode)
    assert confirm_copies(names, workers=1).files == 0
    b.unlink()
    os.mkfifo(b)  # a FIFO in the candidate's place: refused, not waited on
    assert confirm_copies(names, workers=1).files == 0

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_pack_with_preset_prints_summary(shardkit, sample_dataset: Path, tmp_path: Path) -> None:
    preset = Path(__file__).resolve().parents[1] / "configs" / "imagenet-256.toml"
    result = shardkit("pack", sample_dataset, tmp_path / "out", "--config", preset, "-f", "lmdb")
    assert result.returncode == 0, result.stderr
    assert "60 of 61 inputs" in result.stdout and "worker time split" in result.stdout
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["format"] == "lmdb"  # the flag beats the preset's webdataset
    assert manifest["settings"]["resize"]["size"] == 256 and manifest["settings"]["encode"]["quality"] == 90


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--resize", "big"], "--resize takes a number of pixels"),
        (["--quality", "0"], "quality must be between 1 and 100"),
        (["--shard-bytes", "lots"], "not a size"),
        (["--resize", "auto", "--resize-mode", "long"], "--resize auto picks a short side"),
        (["--resume", "--overwrite"], "contradict"),
        (["--workers", "0"], "workers must be at least 1"),
        (["--resize-mode", "center-crop"], "center-crop needs a size"),
    ],
)
def test_bad_flags_are_refused_before_any_work(shardkit, sample_dataset, tmp_path, args, message) -> None:
    out = tmp_path / "out"
    result = shardkit("pack", sample_dataset, out, *args)
    assert result.returncode == 1, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_unknown_format_is_a_usage_error(shardkit, sample_dataset, tmp_path) -> None:
    result = shardkit("pack", sample_dataset, tmp_path / "o", "--format", "zip")
    assert result.returncode == 2 and "zip" in result.stderr


def test_output_inside_a_file_is_refused(shardkit, sample_dataset, tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    result = shardkit("pack", sample_dataset, tmp_path / "file" / "out")
    assert result.returncode == 1 and "cannot write here" in result.stderr


def test_a_pack_that_packs_nothing_fails_naming_the_first_reason(shardkit, tmp_path: Path) -> None:
    """Every input broken: the output is written (errors.jsonl says why for each) but holds nothing
    to train on, and the command exited 0, so a pipeline went on with an empty dataset."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "a.jpg").write_bytes(b"\xff\xd8\xff\xe0 not the rest of a JPEG")
    (source / "b.png").write_bytes(b"")
    result = shardkit("pack", source, tmp_path / "out")
    assert result.returncode == 1, result.stdout
    first = json.loads((tmp_path / "out" / "errors.jsonl").read_text().splitlines()[0])
    assert result.stderr.strip() == (
        f"error: {tmp_path / 'out'}: none of the 2 inputs was packed; the first: {first['path']}: {first['reason']} "
        "(each is in errors.jsonl)"
    )
    assert "0 of 2 inputs" in result.stdout  # (the summary as ever)
    from shardkit.core.manifest import read_manifest

    assert read_manifest(tmp_path / "out").records == 0  # (the output stands: verify and a reader see why)

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest


def test_probe_prints_report_and_writes_json_and_records(shardkit, sample_dataset: Path, tmp_path: Path) -> None:
    report_path, records_path = tmp_path / "report.json", tmp_path / "records.csv"
    result = shardkit("probe", sample_dataset, "--json", report_path, "--records", records_path)
    assert result.returncode == 0, result.stderr
    assert "recommendation" in result.stdout and "--resize" in result.stdout
    report = json.loads(report_path.read_text())
    assert report["images"] == 60 and report["files"] == 61
    assert report["recommendation"]["train_size"] == 224
    assert report["duplicates"]["files"] == 0 and "exact duplicates: none" in result.stdout
    rows = list(csv.DictReader(records_path.open()))
    assert len(rows) == 61
    assert sum(1 for row in rows if row["error"]) == 1


def test_probe_reads_train_size_from_preset_and_flag_wins(shardkit, sample_dataset: Path, tmp_path: Path) -> None:
    preset = tmp_path / "p.toml"
    preset.write_text("train_size = 160\n")
    out = tmp_path / "r.json"
    assert shardkit("probe", sample_dataset, "--config", preset, "--json", out).returncode == 0
    assert json.loads(out.read_text())["recommendation"]["train_size"] == 160
    shardkit("probe", sample_dataset, "--config", preset, "--train-size", "128", "--json", out)
    assert json.loads(out.read_text())["recommendation"]["train_size"] == 128


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/definitely/not/here"], "no such file or folder"),
        (["{empty}"], "no images found"),
        (["{sample}", "--records", "{tmp}/r.parquet"], "records must be .jsonl or .csv"),
        (["{sample}", "--json", "/no/such/dir/r.json"], "its folder does not exist"),
        (["{sample}", "--config", "{tmp}/missing.toml"], "no such preset file"),
        (["{sample}", "--train-size", "2"], "train size must be between 8 and 16384"),
        (["{sample}", "--max-pixels", "-1"], "max pixels must be positive"),
        (["{sample}", "--workers", "0"], "workers must be at least 1"),
    ],
)
def test_bad_input_is_one_line_without_traceback(shardkit, sample_dataset, tmp_path, args, message) -> None:
    (tmp_path / "empty").mkdir()
    filled = [a.format(empty=tmp_path / "empty", sample=sample_dataset, tmp=tmp_path) for a in args]
    result = shardkit("probe", *filled)
    assert result.returncode == 1
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_version_and_doctor(shardkit) -> None:
    assert shardkit("--version").stdout.startswith("shardkit ")
    doctor = shardkit("doctor")
    assert doctor.returncode == 0
    assert "libturbojpeg" in doctor.stdout and "PIL" in doctor.stdout
    missing = [extra for name, extra in (("gcsfs", "gcs"), ("ray", "ray")) if importlib.util.find_spec(name) is None]
    if missing:  # the advice is a pip command a pip user can run, not `make install`
        advice = doctor.stdout.replace("\n", "").split("pip install 'shardkit[", 1)[1].split("]", 1)[0]
        assert set(missing) <= set(advice.split(","))

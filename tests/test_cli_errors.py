"""No traceback for any input: every command refuses bad flags and unwritable report paths in one
line, with exit code 1, before any work (so a mistake never costs the run it follows)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def packed(packed_sample) -> Path:
    return packed_sample("webdataset", 32, 30)  # (read only)


CASES = [
    # (command, arguments; {src} {out} {tmp} filled in), expected words
    ("verify {out} --workers -1", "workers must be at least 1"),
    ("verify {out} --workers 0", "workers must be at least 1"),
    ("verify {out} --deep --max-pixels 0", "max pixels must be positive"),
    ("verify {out} --json /no/such/dir/r.json", "its folder does not exist"),
    ("verify {out} --json {tmp}", "is a folder"),
    ("verify {out} --deep --source /no/such/folder", "no such file or folder"),
    ("probe {src} --plot {tmp}/x.xyz", "a plot must be"),
    ("probe {src} --plot /no/such/dir/p.png", "its folder does not exist"),
    ("probe {src} --train-size 100000000000000000000000000000", "train size must be between 8 and 16384"),
    # --repeat 100000 would take hours: refused in a second proves the check comes first
    ("bench {out} --against {src} --repeat 100000 --plot /missing/dir/b.png", "its folder does not exist"),
    ("bench {out} --against {src} --repeat 100000 --plot {tmp}/b.nope", "a plot must be"),
    ("bench {out} --repeat 100000 --json /missing/dir/b.json", "its folder does not exist"),
    ("bench {out} --workers 0", "at least 1"),
    ("bench {out} --repeat 100000 --device cpu", "give --train SIZE too"),
    ("bench {out} --repeat 100000 --train 64 --device tpu", "device must be 'cpu', 'cuda' or 'cuda:N'"),
    ("bench {out} --workers 99999999999", "at most 1024"),
    ("pack {src} {tmp}/o --max-aspect nan", "max aspect must be a finite number"),
    ("pack {src} {tmp}/o --max-aspect inf", "max aspect must be a finite number"),
    ("pack {src} {tmp}/o --max-aspect -inf", "max aspect must be a finite number"),
    ("pack {src} {tmp}/o --ray-address auto", "--ray-address is only used with --executor ray"),
    ("pack {src} {tmp}/o --shard-bytes 99999999999999999999999999GB", "not a size"),
    ("pack {src} {tmp}/o --shard-bytes 1e400", "not a size"),
    ("pack {src} {tmp}/o --seed -1", "seed must be between"),
    ("pack {src} {tmp}/o --resize auto --train-size 100000000000000000000", "train size must be between"),
    ("pack {src} {src}", "is the source folder itself"),
    ("pack {src} {src}/n00001000/out", "lies inside the source folder"),
    ("pack {src} {tmp}/o --config {tmp}/nan.toml", "max aspect must be a finite number"),
    ("pack {src} {tmp}/o --json /missing/dir/p.json", "its folder does not exist"),
    ("pack {src} {tmp}/o --json {tmp}/o/pack.json", "inside the output folder"),  # (a stray file there)
    ("verify {out} --json {out}/verify.json", "inside the output folder"),
    ("pack {src} {tmp}/o --dedup-threshold 3", "--dedup-threshold is for --dedup near"),
    ("verify {tmp}/missing", f"{{tmp}}{os.sep}missing: no such file or folder"),
    ("bench {tmp}/missing --against {src}", f"{{tmp}}{os.sep}missing: no such file or folder"),
]


@pytest.mark.parametrize(("arguments", "words"), CASES)
def test_bad_input_is_one_line_before_any_work(shardkit, sample_dataset, packed, tmp_path, arguments, words):
    (tmp_path / "nan.toml").write_text("max_aspect = nan\n")
    filled = [a.format(src=sample_dataset, out=packed, tmp=tmp_path) for a in arguments.split()]
    result = shardkit(*filled)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert words.format(tmp=tmp_path) in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not (tmp_path / "o").exists()


def test_json_dash_is_stdout_holding_the_json_alone(shardkit, sample_dataset, packed, tmp_path) -> None:
    """`--json -` is standard output, as everywhere else: the JSON alone (a pipe to jq reads it),
    the human summary on stderr; no file named '-' is written."""
    for arguments in (("verify", packed), ("pack", sample_dataset, tmp_path / "o", "--workers", "1"),
                      ("probe", sample_dataset)):  # fmt: skip
        result = shardkit(*arguments, "--json", "-", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert isinstance(json.loads(result.stdout), dict), result.stdout
        assert result.stderr.strip() and not (tmp_path / "-").exists()
    after = shardkit("verify", packed)  # the next command's summary is on stdout again
    assert after.stdout.startswith("OK")


def test_json_reports_never_hold_nan(shardkit, packed: Path, tmp_path: Path) -> None:
    report = tmp_path / "bench.json"
    assert shardkit("bench", packed, "--repeat", "1", "--json", report).returncode == 0
    json.loads(report.read_text(), parse_constant=lambda name: pytest.fail(f"{name} in the JSON report"))


# What click refuses itself (an unknown flag, a value not among the choices, a missing argument):
# the same one `error:` line as the library's refusals, with exit code 2 (a usage error, as click
# and argparse exit), and no usage block or box drawn around it.
USAGE_CASES = [
    ("pack {src} {tmp}/o --format lmbd", "'lmbd' is not one of 'webdataset', 'lmdb', 'hdf5'"),
    ("pack {src}", "Missing argument"),
    ("pack {src} {tmp}/o --no-such-flag", "No such option: --no-such-flag"),
    ("verify {out} --workers many", "Invalid value for '--workers'"),
    ("nonsense", "No such command 'nonsense'"),
]


@pytest.mark.parametrize(("arguments", "words"), USAGE_CASES)
def test_a_bad_command_line_is_one_line_too(shardkit, sample_dataset, packed, tmp_path, arguments, words):
    filled = [a.format(src=sample_dataset, out=packed, tmp=tmp_path) for a in arguments.split()]
    result = shardkit(*filled)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stderr.startswith("error: ") and words in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Value error" not in result.stderr, result.stderr
    assert "--help" in result.stderr and not (tmp_path / "o").exists()


def test_pack_writes_its_summary_as_json(shardkit, sample_dataset, tmp_path) -> None:
    report = tmp_path / "pack.json"
    result = shardkit("pack", sample_dataset, tmp_path / "o", "--resize", "32", "--json", report)
    assert result.returncode == 0, result.stderr
    summary = json.loads(report.read_text())
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    assert summary["records"] == manifest["totals"]["records"] and summary["totals"] == manifest["totals"]
    assert summary["shards"] == len(manifest["shards"]) and summary["format"] == "webdataset"
    assert summary["output_bytes"] == sum(shard["bytes"] for shard in manifest["shards"])

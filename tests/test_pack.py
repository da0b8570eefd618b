from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageOps

from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.core.errors import OutputError
from shardkit.core.manifest import read_manifest
from shardkit.formats import available_formats, get_format
from shardkit.packing.pack import pack
from shardkit.readers.decode import decode
from shardkit.synthetic import write_image
from tests.helpers import discover, read_errors


def config(source: Path, output: Path, **overrides) -> PackConfig:
    values = {"resize": ResizeConfig(128), "shard_size": 16, "workers": 1}
    values.update(overrides)
    return PackConfig(source=str(source), output=str(output), **values)


def all_records(output: Path):
    manifest = read_manifest(output)
    backend = get_format(manifest.format)
    for shard in manifest.shards:
        yield from backend.reader(str(output / shard.name))


def shard_hashes(output: Path) -> dict[str, str]:
    return {shard.name: shard.sha256 for shard in read_manifest(output).shards}


@pytest.mark.parametrize("name", available_formats())
def test_round_trip_keys_labels_metadata_and_pixels(sample_dataset: Path, tmp_path: Path, name: str) -> None:
    result = pack(config(sample_dataset, tmp_path / "out", format=name))
    assert (result.records, result.errors, result.inputs) == (60, 1, 61)
    manifest = read_manifest(tmp_path / "out")
    assert manifest.classes == [f"n{1000 + i:08d}" for i in range(4)]
    assert [s.count for s in manifest.shards] == [15, 16, 16, 13]  # 61 items; the corrupt one sorts into shard 0
    records = list(all_records(tmp_path / "out"))
    assert len({r.key for r in records}) == 60
    for record in records[::7]:
        source = sample_dataset / record.meta["source"]
        assert record.label == manifest.classes.index(record.meta["source"].split("/")[0])
        with Image.open(source) as image:
            shown = ImageOps.exif_transpose(image).convert("RGB")
        assert (record.meta["width"], record.meta["height"]) == shown.size
        pixels = decode(record.data, record.ext)
        assert pixels.shape[:2] == (record.meta["stored_height"], record.meta["stored_width"])
        assert min(pixels.shape[:2]) == min(128, *shown.size)
        expected = np.asarray(shown.resize(pixels.shape[1::-1], Image.Resampling.BICUBIC), dtype=np.float32)
        assert np.abs(pixels.astype(np.float32) - expected).mean() < 4.0
    assert read_errors(tmp_path / "out") == [
        {"path": "n00001000/corrupt.jpg", "stage": "header", "reason": "truncated before the frame header"}
    ]
    assert not (tmp_path / "out" / ".shardkit").exists()


@pytest.mark.parametrize("name", available_formats())
def test_bytes_do_not_depend_on_worker_count(sample_dataset: Path, tmp_path: Path, name: str) -> None:
    one = pack(config(sample_dataset, tmp_path / "one", format=name, workers=1))
    two = pack(config(sample_dataset, tmp_path / "two", format=name, workers=2))
    assert shard_hashes(tmp_path / "one") == shard_hashes(tmp_path / "two")
    assert one.manifest.totals == two.manifest.totals
    assert (tmp_path / "one" / "errors.jsonl").read_bytes() == (tmp_path / "two" / "errors.jsonl").read_bytes()


def test_every_wild_file_is_packed_or_listed(wild: Path, tmp_path: Path) -> None:
    result = pack(config(wild, tmp_path / "out", workers=2))
    errors = read_errors(tmp_path / "out")
    packed = {r.meta["source"] for r in all_records(tmp_path / "out")}
    listed = {row["path"] for row in errors}
    assert packed | listed == {p.name for p in wild.iterdir()}
    assert not packed & listed
    assert result.inputs == result.records + result.errors
    assert {"empty.jpg", "not_an_image.jpg", "decompression_bomb.gif", "truncated_jpeg.jpg"} <= listed
    cmyk = next(r for r in all_records(tmp_path / "out") if r.meta["source"] == "pil_sample_cmyk.jpg")
    assert decode(cmyk.data, cmyk.ext).shape[2] == 3


def test_output_folder_rules(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    with pytest.raises(OutputError, match="not empty"):
        pack(config(sample_dataset, out))
    first = shard_hashes(out)
    pack(config(sample_dataset, out, overwrite=True))
    assert shard_hashes(out) == first
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="did not write"):
        pack(config(sample_dataset, out, overwrite=True))
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="not a folder"):
        pack(config(sample_dataset, tmp_path / "file"))


def test_resume_with_other_settings_is_refused(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    (out / ".shardkit").mkdir(parents=True)
    (out / ".shardkit" / "state.json").write_text(json.dumps({"settings": "something else"}))
    with pytest.raises(OutputError, match="other settings"):
        pack(config(sample_dataset, out, resume=True))
    (out / ".shardkit" / "state.json").write_text(json.dumps({"plan": "an interrupted pack of shardkit 0.1"}))
    with pytest.raises(OutputError, match="started by an earlier shardkit"):
        pack(config(sample_dataset, out, resume=True))


def test_shuffle_is_seeded(sample_dataset: Path, tmp_path: Path) -> None:
    def keys(out: str, **options) -> list[str]:
        pack(config(sample_dataset, tmp_path / out, resize=ResizeConfig(32), **options))
        return [r.key for r in all_records(tmp_path / out)]

    plain, a, b, c = (
        keys("p"),
        keys("a", shuffle=True, seed=1),
        keys("b", shuffle=True, seed=1),
        keys("c", shuffle=True, seed=2),
    )
    assert plain == sorted(plain, key=lambda k: k.encode()) or plain != a
    assert a == b and a != c and sorted(a) == sorted(plain)


def test_shard_bytes_counts_the_bytes_written(sample_dataset: Path, tmp_path: Path) -> None:
    # (how near the target: tests/test_shard_bytes.py)
    result = pack(config(sample_dataset, tmp_path / "out", shard_size=None, shard_bytes=60_000))
    assert result.shards > 3


def test_list_file_source_and_raw_encoding(tmp_path: Path) -> None:
    for i in range(5):
        write_image(tmp_path / "img" / f"{i}.jpg", 90 + i, 60, seed=i)
    listing = tmp_path / "list.txt"
    listing.write_text(
        "".join(f"img/{i}.jpg,{'cat' if i % 2 else 'dog'}\n" for i in range(5)) + "img/missing.jpg,cat\n"
    )
    result = pack(
        config(
            listing, tmp_path / "out", resize=ResizeConfig(32, mode="center-crop"), encode=EncodeConfig(encode="raw")
        )
    )
    assert (result.records, result.errors) == (5, 1)
    assert read_errors(tmp_path / "out")[0]["stage"] == "read"
    records = list(all_records(tmp_path / "out"))
    assert {r.label for r in records} == {0, 1}
    assert all(decode(r.data, r.ext).shape == (32, 32, 3) for r in records)


def test_resize_auto_uses_the_probe_recommendation(sample_dataset: Path, tmp_path: Path) -> None:
    result = pack(config(sample_dataset, tmp_path / "out", resize=ResizeConfig("auto"), train_size=224))
    assert result.resize == 256
    assert read_manifest(tmp_path / "out").settings["resize"]["size"] == 256


def run_pack_cli(python_command, source: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            *python_command,
            "pack",
            str(source),
            str(out),
            "--resize",
            "96",
            "--shard-size",
            "4",
            "--workers",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("kill_after_shards", [0, 3])
@pytest.mark.slow  # kills a process
def test_sigkill_then_resume_gives_the_same_shards(
    python_command, sample_dataset: Path, tmp_path: Path, kill_after_shards: int
) -> None:
    clean = tmp_path / "clean"
    assert run_pack_cli(python_command, sample_dataset, clean).wait(120) == 0
    out = tmp_path / "killed"
    process = run_pack_cli(python_command, sample_dataset, out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done = list(out.glob("shard-*.tar")) if out.exists() else []
        if len(done) >= kill_after_shards and (out / ".shardkit").exists():
            break
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    refused = run_pack_cli(python_command, sample_dataset, out)
    assert refused.wait(60) == 1 and "--resume" in refused.stderr.read()
    resumed = run_pack_cli(python_command, sample_dataset, out, "--resume")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    if kill_after_shards:
        assert "reused from the earlier run" in stdout
    assert shard_hashes(out) == shard_hashes(clean)
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())


@pytest.mark.slow  # kills a process
def test_a_dedup_pack_killed_while_hashing_resumes_to_the_same_output(
    python_command, sample_dataset: Path, tmp_path: Path
) -> None:
    """The hashes taken before the kill are in the state folder (read again on --resume, while the
    files are unchanged); the resumed output is the uninterrupted one, byte for byte."""
    flags = ("--dedup", "near")
    clean = tmp_path / "clean"
    assert run_pack_cli(python_command, sample_dataset, clean, *flags).wait(120) == 0
    out = tmp_path / "killed"
    cache = out / ".shardkit" / "hashes.jsonl"
    process = run_pack_cli(python_command, sample_dataset, out, *flags)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (cache.exists() and cache.read_text().count("\n") >= 2):
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    assert cache.read_text().count("\n") >= 2  # the header and at least one file's hashes
    resumed = run_pack_cli(python_command, sample_dataset, out, *flags, "--resume")
    _, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert shard_hashes(out) == shard_hashes(clean)
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())
    assert not (out / ".shardkit").exists() and not (clean / ".shardkit").exists()  # the cache goes with the state


def test_pixels_survive_the_jpeg_round_trip(tmp_path: Path) -> None:
    write_image(tmp_path / "src" / "a.png", 300, 200, seed=9)
    pack(config(tmp_path / "src", tmp_path / "out", resize=ResizeConfig(None), encode=EncodeConfig(quality=95)))
    (record,) = all_records(tmp_path / "out")
    source = Image.open(tmp_path / "src" / "a.png").convert("RGB")
    original = np.asarray(source, dtype=np.float32)
    restored = np.asarray(Image.open(io.BytesIO(record.data)), dtype=np.float32)
    # The loss must be what JPEG at that quality costs anyway: compare with Pillow's own encode.
    buffer = io.BytesIO()
    source.save(buffer, "JPEG", quality=95, subsampling=2)
    baseline = np.abs(original - np.asarray(Image.open(buffer), dtype=np.float32)).mean()
    assert np.abs(original - restored).mean() < baseline * 1.1 + 0.1


@pytest.mark.slow  # kills a process
def test_resume_repacks_only_the_shards_whose_files_changed(
    python_command, sample_dataset: Path, tmp_path: Path
) -> None:
    """An interrupted pack is checked shard by shard as it resumes: a shard is reused only if its
    own files are unchanged (names, sizes, mtimes); a shard the new plan no longer has is removed.
    The result equals a clean pack of the source as it is now."""
    source = Path(shutil.copytree(sample_dataset, tmp_path / "src", symlinks=True))
    out = tmp_path / "killed"
    process = run_pack_cli(python_command, source, out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(out.glob("shard-*.tar")) if out.exists() else []) < 3:
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    images = [Path(item.path) for item in discover(source).items]
    info = images[0].stat()  # in shard 0: packed again
    os.utime(images[0], ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    for late in images[8:]:  # two shards left: the killed run's shards 2 and up must go
        late.unlink()
    resumed = run_pack_cli(python_command, source, out, "--resume")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert "reused from the earlier run" in stdout
    clean = tmp_path / "clean"
    assert run_pack_cli(python_command, source, clean).wait(120) == 0
    assert shard_hashes(out) == shard_hashes(clean)
    assert (out / "manifest.json").read_bytes() == (clean / "manifest.json").read_bytes()
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())


def test_a_bug_is_not_passed_off_as_a_bad_image() -> None:
    """errors.jsonl's stage: 'decode' for what a codec raises, 'internal' for shardkit's own code."""
    from PIL import Image

    from shardkit.core.pack_options import parse_bytes
    from shardkit.packing.reading import blame as _blame

    with pytest.raises(Exception) as from_codec:
        Image.open(io.BytesIO(b"\x89PNG\r\n\x1a\n garbage")).load()
    assert _blame(from_codec.value) == "decode"
    with pytest.raises(Exception) as from_shardkit:
        parse_bytes("plenty")
    assert _blame(from_shardkit.value) == "internal"

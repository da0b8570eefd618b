"""The last shards of a pack split into parts that several workers encode, the driver writing each
shard from its parts (packing/parts.py): the bytes, index, errors and --dedup stand-ins of a whole
shard, and a kill -9 at any point resumed to the same output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.manifest import read_manifest, sha256_file
from shardkit.formats import available_formats
from shardkit.packing.pack import pack
from shardkit.packing.parts import MIN_PART, Joining, guided, split, split_last
from shardkit.packing.plan import ShardSpec
from shardkit.packing.sources import Item
from shardkit.packing.worker import ShardJob, encode_part
from shardkit.synthetic import make_sample_dataset, write_image

REPO = Path(__file__).resolve().parent.parent


def _job(index: int, count: int) -> ShardJob:
    items = tuple(Item(f"/src/{index}_{n}.jpg", f"{index}_{n}.jpg", f"{index}_{n}", None) for n in range(count))
    copies = {items[0].key: (Item("/src/copy.jpg", "copy.jpg", "copy", None),)} if items else {}
    spec = ShardSpec(index, f"shard-{index:06d}.tar", items)
    return ShardJob(spec, "/out", "webdataset", ResizeConfig(64), PackConfig("a", "b").encode, "plan", copies=copies)


def test_only_the_last_shards_are_split_each_into_near_equal_parts() -> None:
    sizes = [100, 100, 100, 4 * MIN_PART + 3, MIN_PART + 5]
    jobs = [_job(index, count) for index, count in enumerate(sizes)]
    handed = list(split_last(iter(jobs), workers=2))
    whole = [job for job in handed if job.part is None]
    assert [job.spec.number for job in whole] == [0, 1, 2, 4]  # (the last is too small to split)
    parts = [job for job in handed if job.part is not None]
    assert [(job.spec.number, job.part, job.parts) for job in parts] == [(3, number, 4) for number in range(4)]
    assert [item for job in parts for item in job.spec.items] == list(jobs[3].spec.items)
    assert {len(job.spec.items) for job in parts} <= {MIN_PART, MIN_PART + 1}
    assert parts[0].copies == jobs[3].copies and all(not job.copies for job in parts[1:])
    assert [job.spec.number for job in handed] == [0, 1, 2, 3, 3, 3, 3, 4]  # the plan's order kept
    # a plan of one shard, as a small folder's is: its parts shrink as it ends (the plan's last)
    one = list(split_last(iter([_job(0, 700)]), workers=2))
    assert [len(job.spec.items) for job in one] == [175, 175, 87, 87, 44, 44, 22, 22, 22, 22]
    assert [job.part for job in one] == list(range(10)) and {job.parts for job in one} == {10}
    assert [item for job in one for item in job.spec.items] == list(_job(0, 700).spec.items)


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_the_last_shards_parts_shrink_to_whole_rounds_of_at_least_min_part(workers: int) -> None:
    for count in range(0, 40 * MIN_PART):
        sizes = guided(count, workers)
        assert sum(sizes) == count
        if len(sizes) > 1:  # (else the shard goes whole)
            assert min(sizes) >= MIN_PART and max(sizes) <= max(count // (2 * workers), 2 * MIN_PART)
            assert sizes[-1] < 3 * MIN_PART  # the last part is small, whatever the count
        if count >= 2 * workers * MIN_PART:
            assert len(sizes) >= 2 * workers  # at least two rounds


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """162 files in 2 class folders, two of them broken."""
    folder = make_sample_dataset(tmp_path_factory.mktemp("parts") / "src", 160, classes=2, seed=3)
    (folder / "n00001001" / "zz_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")  # in the last part
    return folder


def _config(source: Path, out: Path, workers: int, **overrides: object) -> PackConfig:
    values: dict[str, object] = {"resize": ResizeConfig(48), "shard_size": 64, "workers": workers}
    values.update(overrides)
    return PackConfig(source=str(source), output=str(out), **values)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", available_formats())
def test_split_shards_are_the_bytes_of_whole_ones(source: Path, tmp_path: Path, name: str) -> None:
    one = pack(_config(source, tmp_path / "one", 1, format=name))
    three = pack(_config(source, tmp_path / "three", 3, format=name))
    assert one.shards == 3  # 64, 64, 34: with 3 workers every one is split (4, 4 and 2 parts)
    for shard, other in zip(
        read_manifest(tmp_path / "one").shards, read_manifest(tmp_path / "three").shards, strict=True
    ):
        assert (shard.name, shard.count, shard.bytes, shard.sha256) == (
            other.name,
            other.count,
            other.bytes,
            other.sha256,
        )
    assert one.manifest.settings["plan"] == three.manifest.settings["plan"]
    assert one.manifest.totals == three.manifest.totals
    assert one.errors == 2  # the sample's corrupt file and the broken one
    for file in ("errors.jsonl", *(f.name for f in (tmp_path / "one").iterdir() if f.suffix == ".idx")):
        assert (tmp_path / "one" / file).read_bytes() == (tmp_path / "three" / file).read_bytes()
    assert pq.read_table(tmp_path / "one" / "index.parquet").equals(pq.read_table(tmp_path / "three" / "index.parquet"))
    assert three.stage_seconds["decode"] > 0 and three.stage_seconds["write"] > 0  # the parts' stages counted
    assert (
        not any((tmp_path / "three" / ".shardkit").iterdir()) if (tmp_path / "three" / ".shardkit").exists() else True
    )


def test_a_copy_stands_in_for_a_failed_file_in_a_split_shard(tmp_path: Path) -> None:
    """img_060.jpg fails in its worker (its caption is not UTF-8) after --dedup kept it and left
    out img_061.jpg, its copy: the copy is packed in its place, in the shard's last part."""
    source = tmp_path / "src"
    source.mkdir()
    for number in range(70):
        write_image(source / f"img_{number:03d}.jpg", 40 + number, 36, seed=number)
    (source / "img_061.jpg").write_bytes((source / "img_060.jpg").read_bytes())
    (source / "img_060.txt").write_bytes(b"\xff\xfe not text")
    (source / "img_061.txt").write_text("the copy")
    one = pack(_config(source, tmp_path / "one", 1, shard_size=100, dedup="exact", sidecars=True))
    two = pack(_config(source, tmp_path / "two", 2, shard_size=100, dedup="exact", sidecars=True))
    assert read_manifest(tmp_path / "one").shards == read_manifest(tmp_path / "two").shards
    assert (tmp_path / "one" / "errors.jsonl").read_bytes() == (tmp_path / "two" / "errors.jsonl").read_bytes()
    assert one.manifest.totals == two.manifest.totals and two.records == 69
    keys = pq.read_table(tmp_path / "two" / "index.parquet", columns=["key"]).column("key").to_pylist()
    assert "img_061" in keys and "img_060" not in keys


def _pack_process(source: Path, out: Path, timeline: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "shardkit", "pack", str(source), str(out), "--resize", "48",
               "--shard-size", "64", "--workers", "2", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "SHARDKIT_TIMELINE": str(timeline)}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_the_tail_is_encoded_as_parts_on_the_workers(source: Path, tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.txt"
    process = _pack_process(source, tmp_path / "out", timeline)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    events = [line.split(" ", 2)[1:] for line in timeline.read_text().splitlines()]
    driver = {pid for pid, event in events if event == "main"}
    parts = {event.split(" ")[1] for pid, event in events if event.startswith("part ") and pid not in driver}
    # 64, 64, 34 records on 2 workers: the first whole, the last two in 4 and 2 parts
    assert parts == {f"shard-000001.tar:{n}" for n in range(4)} | {f"shard-000002.tar:{n}" for n in range(2)}
    assert any(event == "job shard-000000.tar" for _, event in events)


@pytest.mark.slow  # kills a process
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_kill_while_parts_are_joined_resumes_to_the_same_bytes(source: Path, tmp_path: Path, seed: int) -> None:
    clean, out, timeline = tmp_path / "clean", tmp_path / "out", tmp_path / "timeline.txt"
    assert _pack_process(source, clean, tmp_path / "clean.txt").wait(120) == 0
    process = _pack_process(source, out, timeline)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "part " not in (timeline.read_text() if timeline.exists() else ""):
        time.sleep(0.002)
    time.sleep([0.0, 0.05, 0.15][seed])  # as the parts are encoded, joined, put in place
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    resumed = _pack_process(source, out, tmp_path / "resumed.txt", "--resume")
    _, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert {s.name: s.sha256 for s in read_manifest(out).shards} == {
        s.name: s.sha256 for s in read_manifest(clean).shards
    }
    assert (out / "errors.jsonl").read_bytes() == (clean / "errors.jsonl").read_bytes()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.iterdir())


def _part_jobs(folder: Path, out: Path, format_name: str) -> list[ShardJob]:
    items = tuple(Item(str(path), path.name, path.stem, None) for path in sorted(folder.rglob("*.jpg"))[: 3 * MIN_PART])
    for folder in ("tmp", "done"):  # (what a pack's claim of the output makes)
        (out / ".shardkit" / folder).mkdir(parents=True)
    whole = ShardJob(
        ShardSpec(0, f"shard-000000{'.tar' if format_name == 'webdataset' else '.' + format_name}", items),
        str(out), format_name, ResizeConfig(48), PackConfig("a", "b").encode, "plan",
    )  # fmt: skip
    return list(split(whole, 2))


def test_a_tars_parts_are_written_by_their_workers_and_appended(source: Path, tmp_path: Path) -> None:
    """A tar's parts come back as files in the output's tmp folder, not as records through the
    pipe (15 ms a worker and 25 ms after the last part, of a 700-image pack); LMDB's and HDF5's
    records still come back. The driver appends them in order, and removes each as it goes."""
    jobs = _part_jobs(source, tmp_path / "out", "webdataset")
    assert len(jobs) == 3
    parts = [encode_part(job) for job in jobs]
    for part in parts:
        assert part.packed == [] and part.segment is not None and Path(part.segment.path).is_file()
    assert len({part.segment.path for part in parts if part.segment}) == 3  # (one worker, three names)
    joining = Joining()
    assert joining.add(jobs[2], parts[2]) is None and joining.add(jobs[0], parts[0]) is None
    result = joining.add(jobs[1], parts[1])
    assert result is not None and result.shard.count + len(result.errors) == 3 * MIN_PART
    assert list((tmp_path / "out" / ".shardkit" / "tmp").iterdir()) == []
    assert result.shard.sha256 == sha256_file(tmp_path / "out" / "shard-000000.tar")
    if "lmdb" in available_formats():
        lmdb_jobs = _part_jobs(source, tmp_path / "lmdb", "lmdb")
        assert all(encode_part(job).segment is None and encode_part(job).packed for job in lmdb_jobs[:1])


def test_parts_waiting_to_be_appended_are_removed_when_a_pack_fails(source: Path, tmp_path: Path) -> None:
    jobs = _part_jobs(source, tmp_path / "out", "webdataset")
    joining = Joining()
    assert joining.add(jobs[1], encode_part(jobs[1])) is None  # waits for part 0, which never comes
    assert len(list((tmp_path / "out" / ".shardkit" / "tmp").iterdir())) == 2  # the part, and the shard begun
    joining.abandon()
    assert list((tmp_path / "out" / ".shardkit" / "tmp").iterdir()) == []


@pytest.mark.slow  # mounts a tmpfs: needs root, else skipped with the reason
def test_a_part_the_driver_cannot_append_is_removed_all_the_same(source: Path, tmp_path: Path) -> None:
    """A full disk as the driver appends a part: one OutputError, and neither that part's file
    nor one waiting for it stays behind (the next run would clear them, a library caller's not)."""
    import errno
    import subprocess

    from shardkit.core.errors import OutputError
    from tests.test_faults import mount_tmpfs

    out = tmp_path / "out"
    mount_tmpfs(out, "2m")
    try:
        jobs = _part_jobs(source, out, "webdataset")
        parts = [encode_part(job) for job in jobs]
        with (out / "filler").open("wb") as filler:  # the rest of the disk
            try:
                while True:
                    filler.write(bytes(1 << 16))
                    filler.flush()
            except OSError as error:
                assert error.errno == errno.ENOSPC
        joining = Joining()
        assert joining.add(jobs[1], parts[1]) is None  # waits for part 0
        with pytest.raises(OutputError, match="no space left"):
            joining.add(jobs[0], parts[0])
        joining.abandon()
        tmp = out / ".shardkit" / "tmp"
        assert sorted(path.name for path in tmp.iterdir()) == [Path(parts[2].segment.path).name]  # type: ignore[union-attr]
    finally:
        subprocess.run(["umount", "-l", str(out)], check=False)


def test_the_live_error_count_takes_the_parts_failures(source: Path, tmp_path: Path) -> None:
    """The progress line counts each part's failures as it comes back, whichever way the part
    came (a tar's as a file, whose records no longer pass through the driver)."""
    seen: list[int] = []
    for name in available_formats():
        config = _config(source, tmp_path / name, 3, format=name)
        result = pack(config, progress=lambda _, __, errors: seen.append(errors))
        assert result.errors == 2 and seen[-1] == 2, name

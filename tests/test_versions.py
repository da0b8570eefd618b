"""`--keep-versions`: a change keeps the version it starts from whole in OUT/versions/vN (hard links:
no bytes copied), `open_shards(OUT, version=N)` reads it, verify passes on each, a remove is refused
where kept versions would keep the records it takes out, and a kill at any step of a change that
keeps versions finishes to the same bytes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.changes.append import append
from shardkit.changes.compact import compact
from shardkit.changes.remove import remove
from shardkit.checks.verify import verify
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.step_kills import every_step_finishes, hooked_env
from tests.test_pack_kills import snapshot


def _keys(out: Path, version: int | None = None) -> list[str]:
    return [sample.key for sample in open_shards(out, version=version, decode="bytes")]


def test_each_change_keeps_the_version_before_and_the_reader_reads_it(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    v1 = _keys(out)
    compact(out, shard_size=20, keep_versions=True)
    new = tmp_path / "new"
    for i in range(3):
        write_image(new / read_manifest(out).classes[0] / f"fresh_{i}.jpg", 80, 60, seed=40 + i)
    append(new, out, keep_versions=True)
    v3 = _keys(out)
    remove(out, v3[:2], reason="takedown", keep_versions=True)

    assert read_manifest(out).version == 4
    assert _keys(out, version=1) == v1 == _keys(out, version=2)
    assert _keys(out, version=3) == v3 and _keys(out, version=4) == _keys(out) == v3[2:]
    for version in (1, 2, 3):
        kept = out / "versions" / f"v{version}"
        assert read_manifest(kept).version == version
        report = verify(kept)
        assert report.ok, report.problems
    # a kept shard is the very file the output lists, where it still lists it: a link, not a copy
    now = {shard.name for shard in read_manifest(out).shards}
    shared = [s.name for s in read_manifest(out / "versions" / "v3").shards if s.name in now]
    assert shared and all(os.path.samefile(out / "versions" / "v3" / name, out / name) for name in shared)
    report = verify(out)
    assert report.ok and any("versions/" in note for note in report.notes), report.problems
    with pytest.raises(ConfigError, match=r"has no version 9 \(it is at version 4; kept: 1, 2, 3\)"):
        open_shards(out, version=9)
    with pytest.raises(ConfigError, match="version must be a version number"):
        open_shards(out, version=0)


def test_a_remove_is_refused_where_kept_versions_would_keep_the_records(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    compact(out, shard_size=20, keep_versions=True)
    before = read_manifest(out)
    with pytest.raises(OutputError, match="earlier versions are kept there"):
        remove(out, _keys(out)[:1], reason="takedown")
    assert read_manifest(out) == before
    shutil.rmtree(out / "versions")
    remove(out, _keys(out)[:1], reason="takedown")
    assert verify(out).ok


def test_a_version_in_the_way_is_refused_before_anything_is_written(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    (out / "versions" / "v1").mkdir(parents=True)
    before = snapshot(out)
    with pytest.raises(OutputError, match="is there already"):
        compact(out, shard_size=20, keep_versions=True)
    assert snapshot(out) == before and not (out / ".shardkit").exists()


@pytest.mark.slow  # kills a compact that keeps versions at each of its steps
def test_a_change_keeping_versions_killed_at_any_step_finishes_to_the_same_bytes(
    shardkit, packed_sample, tmp_path: Path
) -> None:
    source = packed_sample("webdataset", 64, 7)
    flags = ["--shard-size", "30", "--keep-versions"]
    clean, out = tmp_path / "clean", tmp_path / "out"
    shutil.copytree(source, clean)
    assert shardkit("compact", clean, *flags).returncode == 0

    def finish() -> subprocess.CompletedProcess[str]:
        resumed = shardkit("compact", out, "--resume")
        if resumed.returncode == 0 and read_manifest(out).version == 1:  # (killed before its journal)
            resumed = shardkit("compact", out, *flags)
        return resumed

    command = [sys.executable, "-m", "shardkit", "compact", str(out), *flags]
    failed = every_step_finishes(out, source, command, finish, snapshot(clean), tmp_path / "hook")
    assert not failed, "\n".join(failed)


def _compact_stopped_before_commit(out: Path, tmp_path: Path) -> None:
    """A compact --keep-versions of `out` killed once its next version is whole (before the commit)."""
    hook = tmp_path / "hook"
    command = [sys.executable, "-m", "shardkit", "compact", str(out), "--shard-size", "20", "--keep-versions"]
    env = hooked_env(hook, [out], at="replace out/.shardkit/change.json #2")
    done = subprocess.run(command, capture_output=True, text=True, env=env, start_new_session=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_a_link_planted_as_next_versions_is_refused(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    _compact_stopped_before_commit(out, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "v1").mkdir(parents=True)
    (elsewhere / "v1" / "precious.txt").write_text("mine")
    shutil.rmtree(out / ".shardkit" / "next" / "versions")
    (out / ".shardkit" / "next" / "versions").symlink_to(elsewhere)
    with pytest.raises(OutputError, match="is not shardkit's working folder"):
        compact(out, resume=True)
    assert (elsewhere / "v1" / "precious.txt").read_text() == "mine" and not (out / "versions").exists()


def test_a_kept_version_gone_from_the_working_folder_is_refused_at_commit(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    _compact_stopped_before_commit(out, tmp_path)
    shutil.rmtree(out / ".shardkit" / "next" / "versions")
    names = sorted(path.name for path in out.iterdir())
    with pytest.raises(OutputError, match="the version to keep is missing"):
        compact(out, resume=True)
    assert sorted(path.name for path in out.iterdir()) == names  # (nothing deleted)


def test_the_same_change_keeping_versions_or_not_is_another_change(packed_sample, tmp_path: Path) -> None:
    """A takedown killed while keeping versions is not finished by one that keeps none (the removed
    records would stay in the kept version unasked), nor the other way round."""
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    _compact_stopped_before_commit(out, tmp_path)
    with pytest.raises(OutputError, match="an interrupted 'compact' to version 2 is here"):
        compact(out, shard_size=20)
    compact(out, resume=True)
    assert (out / "versions" / "v1").is_dir() and verify(out).ok


def test_keep_versions_refuses_a_link_before_anything_is_written(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    shard = out / read_manifest(out).shards[-1].name
    moved = tmp_path / "moved.tar"
    shutil.move(shard, moved)
    shard.symlink_to(moved)
    with pytest.raises(OutputError, match="not a file shardkit wrote"):
        compact(out, shard_size=20, keep_versions=True)
    assert not (out / ".shardkit").exists()


def test_a_kept_version_is_read_not_changed(packed_sample, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(packed_sample("webdataset", 64, 7), out)
    compact(out, shard_size=20, keep_versions=True)
    with pytest.raises(OutputError, match="a version kept by --keep-versions"):
        remove(out / "versions" / "v1", _keys(out)[:1], reason="takedown", keep_versions=True)

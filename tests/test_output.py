"""The output folder: --overwrite deletes only what shardkit's own records name, source and output
never overlap, one pack at a time, and resume trusts exactly what it says it trusts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.errors import OutputError
from shardkit.core.manifest import read_manifest
from shardkit.packing.pack import pack
from shardkit.synthetic import write_image


def config(source: Path, output: Path, **overrides) -> PackConfig:
    values = {"resize": ResizeConfig(64), "shard_size": 16, "workers": 1}
    values.update(overrides)
    return PackConfig(source=str(source), output=str(output), **values)


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` (hidden ones too) with its bytes (None for folders)."""
    return {
        str(path.relative_to(folder)): None if path.is_dir() else path.read_bytes()
        for path in sorted(folder.rglob("*"))
    }


def shard_hashes(output: Path) -> dict[str, str]:
    return {shard.name: shard.sha256 for shard in read_manifest(output).shards}


def test_overwrite_removes_the_old_shards_and_nothing_else(sample_dataset: Path, tmp_path: Path) -> None:
    out, clean = tmp_path / "out", tmp_path / "clean"
    pack(config(sample_dataset, out, shard_size=8))  # 8 shards
    pack(config(sample_dataset, clean, shard_size=32))
    result = pack(config(sample_dataset, out, shard_size=32, overwrite=True))  # 2 shards
    assert result.shards == 2
    assert snapshot(out) == snapshot(clean)  # the 6 shards the new plan does not write are gone


@pytest.mark.parametrize("flag", ["overwrite", "resume"])
def test_user_files_in_the_output_are_never_touched(sample_dataset: Path, tmp_path: Path, flag: str) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    (out / "shard-notes.txt").write_text("mine")  # named like a shard, but no record names it
    (out / "shard-folder").mkdir()
    (out / "shard-folder" / "photo.jpg").write_bytes(b"precious")
    before = snapshot(out)
    with pytest.raises(OutputError, match="did not write"):
        pack(config(sample_dataset, out, shard_size=4, **{flag: True}))
    assert snapshot(out) == before


def test_a_folder_named_like_a_listed_shard_is_not_deleted(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    (out / "shard-000001.tar").unlink()
    (out / "shard-000001.tar").mkdir()  # the user's, whatever the manifest says
    (out / "shard-000001.tar" / "keep").write_text("x")
    with pytest.raises(OutputError, match=r"shard-000001\.tar"):
        pack(config(sample_dataset, out, overwrite=True))
    assert (out / "shard-000001.tar" / "keep").read_text() == "x"


@pytest.mark.parametrize("where", ["same", "out-inside-src", "src-inside-out"])
@pytest.mark.parametrize("flag", ["none", "overwrite"])
def test_source_and_output_must_not_overlap(tmp_path: Path, where: str, flag: str) -> None:
    root = tmp_path / "root"
    for i in range(3):
        write_image(root / "cls" / f"shard-{i}.jpg", 40, 30, seed=i)  # source files named like shards
    source, output = {
        "same": (root, root),
        "out-inside-src": (root, root / "cls" / "out"),
        "src-inside-out": (root / "cls", root),
    }[where]
    before = snapshot(root)
    with pytest.raises(OutputError, match="source"):
        pack(config(source, output, overwrite=flag == "overwrite"))
    assert snapshot(root) == before


def test_a_list_source_naming_files_in_the_output_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_image(out / "a.jpg", 40, 30)
    write_image(tmp_path / "b.jpg", 40, 30)
    listing = tmp_path / "list.txt"
    listing.write_text("b.jpg\nout/a.jpg\n")
    with pytest.raises(OutputError, match=r"did not write|holds the source file"):
        pack(config(listing, out, overwrite=True))
    assert (out / "a.jpg").exists()
    listing.write_text("b.jpg\nnew/c.jpg\n")  # a listed file under an output that is still empty
    with pytest.raises(OutputError, match="holds the source file"):
        pack(config(listing, tmp_path / "new"))
    assert not (tmp_path / "new").exists()


def test_resume_of_a_finished_pack_with_other_flags_is_refused(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    before = snapshot(out)
    with pytest.raises(OutputError, match="other settings"):
        pack(config(sample_dataset, out, shard_size=4, resume=True))
    assert snapshot(out) == before


def test_resume_of_a_finished_pack_with_the_same_flags_does_nothing(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    before = snapshot(out)
    result = pack(config(sample_dataset, out, resume=True))
    assert result.already_complete and result.records == 60
    assert snapshot(out) == before


def test_resume_notices_a_changed_source_file(sample_dataset: Path, tmp_path: Path) -> None:
    """Resume trusts each source file's size and mtime (nanoseconds), like rsync's quick check."""
    source = tmp_path / "src"
    for i in range(4):
        write_image(source / f"{i}.jpg", 50, 40, seed=i)
    out = tmp_path / "out"
    pack(config(source, out, shard_size=2))
    changed = source / "1.jpg"
    info = changed.stat()
    os.utime(changed, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    with pytest.raises(OutputError, match="other settings or inputs"):
        pack(config(source, out, shard_size=2, resume=True))


def test_damaged_shard_of_a_finished_pack_is_not_resumed(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack(config(sample_dataset, out))
    with (out / "shard-000002.tar").open("r+b") as shard:
        shard.seek(700)
        shard.write(b"X")
    with pytest.raises(OutputError, match=r"shard-000002\.tar: no longer what the manifest says"):
        pack(config(sample_dataset, out, resume=True))


KILLED_AT_RENAME = """
import os, signal, sys
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.packing.pack import pack

target, rename = sys.argv[3], os.replace

def replace(source, destination, *args, **kwargs):
    if os.path.basename(destination) == target:  # the temporary file is complete: die before the rename
        os.kill(os.getpid(), signal.SIGKILL)
    return rename(source, destination, *args, **kwargs)

os.replace = replace
pack(PackConfig(sys.argv[1], sys.argv[2], resize=ResizeConfig(64), shard_size=16, workers=1))
"""


@pytest.mark.parametrize("target", ["errors.jsonl", "manifest.json"])
@pytest.mark.parametrize("flag", ["resume", "overwrite"])
@pytest.mark.slow  # kills a process
def test_a_kill_during_the_final_writes_is_cleaned_up(sample_dataset: Path, tmp_path: Path, target, flag) -> None:
    clean, out = tmp_path / "clean", tmp_path / "out"
    pack(config(sample_dataset, clean))
    killed = subprocess.run([sys.executable, "-c", KILLED_AT_RENAME, str(sample_dataset), str(out), target])
    assert killed.returncode == -9
    assert list((out / ".shardkit").glob(f".{target}.*.tmp")), "no temporary file was left to clean"
    (out / ".manifest.json.k2j3h4.tmp").write_text("{")  # and one where shardkit < 0.2 left them
    pack(config(sample_dataset, out, **{flag: True}))
    assert snapshot(out) == snapshot(clean)


def test_refusals_leave_a_new_output_folder_uncreated(sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "new"
    with pytest.raises(OutputError):
        pack(config(sample_dataset, sample_dataset / "n00001000" / "new"))
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "user.txt").write_text("x")
    with pytest.raises(OutputError, match="not empty"):
        pack(config(sample_dataset, existing))
    assert snapshot(existing) == {"user.txt": b"x"}  # no .shardkit/ left behind
    assert not out.exists()


HOLDER = """
import sys, time
from shardkit.packing.folder_output import claim
claim(sys.argv[1], resume=False, overwrite=False)
print("held", flush=True)
time.sleep(60)
"""


def test_resume_of_a_finished_pack_says_so(shardkit, sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = ["pack", sample_dataset, out, "--resize", "32"]
    assert shardkit(*command).returncode == 0
    again = shardkit(*command, "--resume")
    assert again.returncode == 0 and "already complete" in again.stdout and "nothing to do" in again.stdout


@pytest.mark.slow  # kills a process
def test_a_second_pack_on_the_same_output_is_refused(python_command, sample_dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = subprocess.run(
            [*python_command, "pack", str(sample_dataset), str(out), "--resume"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 1
        assert (
            "another shardkit pack or remove is writing here" in second.stderr and f"pid {holder.pid}" in second.stderr
        )
        assert len(second.stderr.strip().splitlines()) == 1
    finally:
        holder.kill()
        holder.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the lock dies with its holder
        third = subprocess.run(
            [*python_command, "pack", str(sample_dataset), str(out), "--resume", "--resize", "32"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if third.returncode == 0:
            break
    assert third.returncode == 0, third.stderr
    assert not (out / ".shardkit").exists()


def test_a_planted_lock_link_never_writes_into_its_target(sample_dataset: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious.txt"
    precious.write_text("my precious data")
    for make in (os.symlink, os.link):
        out = tmp_path / f"out-{make.__name__}"
        (out / ".shardkit").mkdir(parents=True)
        make(precious, out / ".shardkit" / "lock")
        with pytest.raises(OutputError, match="lock file"):
            pack(config(sample_dataset, out, overwrite=True))
        assert precious.read_text() == "my precious data"


@pytest.mark.parametrize("record", ["manifest", "sealed manifest", "done marker", "clearing list"])
def test_crafted_records_cannot_make_other_files_deletable(sample_dataset: Path, tmp_path: Path, record: str) -> None:
    """The ledger names only shard-shaped files, from a manifest whose checksum holds."""
    from shardkit.core.manifest import Manifest, ShardInfo, write_json_atomic

    out = tmp_path / "out"
    (out / ".shardkit" / "done").mkdir(parents=True)
    (out / "thesis.docx").write_text("years of work")
    victim = ShardInfo("thesis.docx", 1, 13, "0" * 64)
    if record.endswith("manifest"):
        manifest = Manifest("webdataset", [victim], totals={"inputs": 1, "records": 1, "errors": 0})
        write_json_atomic(
            out / "manifest.json", (manifest.sealed() if record.startswith("sealed") else manifest).to_json()
        )
    elif record == "done marker":
        (out / ".shardkit" / "done" / "thesis.docx.json").write_text(json.dumps({"shard": {"name": "thesis.docx"}}))
    else:
        (out / ".shardkit" / "clearing.json").write_text(json.dumps(["thesis.docx"]))
    with pytest.raises(OutputError, match=r"thesis\.docx"):
        pack(config(sample_dataset, out, overwrite=True))
    assert (out / "thesis.docx").read_text() == "years of work"


@pytest.mark.parametrize("what", ["done/shard-000000.tar.json", "state.json"])
@pytest.mark.parametrize("kind", ["fifo", "link to /dev/zero"])
@pytest.mark.timeout(60)  # a wait on the FIFO or /dev/zero would be the failure
def test_special_files_in_the_working_folder_never_hang(shardkit, sample_dataset, tmp_path, what, kind):
    out = tmp_path / "out"
    target = out / ".shardkit" / what
    target.parent.mkdir(parents=True)
    os.mkfifo(target) if kind == "fifo" else os.symlink("/dev/zero", target)
    for flag in ("--resume", "--overwrite"):
        run = shardkit("pack", sample_dataset, out, "--resize", "32", flag)
        assert "Traceback" not in run.stderr and run.returncode in (0, 1), run.stderr
        if run.returncode == 0:
            break


def test_an_overwrite_killed_while_clearing_can_be_finished(sample_dataset: Path, tmp_path: Path) -> None:
    """Killed after the manifest was deleted: the list written before clearing still names the
    shards left, so a second --overwrite (or a --resume) is not refused."""
    out, clean = tmp_path / "out", tmp_path / "clean"
    pack(config(sample_dataset, clean, shard_size=32))
    pack(config(sample_dataset, out))
    names = sorted(p.name for p in out.iterdir())
    (out / ".shardkit").mkdir()
    (out / ".shardkit" / "clearing.json").write_text(json.dumps(names))
    (out / "manifest.json").unlink()  # where the kill struck
    (out / "shard-000000.tar").unlink()
    pack(config(sample_dataset, out, shard_size=32, overwrite=True))
    assert snapshot(out) == snapshot(clean)

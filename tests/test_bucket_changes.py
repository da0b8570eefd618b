"""Changes of an output in a bucket (remove, compact, pack --append), on a real SeaweedFS S3
server: each leaves the bucket holding exactly the files the same change leaves in a local folder,
byte for byte, with no journal or staged file behind; and a kill -9 after any request a remove
makes of the bucket, with the local mirror kept or lost (another machine), then the same remove
again or `--resume`, gives the bucket an uninterrupted remove gives. Between the two, the bucket is at the
earlier version or the new one: verify passes, or says the change was interrupted while it
committed, and a pack into the prefix is refused."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest

from shardkit import append
from shardkit.changes.compact import compact
from shardkit.changes.remove import remove
from shardkit.checks.verify import verify
from shardkit.core.config import PackConfig, ResizeConfig
from shardkit.core.errors import ConfigError, OutputError
from shardkit.core.manifest import read_manifest
from shardkit.packing.pack import pack
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.helpers import stored_records
from tests.warm_starts import WarmStarter

pytestmark = pytest.mark.slow  # (the S3 server starts once a session, a few seconds)

REASON = "takedown request 4711"
REPO = Path(__file__).resolve().parent.parent


def _objects(s3: Any, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` of the bucket `data`, by its name under the prefix."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    fs.invalidate_cache()
    return {path.removeprefix(f"data/{prefix}/"): fs.cat_file(path) for path in fs.find(f"data/{prefix}")}


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _upload(s3: Any, folder: Path, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for path in folder.iterdir():
        fs.put_file(str(path), f"data/{prefix}/{path.name}")
    return f"s3://data/{prefix}"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache (and so the mirror of each bucket output) of this test alone."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("SHARDKIT_CACHE", str(folder))
    return folder


def _keys(out: Path) -> list[str]:
    return [record.key for _, record in stored_records(out)]


@pytest.mark.parametrize("format", ["webdataset", "lmdb", "hdf5"])
def test_remove_compact_and_append_leave_a_bucket_as_they_leave_a_folder(
    s3, packed_sample, cache: Path, tmp_path: Path, format: str
) -> None:
    local = tmp_path / "local"
    shutil.copytree(packed_sample(format, 64, 7), local)
    url = _upload(s3, local, f"{tmp_path.name}-{format}")
    prefix = url.removeprefix("s3://data/")
    keys = _keys(local)
    taken = [keys[1], keys[3], *keys[14:21]]  # two of the first shard, all of the third
    gone = [record.data for _, record in stored_records(local) if record.key in taken]
    added, classes = tmp_path / "added", read_manifest(local).classes
    for number in range(9):
        write_image(added / classes[number % len(classes)] / f"new-{number}.jpg", 90 + number, 70, seed=number)

    for change in (
        lambda out: remove(out, taken, reason=REASON),
        lambda out: compact(out, shard_size=20),
        lambda out: append(str(added), out, key_prefix="week2/"),
    ):
        in_folder, in_bucket = change(local), change(url)
        assert in_bucket.version == in_folder.version
        assert _objects(s3, prefix) == _files(local)  # every file, byte for byte; nothing else
        assert verify(url).problems == []
    objects = _objects(s3, prefix)
    assert not any(data in blob for data in gone for blob in objects.values())
    assert [s.key for s in open_shards(url)] == [s.key for s in open_shards(local)]
    assert read_manifest(local).version == 4
    assert len(open_shards(url, version=4)) == len(open_shards(url))  # its own version is the one there is
    with pytest.raises(ConfigError, match=f"{url}: has no version 1 \\(it is at version 4; none kept"):
        open_shards(url, version=1)
    assert not (cache / "changes").exists() or not any((cache / "changes").iterdir())  # no mirror left


def test_versions_kept_in_a_bucket_are_the_folders_kept_versions(
    s3, packed_sample, cache: Path, tmp_path: Path
) -> None:
    """--keep-versions in a bucket: each version before a change copied whole into versions/vN/
    (server-side), the bucket holding what the same changes leave in a folder, byte for byte;
    each kept version reads and verifies as the output it was; a remove that would leave records
    in a kept version is refused unless it keeps versions too."""
    import s3fs

    local = tmp_path / "local"
    shutil.copytree(packed_sample("webdataset", 64, 7), local)
    url = _upload(s3, local, tmp_path.name)
    keys = _keys(local)
    added, classes = tmp_path / "added", read_manifest(local).classes
    for number in range(5):
        write_image(added / classes[number % len(classes)] / f"new-{number}.jpg", 90 + number, 70, seed=number)
    first = [s.key for s in open_shards(local)]
    for change in (
        lambda out: remove(out, keys[3:5], reason=REASON, keep_versions=True),
        lambda out: compact(out, shard_size=20, keep_versions=True),
        lambda out: append(str(added), out, key_prefix="week2/", keep_versions=True),
    ):
        assert change(url).version == change(local).version
        assert _objects(s3, tmp_path.name) == _files(local)  # versions/v1..v3 too, byte for byte
    for version in (1, 2, 3):
        assert verify(f"{url}/versions/v{version}").problems == []
        assert [s.key for s in open_shards(url, version=version)] == [
            s.key for s in open_shards(local, version=version)
        ]
    assert [s.key for s in open_shards(url, version=1)] == first
    with pytest.raises(ConfigError, match=f"{url}: has no version 7 \\(it is at version 4; kept: 1, 2, 3\\)"):
        open_shards(url, version=7)
    before = _objects(s3, tmp_path.name)
    with pytest.raises(OutputError, match=f"^{url}/versions/v2: a version kept by --keep-versions: read it, or"):
        compact(f"{url}/versions/v2", shard_size=30)
    with pytest.raises(OutputError, match=f"^{url}: keeps earlier versions \\(versions/, --keep-versions\\); move"):
        pack(PackConfig(str(added), url, resize=ResizeConfig(64), overwrite=True))
    with pytest.raises(OutputError, match=f"{url}/versions: earlier versions are kept there, and a remove would"):
        remove(url, keys[:1], reason=REASON)
    s3fs.S3FileSystem(**s3.options).pipe_file(f"data/{tmp_path.name}/versions/v4/stray", b"x")
    with pytest.raises(OutputError, match=f"{url}/versions/v4: is there already; move it away to keep version 4"):
        remove(url, keys[:1], reason=REASON, keep_versions=True)
    assert _objects(s3, tmp_path.name) == {**before, "versions/v4/stray": b"x"}
    # a planted journal naming an older kept version: taken over, it must not delete that version
    manifest = read_manifest(local)
    planted = {
        "action": "remove", "request": "x", "base": manifest.checksum, "version": 2, "plan": {},
        "moves": ["versions/v1", "manifest.json"], "deletes": [], "result": "", "uploaded": False, "owner": "x",
    }  # fmt: skip
    s3fs.S3FileSystem(**s3.options).pipe_file(f"data/{tmp_path.name}/.shardkit/change.json", json.dumps(planted))
    with pytest.raises(OutputError, match="damaged"):
        remove(url, resume=True)
    kept = {name: data for name, data in _objects(s3, tmp_path.name).items() if name.startswith("versions/v1/")}
    assert kept == {name: data for name, data in before.items() if name.startswith("versions/v1/")}


def test_refusals_in_a_bucket_come_before_any_change(s3, packed_sample, cache: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    shutil.copytree(packed_sample("webdataset", 64, 7), local)
    url = _upload(s3, local, tmp_path.name)
    before = _objects(s3, tmp_path.name)
    with pytest.raises(ConfigError, match="not in the output: 'nope'"):
        remove(url, ["nope"], reason=REASON)
    with pytest.raises(OutputError, match="no manifest"):
        compact(f"s3://data/{tmp_path.name}-empty", shard_size=20)
    assert _objects(s3, tmp_path.name) == before


def test_a_damaged_shard_in_the_bucket_is_refused_not_written_again(
    s3, packed_sample, cache: Path, tmp_path: Path
) -> None:
    import s3fs

    local = tmp_path / "local"
    shutil.copytree(packed_sample("webdataset", 64, 7), local)
    url = _upload(s3, local, tmp_path.name)
    first = read_manifest(local).shards[0].name
    data = bytearray((local / first).read_bytes())
    data[700] ^= 0xFF
    s3fs.S3FileSystem(**s3.options).pipe_file(f"data/{tmp_path.name}/{first}", bytes(data))
    with pytest.raises(OutputError, match=f"{first}: sha256 differs from the manifest"):
        remove(url, _keys(local)[:1], reason=REASON)
    assert json.loads(_objects(s3, tmp_path.name)["manifest.json"]) == json.loads((local / "manifest.json").read_text())


# --- a kill after each request a remove makes of the bucket -------------------------------------

_DRIVER = """
import os, signal, sys, json, threading
from shardkit.storage.store import Store
at, log = sys.argv[1], sys.argv[2]  # a count of requests, or the request after which to die
count, counting = [0], threading.Lock()
def hooked(method):
    original = getattr(Store, method)
    def call(self, name, *args):
        result = original(self, name, *args)
        # (named under the output: an append's pack is a Store of its own, under .shardkit/next/pack)
        step = f"{method} {self.child(args[0] if method in ('copy', 'upload') else name).removeprefix(out + '/')}"
        with counting:  # (requests made on several threads at once, a kept version's copies: line N is request N)
            count[0] += 1
            number = count[0]
            with open(log, "a") as steps:
                steps.write(step + "\\n")
        if str(number) == at or step == at:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    setattr(Store, method, call)
out = sys.argv[5] if sys.argv[3] == "append" else sys.argv[3]
for method in ("write", "upload", "copy", "delete", "delete_folder"):
    hooked(method)
if sys.argv[3] == "append":
    from shardkit.changes.append import append
    append(sys.argv[4], sys.argv[5], key_prefix="week2/", workers=2, resume=sys.argv[6] == "resume")
else:
    from shardkit.changes.remove import remove
    remove(sys.argv[3], json.loads(sys.argv[4]), reason=sys.argv[5], keep_versions=sys.argv[6:] == ["keep"])
"""


def _killed_remove(
    warm: WarmStarter, url: str, keys: list[str], at: int | str, log: Path, keep_versions: bool = False
) -> int:
    """A remove of `keys` from `url` in a process of its own, killed (SIGKILL) right after its
    `at`-th request that writes to the bucket (0: never), or after the request `at` names; its exit
    status."""
    argv = [str(at), str(log), url, json.dumps(keys), REASON, *(["keep"] if keep_versions else [])]
    run = warm.run(argv, {**os.environ, "PYTHONPATH": str(REPO)}, REPO, code=_DRIVER)
    assert run.returncode in (0, -signal.SIGKILL), run.stderr
    return run.returncode


def test_a_remove_killed_after_any_bucket_request_finishes_as_an_uninterrupted_one(
    s3, packed_sample, cache: Path, tmp_path: Path, warm: WarmStarter
) -> None:
    source = packed_sample("webdataset", 64, 7)
    keys = _keys(source)
    taken = [keys[2], keys[8], keys[9]]
    clean_log = tmp_path / "clean.log"
    clean = _upload(s3, source, f"{tmp_path.name}-clean")
    assert _killed_remove(warm, clean, taken, 0, clean_log) == 0
    expected = _objects(s3, f"{tmp_path.name}-clean")
    steps = clean_log.read_text().splitlines()
    assert steps[0] == "write .shardkit/change.json" and steps[-1] == "delete .shardkit/change.json"
    assert steps.count("write .shardkit/change.json") == 3  # begun, then uploading, then uploaded
    assert steps.index("upload .shardkit/next/manifest.json") < steps.index("copy manifest.json")
    old_manifest = (source / "manifest.json").read_bytes()

    for at in range(1, len(steps) + 1):
        prefix = f"{tmp_path.name}-at{at}"
        url = _upload(s3, source, prefix)
        assert _killed_remove(warm, url, taken, at, tmp_path / f"at{at}.log") == -signal.SIGKILL
        objects = _objects(s3, prefix)
        assert objects["manifest.json"] in (old_manifest, expected["manifest.json"]), steps[at - 1]
        if steps[at - 1] == f"upload {pack}/shardindex.json":  # its pack finishing: the workers put
            # each new shard up as they wrote it (their requests are not in the log)
            assert {f"{pack}/shard-000009.tar", f"{pack}/shard-000010.tar"} <= set(objects)
        report = verify(url)
        writes = steps[:at].count("write .shardkit/change.json")  # begun, uploading, uploaded
        journal_there = at < len(steps)
        if journal_there and writes == 3:  # committed: between two versions
            assert [p.kind for p in report.problems] == ["interrupted"], (steps[at - 1], report.problems)
            assert f"`shardkit remove {url} --resume` finishes it" in report.problems[0].detail
        else:
            assert report.problems == [], (steps[at - 1], report.problems)  # (its new shards are its own)
            assert any("began and has not committed" in note for note in report.notes) == journal_there
        if journal_there:
            with pytest.raises(OutputError, match="a change of it is unfinished"):
                pack(PackConfig(str(source), url, resize=ResizeConfig(64), overwrite=True))
        mirror_gone = at % 2 == 1  # another machine: no mirror of the killed run
        if mirror_gone:
            shutil.rmtree(cache, ignore_errors=True)
        if at == len(steps):  # killed once it was done
            if at % 3 == 0:
                assert not remove(url, resume=True).resumed
            else:  # the same remove finds none of the keys
                with pytest.raises(ConfigError, match=f"^{url}: 3 keys not in the output"):
                    remove(url, taken, reason=REASON)
        elif mirror_gone and writes < 3:  # begun elsewhere, not committed: taken over only when asked
            with pytest.raises(OutputError, match=r"began in another run .* with --resume takes it over"):
                remove(url, taken, reason=REASON)
            with pytest.raises(OutputError, match="began in another run"):
                compact(url, shard_size=20)
            assert remove(url, resume=True).resumed, steps[at - 1]
        elif at % 3 == 0:  # `--resume`: finishes from the mirror, or from the bucket's journal
            assert remove(url, resume=True).resumed, steps[at - 1]
        else:
            assert remove(url, taken, reason=REASON).resumed, steps[at - 1]
        assert _objects(s3, prefix) == expected, steps[at - 1]


def test_a_tampered_journal_in_the_bucket_is_refused_before_anything_is_deleted(
    s3, packed_sample, cache: Path, tmp_path: Path
) -> None:
    import s3fs

    source = packed_sample("webdataset", 64, 7)
    url = _upload(s3, source, tmp_path.name)
    victim = _upload(s3, source, f"{tmp_path.name}-victim")
    before = _objects(s3, f"{tmp_path.name}-victim")
    manifest = read_manifest(source)
    fs = s3fs.S3FileSystem(**s3.options)
    for moves, uploaded in ((["../" + tmp_path.name + "-victim/shard-000000.tar"], False), ([".."], True)):
        journal = {
            "action": "remove", "request": "x", "base": manifest.checksum, "version": 2, "plan": {},
            "moves": [*moves, "manifest.json"], "deletes": [], "result": "abc", "uploaded": uploaded, "owner": "x",
        }  # fmt: skip
        fs.pipe_file(f"data/{tmp_path.name}/.shardkit/change.json", json.dumps(journal).encode())
        for attempt in (lambda: remove(url, _keys(source)[:1], reason=REASON), lambda: remove(url, resume=True)):
            with pytest.raises(OutputError, match=r"/\.shardkit/change\.json: a journal naming files shardkit does not "
                               "write; delete it to abandon the change"):  # fmt: skip
                attempt()
        assert [p.kind for p in verify(url).problems] == ["interrupted"]  # (verify says the journal is damaged)
    assert _objects(s3, f"{tmp_path.name}-victim") == before and verify(victim).problems == []
    assert json.loads(_objects(s3, tmp_path.name)["manifest.json"]) == json.loads(
        (source / "manifest.json").read_text()
    )


def test_an_output_over_http_is_refused_and_two_spellings_share_one_mirror(cache: Path) -> None:
    from shardkit.changes.bucket import mirror_folder
    from shardkit.storage.store import Store

    with pytest.raises(ConfigError, match=r"^http://127\.0\.0\.1:9/out: an output read over HTTP takes no writes"):
        remove("http://127.0.0.1:9/out", ["a"], reason=REASON)
    same = {mirror_folder(Store(url)) for url in ("s3://data/out", "s3a://data/out", "s3://data//out/")}
    assert len(same) == 1 and mirror_folder(Store("s3://data/other")) not in same


def test_a_change_killed_twice_as_it_ends_leaves_no_journal_behind(
    s3, packed_sample, cache: Path, tmp_path: Path, warm: WarmStarter
) -> None:
    """Killed once committed (after the manifest is copied), then again after the run that finished it
    deleted the bucket's journal but before it cleared its mirror: the mirror's journal is of a
    change the bucket holds the result of, and must not be put back as a change begun."""
    source = packed_sample("webdataset", 64, 7)
    keys = _keys(source)
    taken = [keys[2], keys[8], keys[9]]
    clean = _upload(s3, source, f"{tmp_path.name}-clean")
    assert _killed_remove(warm, clean, taken, 0, tmp_path / "clean.log") == 0
    expected = _objects(s3, f"{tmp_path.name}-clean")
    url = _upload(s3, source, tmp_path.name)
    assert _killed_remove(warm, url, taken, "copy manifest.json", tmp_path / "first.log") == -signal.SIGKILL
    assert _killed_remove(warm, url, taken, "delete .shardkit/change.json", tmp_path / "second.log") == -signal.SIGKILL
    assert _objects(s3, tmp_path.name) == expected
    with pytest.raises(ConfigError, match="3 keys not in the output"):  # (done: nothing of it is left to do)
        remove(url, taken, reason=REASON)
    assert not remove(url, resume=True).resumed
    assert _objects(s3, tmp_path.name) == expected and verify(url).problems == []
    with pytest.raises(OutputError, match="holds a finished shardkit output"):  # (no change is unfinished)
        pack(PackConfig(str(source), url, resize=ResizeConfig(64)))


def test_the_mirrors_token_is_never_written_through_a_link(tmp_path: Path) -> None:
    from shardkit.changes.bucket import OWNER_NAME, _new_owner, _read_owner

    mirror, victim = tmp_path / "mirror", tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (mirror / ".shardkit").mkdir(parents=True)
    (mirror / ".shardkit" / OWNER_NAME).symlink_to(victim)
    assert _read_owner(mirror) == ""  # (a link is no token)
    owner = _new_owner(mirror)
    assert victim.read_text() == "precious\n" and _read_owner(mirror) == owner


def _ends_of_runs(steps: list[str]) -> list[int]:
    """The steps (1-based) that begin or end a run of requests of one kind in one folder (uploading
    four staged files, copying four shards): a kill inside such a run finds what a kill at its ends
    finds, in about two thirds of the time."""

    def kind(step: str) -> tuple[str, str]:
        method, name = step.split(" ", 1)
        return method, name.rpartition("/")[0]

    kinds = [None, *(kind(step) for step in steps), None]  # (kinds[at] is step at's)
    return [at for at in range(1, len(steps) + 1) if kinds[at] != kinds[at - 1] or kinds[at] != kinds[at + 1]]


def _killed_append(warm: WarmStarter, source: Path, url: str, at: int | str, log: Path, resume: bool = False) -> int:
    """An append of `source` to `url` in a process of its own (two workers), killed as
    `_killed_remove`'s remove is; its exit status."""
    argv = [str(at), str(log), "append", str(source), url, "resume" if resume else "-"]
    run = warm.run(argv, {**os.environ, "PYTHONPATH": str(REPO)}, REPO, code=_DRIVER)
    assert run.returncode in (0, -signal.SIGKILL), run.stderr
    return run.returncode


def test_an_append_killed_after_any_bucket_request_finishes_as_an_uninterrupted_one(
    s3, packed_sample, cache: Path, tmp_path: Path, warm: WarmStarter
) -> None:
    """The append packs into the bucket (its workers upload each new shard, as Ray tasks on other
    machines would), then commits: a kill after any request it makes of the bucket, with the
    mirror kept or lost, then the same append again or `--resume` (needed to take over from
    another machine), leaves the bucket as an uninterrupted append does, and nothing of its pack."""
    source = packed_sample("webdataset", 64, 7)
    added, classes = tmp_path / "added", read_manifest(source).classes
    for number in range(9):
        write_image(added / classes[number % len(classes)] / f"new-{number}.jpg", 90 + number, 70, seed=number)
    clean_log = tmp_path / "clean.log"
    clean = _upload(s3, source, f"{tmp_path.name}-clean")
    assert _killed_append(warm, added, clean, 0, clean_log) == 0
    expected = _objects(s3, f"{tmp_path.name}-clean")
    steps = clean_log.read_text().splitlines()
    found = next(re.search(r"\.shardkit/next/pack-[0-9a-f]{16}", step) for step in steps if "/next/pack-" in step)
    assert found is not None
    pack = found.group()  # (the append's pack: a prefix of its own)
    assert steps[-2:] == [f"delete_folder {pack}", "delete .shardkit/change.json"]
    old_manifest = (source / "manifest.json").read_bytes()

    for at in _ends_of_runs(steps):
        prefix = f"{tmp_path.name}-at{at}"
        url = _upload(s3, source, prefix)
        assert _killed_append(warm, added, url, at, tmp_path / f"at{at}.log") == -signal.SIGKILL
        objects = _objects(s3, prefix)
        assert objects["manifest.json"] in (old_manifest, expected["manifest.json"]), steps[at - 1]
        if steps[at - 1] == "upload .shardkit/next/pack/shardindex.json":  # its pack finishing: the
            # workers put each new shard up as they wrote it (their requests are not in the log)
            assert {".shardkit/next/pack/shard-000009.tar", ".shardkit/next/pack/shard-000010.tar"} <= set(objects)
        report = verify(url)
        writes = steps[:at].count("write .shardkit/change.json")  # begun, uploading, uploaded
        journal_there = writes > 0 and at < len(steps)
        if journal_there and writes == 3:  # committed: between two versions
            assert [p.kind for p in report.problems] == ["interrupted"], (steps[at - 1], report.problems)
            assert f"`shardkit pack {added} {url} --append" in report.problems[0].detail, report.problems[0].detail
        else:
            assert report.problems == [], (steps[at - 1], report.problems)  # (its pack is its own)
        mirror_gone = at % 2 == 1  # another machine: no mirror of the killed run
        if mirror_gone:
            shutil.rmtree(cache, ignore_errors=True)

        def again(resume: bool = False, url: str = url) -> Any:
            return append(str(added), url, key_prefix="week2/", workers=2, resume=resume)

        if mirror_gone and 0 < writes < 3:  # begun elsewhere, not committed: taken over only when asked
            with pytest.raises(OutputError, match=r"began in another run .* with --resume takes it over"):
                again()
            assert again(resume=True).resumed, steps[at - 1]
        elif at == len(steps):  # killed once it was done: nothing is new
            assert again(resume=at % 3 == 0).records == 0
        else:
            assert again(resume=at % 3 == 0).version == 2, steps[at - 1]
        assert _objects(s3, prefix) == expected, steps[at - 1]


def test_a_remove_keeping_versions_killed_after_bucket_requests_finishes_as_an_uninterrupted_one(
    s3, packed_sample, cache: Path, tmp_path: Path, warm: WarmStarter
) -> None:
    """With --keep-versions the commit first copies the version before into versions/v1/: a kill
    among those copies (or at the first and last request of each other kind), with the mirror
    kept or lost, then the same remove or `--resume`, leaves what an uninterrupted one leaves: the
    kept version whole, made once."""
    source = packed_sample("webdataset", 64, 7)
    keys = _keys(source)
    taken = [keys[2], keys[8], keys[9]]
    clean_log = tmp_path / "clean.log"
    clean = _upload(s3, source, f"{tmp_path.name}-clean")
    assert _killed_remove(warm, clean, taken, 0, clean_log, keep_versions=True) == 0
    expected = _objects(s3, f"{tmp_path.name}-clean")
    steps = clean_log.read_text().splitlines()
    copies = [at for at, step in enumerate(steps, 1) if step.startswith("copy ") and "versions/v1/" in step]
    assert steps[copies[-1] - 1] == "copy versions/v1/manifest.json"  # (the kept version's manifest last)
    assert steps[copies[-1]] == "upload .shardkit/next/manifest.json" or not steps[copies[-1]].startswith("copy")
    assert {name for name in expected if name.startswith("versions/v1/")} == {
        f"versions/v1/{name}" for name in _files(source)
    }
    for at in [*_ends_of_runs(steps), copies[len(copies) // 2]]:
        prefix = f"{tmp_path.name}-at{at}"
        url = _upload(s3, source, prefix)
        assert _killed_remove(warm, url, taken, at, tmp_path / f"at{at}.log", keep_versions=True) == -signal.SIGKILL
        writes = steps[:at].count("write .shardkit/change.json")
        if at % 2 == 1:  # another machine: no mirror of the killed run
            shutil.rmtree(cache, ignore_errors=True)
        if at == len(steps):
            assert not remove(url, resume=True).resumed
        elif at % 2 == 1 and writes < 3:  # begun elsewhere, not committed: taken over with --resume
            assert remove(url, resume=True).resumed, steps[at - 1]
        else:
            assert remove(url, taken, reason=REASON, keep_versions=True).resumed, steps[at - 1]
        assert _objects(s3, prefix) == expected, steps[at - 1]
        assert verify(f"{url}/versions/v1").problems == []


def test_an_abandoned_append_is_in_the_way_of_no_other_and_a_lost_shard_is_packed_again(
    s3, packed_sample, cache: Path, tmp_path: Path, warm: WarmStarter, shardkit
) -> None:
    """An append killed once its pack finished, then abandoned as its refusal says (the bucket's
    journal deleted, on another machine): another append begins, clears what the first left, and
    ends as on a clean bucket. And an append whose pack lost a shard object before its commit packs
    that shard again rather than commit without it."""
    import s3fs

    source = packed_sample("webdataset", 64, 7)
    added, classes = tmp_path / "added", read_manifest(source).classes
    for number in range(9):
        write_image(added / classes[number % len(classes)] / f"new-{number}.jpg", 90 + number, 70, seed=number)
    fs = s3fs.S3FileSystem(**s3.options)
    clean = _upload(s3, source, f"{tmp_path.name}-clean")
    append(str(added), clean, key_prefix="wk3/", workers=2)
    expected = _objects(s3, f"{tmp_path.name}-clean")

    url = _upload(s3, source, tmp_path.name)
    log = tmp_path / "first.log"
    assert _killed_append(warm, added, url, 0, log) == 0  # (its steps)
    url_log = tmp_path / "killed.log"
    again = _upload(s3, source, f"{tmp_path.name}-again")
    steps = log.read_text().splitlines()
    at = max(n for n, step in enumerate(steps, 1) if step.endswith("/manifest.json") and "/next/pack-" in step)
    assert _killed_append(warm, added, again, at, url_log) == -signal.SIGKILL  # (its pack finished)
    assert any("/next/pack-" in name for name in _objects(s3, f"{tmp_path.name}-again"))
    shutil.rmtree(cache, ignore_errors=True)  # (another machine)
    fs.rm_file(f"data/{tmp_path.name}-again/.shardkit/change.json")  # abandoned, as the refusal says
    append(str(added), again, key_prefix="wk3/", workers=2)  # another append
    assert _objects(s3, f"{tmp_path.name}-again") == expected

    lost = _upload(s3, source, f"{tmp_path.name}-lost")
    assert _killed_append(warm, added, lost, at, tmp_path / "lost.log") == -signal.SIGKILL
    pack = next(name for name in _objects(s3, f"{tmp_path.name}-lost") if name.endswith("shard-000010.tar"))
    fs.rm_file(f"data/{tmp_path.name}-lost/{pack}")
    result = append(str(added), lost, key_prefix="week2/", workers=2)  # (the same append, mirror kept)
    assert result.records == 9 and verify(lost).problems == []
    assert {name for name in _objects(s3, f"{tmp_path.name}-lost") if ".shardkit" in name} == set()

    # from another machine, the CLI's --resume takes the append over (its pack is kept: resumed)
    taken = _upload(s3, source, f"{tmp_path.name}-taken")
    assert _killed_append(warm, added, taken, at, tmp_path / "taken.log") == -signal.SIGKILL
    shutil.rmtree(cache, ignore_errors=True)
    flags = ("pack", added, taken, "--append", "--key-prefix", "week2/")
    refused = shardkit(*flags)
    assert refused.returncode == 1 and "began in another run" in refused.stderr, refused.stderr
    done = shardkit(*flags, "--resume")
    assert done.returncode == 0, done.stderr
    assert _objects(s3, f"{tmp_path.name}-taken") == _objects(s3, f"{tmp_path.name}-lost")

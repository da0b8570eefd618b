"""A bucket's prefix as a pack and probe source: trees made with Pillow, packed from a local folder
and from the same tree uploaded to a real SeaweedFS S3 server on loopback, must give the same
bytes, errors and census. No mocks."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shardkit.checks.verify import verify
from shardkit.core.config import EncodeConfig, ResizeConfig
from shardkit.core.errors import ShardkitError
from shardkit.core.pack_options import pack_config
from shardkit.packing.folder_output import claim
from shardkit.packing.pack import pack
from shardkit.packing.plan import ShardSpec
from shardkit.packing.probe import probe
from shardkit.packing.sources import walk
from shardkit.packing.worker import ShardJob, write_shard
from shardkit.synthetic import make_sample_dataset, write_image
from tests.servers import start_s3

pytestmark = pytest.mark.slow  # a real S3 server: `make test` runs these, `make test-fast` does not


def _classes(root: Path) -> None:
    make_sample_dataset(root, 14, classes=3, seed=3)  # a corrupt file and a name with a space among them
    (root / "notes.txt").write_text("not an image")
    (root / "docs").mkdir()
    (root / "docs" / "readme.txt").write_text("a folder with no image: no class")


def _flat(root: Path) -> None:
    for i, (name, size) in enumerate([("a.jpg", (64, 48)), ("b.png", (40, 70)), ("c.webp", (90, 30)),
                                      ("d.jpg", (120, 80)), ("e.JPG", (33, 65)), ("a.png", (50, 50))]):  # fmt: skip
        write_image(root / name, *size, seed=i)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    (root / "list.csv").write_text("a,b\n")


def _table(root: Path) -> None:
    rows = []
    for i in range(7):
        rel = f"{'cats' if i % 2 else 'dogs'}/{i}.jpg"
        write_image(root / rel, 40 + i, 60, seed=i)
        if i != 5:  # an image no row names
            rows.append({"file_name": rel, "text": f"caption {i}", "label": "cat" if i % 2 else "dog", "n": i})
    rows.append({"file_name": "../outside.jpg", "text": "climbs out"})
    (root / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def _sidecars(root: Path) -> None:
    write_image(root / "x.jpg", 64, 40, seed=1)
    (root / "x.txt").write_text("an x")
    (root / "x.cls").write_text("3")
    write_image(root / "sub" / "y.png", 30, 30, seed=2)
    (root / "sub" / "y.json").write_text('{"k": 1}')
    write_image(root / "z.jpg", 50, 50, seed=3)
    write_image(root / "z.seg.png", 50, 50, seed=4, gray=True)
    write_image(root / "bad.jpg", 20, 20, seed=5)
    (root / "bad.cls").write_text("not a number")
    (root / "w.txt").write_text("a caption with no image")


TREES: dict[str, tuple[Callable[[Path], None], dict[str, bool]]] = {
    "classes": (_classes, {}),
    "flat": (_flat, {}),
    "table": (_table, {}),
    "sidecars": (_sidecars, {"sidecars": True}),
}


def _put(s3, folder: Path, prefix: str) -> str:
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"data/{prefix}/{path.relative_to(folder).as_posix()}")
    return f"s3://data/{prefix}"


@pytest.fixture(scope="module")
def trees(s3, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each tree as a local folder and as the same objects under s3://data/src/<name>."""
    root = tmp_path_factory.mktemp("trees")
    made = {}
    for name, (build, _) in TREES.items():
        (root / name).mkdir()
        build(root / name)
        made[name] = (root / name, _put(s3, root / name, f"src/{name}"))
    return made


def _files(out: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir() if p.is_file()}


def _manifest(out: Path) -> dict:
    """The manifest less what names the source: its path, and the plan (it hashes files' mtimes)."""
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["checksum"], manifest["settings"]["source"]["path"], manifest["settings"]["plan"]
    return manifest


@pytest.mark.parametrize("tree", list(TREES))
def test_a_bucket_packs_to_the_bytes_of_the_same_local_folder(trees, tree: str, tmp_path: Path) -> None:
    folder, url = trees[tree]
    options = TREES[tree][1]
    outputs = {}
    for where, source in (("local", folder), ("bucket", url)):
        outputs[where] = tmp_path / where
        pack(pack_config(source, outputs[where], resize=48, shard_size=3, workers=1, **options))
    local, bucket = _files(outputs["local"]), _files(outputs["bucket"])
    del local["manifest.json"], bucket["manifest.json"]
    assert bucket == local and len(local) > 3  # every shard, index, .idx and errors.jsonl, byte for byte
    assert _manifest(outputs["bucket"]) == _manifest(outputs["local"])
    errors = (outputs["local"] / "errors.jsonl").read_text().splitlines()
    assert errors and (outputs["bucket"] / "errors.jsonl").read_text().splitlines() == errors


@pytest.mark.parametrize("tree", list(TREES))
def test_a_bucket_walk_is_the_folder_walk(trees, tree: str) -> None:
    folder, url = trees[tree]
    local, bucket = walk(folder, **TREES[tree][1]), walk(url, **TREES[tree][1])
    local_items, bucket_items = list(local.items), list(bucket.items)
    assert (bucket.layout, bucket.classes) == (local.layout, local.classes)
    assert [item[1:] for item in bucket_items] == [item[1:] for item in local_items]  # relpath, key, label...
    assert [item.path for item in bucket_items] == [f"{url}/{item.relpath}" for item in local_items]
    assert bucket.skipped == local.skipped


def _census(report) -> dict:
    found = report.to_json()
    for name in ("root", "seconds", "workers", "worker_kind", "header_bytes"):
        del found[name]
    return found


def test_probe_of_a_bucket_is_probe_of_the_folder(trees, shardkit, tmp_path: Path) -> None:
    for tree in ("classes", "table"):
        folder, url = trees[tree]
        remote, local = probe(url), probe(folder)
        assert _census(remote) == _census(local)
        assert remote.files > 5 and 0 < remote.header_bytes <= remote.bytes
        if tree == "classes":  # photo-sized files: only their headers were read, by range
            assert remote.header_bytes < remote.bytes / 4
    folder, url = trees["flat"]
    for where, source in (("local", folder), ("bucket", url)):
        done = shardkit("probe", source, "--json", tmp_path / f"{where}.json")
        assert done.returncode == 0, done.stderr
    local, remote = (json.loads((tmp_path / f"{where}.json").read_text()) for where in ("local", "bucket"))
    assert {key: value for key, value in remote.items() if key not in ("root", "seconds", "header_bytes")} == {
        key: value for key, value in local.items() if key not in ("root", "seconds", "header_bytes")
    }
    assert remote["files"] == 7 and remote["problems"]  # the broken JPEG, counted as locally


def test_an_object_gone_after_listing_is_one_read_error(s3, trees, tmp_path: Path) -> None:
    url = _put(s3, trees["flat"][0], "gone")
    items = list(walk(url).items)  # listed
    import s3fs

    s3fs.S3FileSystem(**s3.options).rm_file(items[2].path.removeprefix("s3://"))
    out = tmp_path / "out"
    held = claim(out, resume=False, overwrite=False)  # the output as a pack holds it
    job = ShardJob(ShardSpec(0, "shard-000000.tar", tuple(items)), str(out), "webdataset", ResizeConfig(48),
                   EncodeConfig(), "plan", storage_options={})  # fmt: skip
    try:
        result = write_shard(job)
    finally:
        held.release(undo=False)
    assert [error.to_json() for error in result.errors if error.stage == "read"] == [
        {"path": items[2].relpath, "stage": "read", "reason": "no such object"}
    ]
    assert result.shard.count == len(items) - 2  # the broken JPEG fails its header, as locally


def test_a_table_row_naming_a_deleted_object_is_an_errors_row(s3, trees, shardkit, tmp_path: Path) -> None:
    url = _put(s3, trees["table"][0], "deleted")
    import s3fs

    s3fs.S3FileSystem(**s3.options).rm_file("data/deleted/cats/3.jpg")
    done = shardkit("pack", url, tmp_path / "out", "--resize", "48", "--workers", "1")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "errors.jsonl").read_text().splitlines()]
    assert {"path": "cats/3.jpg", "stage": "read", "reason": "no such object"} in rows


def test_a_missing_or_imageless_prefix_is_refused_in_one_line(trees, shardkit, tmp_path: Path) -> None:
    for source, said in (
        ("s3://data/no-such-prefix", "s3://data/no-such-prefix: no such prefix"),
        ("s3://no-such-bucket/x", "s3://no-such-bucket/x: no such prefix"),
        (trees["classes"][1] + "/docs", f"{trees['classes'][1]}/docs: no images found"),
    ):
        done = shardkit("pack", source, tmp_path / "out", "--resize", "48")
        assert done.returncode == 1
        assert said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert not (tmp_path / "out").exists()  # refused before any work
    done = shardkit("probe", "s3://data/no-such-prefix")
    assert done.returncode == 1 and "no such prefix" in done.stderr and "Traceback" not in done.stderr


def test_storage_options_reach_the_source(s3, trees, monkeypatch, tmp_path: Path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name)
    _, url = trees["sidecars"]
    options = {**s3.options, "skip_instance_cache": True}  # not a cached client that has the keys
    out = tmp_path / "out"
    result = pack(pack_config(url, out, resize=48, workers=1, sidecars=True, storage_options=options))
    assert result.records == 3  # x, y and z (bad.jpg's label is no number)
    checked = verify(out, source=url, storage_options=options)  # every object packed or in errors.jsonl
    assert checked.ok, checked.problems
    denied = {**options, "secret": "wrong"}
    with pytest.raises(ShardkitError, match=r"^s3://data/src/sidecars: (access denied|listing failed)") as refused:
        walk(url, storage_options=denied)
    assert "\n" not in str(refused.value)


def test_a_url_table_in_a_bucket_packs_as_the_same_local_table(s3, tmp_path: Path, shardkit) -> None:
    """`pack s3://.../urls.csv OUT`: the table is an object, fetched, and its rows downloaded."""
    from http.server import BaseHTTPRequestHandler

    import s3fs

    from .servers import serving
    from .test_web_pack import _jpeg

    class Images(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            body = _jpeg(int(self.path.rsplit("/", 1)[-1].split(".")[0]))
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Images) as base:
        table = tmp_path / "urls.csv"
        table.write_text("url,caption\n" + "".join(f"{base}/{i}.jpg,row {i}\n" for i in range(7)))
        s3fs.S3FileSystem(**s3.options).put_file(str(table), "data/tables/urls.csv")
        local, remote = tmp_path / "local", tmp_path / "remote"
        assert shardkit("pack", table, local).returncode == 0
        done = shardkit("pack", "s3://data/tables/urls.csv", remote)
        assert done.returncode == 0, done.stderr
        missing = shardkit("pack", "s3://data/tables/none.csv", tmp_path / "none")
    assert _manifest(local) == _manifest(remote)
    files = _files(local)
    del files["manifest.json"]
    assert files.items() <= _files(remote).items()
    assert missing.returncode == 1 and "s3://data/tables/none.csv: no such table" in missing.stderr
    assert missing.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("through", ["direct", "fsspec"])
def test_an_object_replaced_between_its_header_and_its_body_is_read_whole_again(s3, through, tmp_path: Path) -> None:
    """Two versions of the same byte size (a size check alone cannot tell them apart), replaced
    after the worker's header range is served: the record is the new version whole."""
    import s3fs

    from shardkit.packing.reading import read_object

    fs = s3fs.S3FileSystem(**s3.options)
    old = write_image(tmp_path / "240x100.bmp", 240, 100, seed=1).read_bytes()
    new = write_image(tmp_path / "100x240.bmp", 100, 240, seed=2).read_bytes()
    assert len(old) == len(new) > 64 << 10 and old != new
    key = f"data/replaced/{through}.bmp"
    fs.pipe_file(key, old)
    # "version_aware" is an option that changes the request: the filesystem's own path, not the direct GET
    options = dict(s3.options) if through == "direct" else {**s3.options, "version_aware": False}
    data, header = read_object(f"s3://{key}", 1 << 24, options, between=lambda: fs.pipe_file(key, new))
    assert data == new
    assert (header.width, header.height) == (100, 240)
    fs.pipe_file(key, old)
    assert read_object(f"s3://{key}", 1 << 24, options)[0] == old  # (unchanged: read as before)


def _pack_killing_the_server(
    server, args: list[str], done: Path, window: int
) -> tuple[subprocess.CompletedProcess, float]:
    """`shardkit pack *args` as its own process, the server killed as soon as a shard is done (its
    marker in `done`): the finished process and the seconds from the kill to its exit."""
    env = {**os.environ, **server.env, "SHARDKIT_RETRY_SECONDS": str(window)}
    command = [sys.executable, "-m", "shardkit", "pack", *args, "--workers", "2", "--shard-size", "5"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not (done.is_dir() and any(done.iterdir())):
        assert process.poll() is None, "the pack ended before a shard was done"
        time.sleep(0.005)
    server.kill()
    killed = time.monotonic()
    try:
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:  # (a pack that outlasts the test is stopped with it)
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), time.monotonic() - killed


def _stopped_in_one_window(stopped: subprocess.CompletedProcess, after_kill: float, url: str, window: int) -> None:
    """The pack ended on the store out of reach: exit code 1 and one line naming `url`, the
    seconds its request waited (about one window, as the time from the kill to the exit says) and
    how to carry on."""
    lines = stopped.stderr.strip().splitlines()
    assert stopped.returncode == 1 and len(lines) == 1, stopped.stderr
    said = re.search(r"gave up after (\d+)s", lines[0])
    assert url in lines[0] and said is not None and "run the same command with --resume" in lines[0], lines[0]
    assert abs(int(said.group(1)) - window) <= 2 and abs(int(said.group(1)) - after_kill) < 2, (after_kill, lines[0])
    assert after_kill < 3 * window + 4, after_kill


def _images(folder: Path, count: int) -> Path:
    for i in range(count):
        write_image(folder / f"{i:03d}.jpg", 96, 64, seed=i)
    return folder


def test_a_source_bucket_killed_mid_pack_stops_the_pack_after_one_window(tmp_path: Path) -> None:
    """A store out of reach past the retry window stops the pack (its items are no one's failure)
    in about one window; --resume finishes it once the store is back, as a clean pack would."""
    window, source = 3, _images(tmp_path / "src", 150)
    server = start_s3(tmp_path / "weed")
    try:
        server.make_bucket("data")
        url, out = _put(server, source, "dead"), tmp_path / "out"
        stopped, after_kill = _pack_killing_the_server(server, [url, str(out)], out / ".shardkit" / "done", window)
        _stopped_in_one_window(stopped, after_kill, url, window)
        written = [out / "errors.jsonl", *(out / ".shardkit" / "done").glob("*.json")]
        assert not any("gave up" in path.read_text() for path in written if path.exists())

        server.start()
        env = {**os.environ, **server.env}
        resumed = subprocess.run([*stopped.args, "--resume"], env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        clean = tmp_path / "clean"
        command = [*stopped.args[:5], str(clean), *stopped.args[6:]]
        assert subprocess.run(command, env=env, capture_output=True, text=True, timeout=300).returncode == 0
        assert _files(out) == _files(clean) and _manifest(out) == _manifest(clean)
        assert not (out / ".shardkit").exists()
    finally:
        server.kill()


def test_an_output_bucket_killed_mid_pack_stops_the_pack_after_one_window(tmp_path: Path) -> None:
    """The other way: a local folder packed into a bucket whose server dies stops in about one
    window, with the same line, and --resume finishes it to a clean pack's objects."""
    window, source = 3, _images(tmp_path / "src", 150)
    server = start_s3(tmp_path / "weed")
    try:
        server.make_bucket("data")
        url, staging = "s3://data/out", tmp_path / "staging"
        args = [str(source), url, "--staging", str(staging)]
        stopped, after_kill = _pack_killing_the_server(server, args, staging / ".shardkit" / "done", window)
        _stopped_in_one_window(stopped, after_kill, url, window)

        server.start()
        env = {**os.environ, **server.env}
        resumed = subprocess.run([*stopped.args, "--resume"], env=env, capture_output=True, text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stderr
        command = [*stopped.args[:5], "s3://data/clean", "--staging", str(tmp_path / "clean"), *stopped.args[8:]]
        assert subprocess.run(command, env=env, capture_output=True, text=True, timeout=300).returncode == 0
        import s3fs

        fs = s3fs.S3FileSystem(**server.options)

        def objects(prefix: str) -> dict[str, str]:
            names = [name for name in fs.find(f"data/{prefix}") if not name.endswith("/manifest.json")]
            return {name.rpartition("/")[2]: hashlib.sha256(fs.cat_file(name)).hexdigest() for name in names}

        assert objects("out") == objects("clean") and objects("out")
    finally:
        server.kill()

"""Helpers the tests (and scripts/bench_probe.py) share that the library itself has no use for:
whole-list forms of what the library streams, kept here as references the streamed results are
compared with."""

from __future__ import annotations

import io
import math
import os
import random
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from shardkit.core.config import DEFAULT_MAX_PIXELS
from shardkit.core.errors import Failure
from shardkit.core.manifest import iter_errors, read_manifest
from shardkit.packing.probe import (
    CHUNK_FILES,
    PARALLEL_MIN_FILES,
    Census,
    ProbeRecord,
    ProbeReport,
    _probe_chunk,
    _records_from_rows,
    parallelism,
)
from shardkit.packing.sources import SourceList, walk
from shardkit.runtime.pools import map_local, map_threads


def discover(source: str | os.PathLike[str], labels: str = "auto") -> SourceList:
    """Every image under `source` (a folder or a list file) at once; `labels` is auto, folders or none."""
    found = walk(source, labels)
    if found.listed is not None:
        return found.listed
    items = list(found.items)
    return SourceList(found.root, found.layout, items, found.classes, found.skipped)


def image_files(source: str | os.PathLike[str]) -> tuple[list[str], list[str], list[Failure]]:
    """(paths, relative paths, skipped) of the images under a folder or in a list file."""
    found = discover(source, labels="none")
    return [item.path for item in found.items], [item.relpath for item in found.items], found.skipped


def read_errors(folder: str | Path) -> list[dict[str, str]]:
    """The rows of errors.jsonl; none when there is no file."""
    return list(iter_errors(folder))


def probe_records(
    paths: Sequence[str],
    relpaths: Sequence[str],
    *,
    workers: int | None = None,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    progress: Callable[[int], None] | None = None,
    min_parallel: int = PARALLEL_MIN_FILES,
) -> list[ProbeRecord]:
    """Probe a list of files in chunks across threads or processes; records in input order."""
    workers, kind = parallelism(len(paths), workers, min_parallel)
    chunk = max(256, min(CHUNK_FILES, math.ceil(len(paths) / (4 * workers))))
    jobs = [
        (list(paths[i : i + chunk]), list(relpaths[i : i + chunk]), max_pixels) for i in range(0, len(paths), chunk)
    ]
    parts: list[list[ProbeRecord]] = [[] for _ in jobs]
    mapper = map_threads if kind == "thread" else map_local
    for index, rows in mapper(_probe_chunk, jobs, workers):
        parts[index] = _records_from_rows(jobs[index][1], rows)
        if progress is not None:
            progress(len(rows))
    return [record for part in parts for record in part]


def summarize(records: Sequence[ProbeRecord], *, train_size: int = 224, root: str = "") -> ProbeReport:
    """The report of records already in hand (probe() builds the same one as it streams)."""
    census = Census()
    census.add(records)
    return census.report(train_size=train_size, root=root)


def bucket_objects(s3: Any, prefix: str) -> dict[str, bytes]:
    """Every object under `prefix` of the test server's bucket `data`, by its last name part."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3.options)
    fs.invalidate_cache()
    return {path.rsplit("/", 1)[-1]: fs.cat_file(path) for path in fs.find(f"data/{prefix}")}


def folder_files(folder: Path) -> dict[str, bytes]:
    """The files directly in `folder` (an output), by name."""
    return {path.name: path.read_bytes() for path in folder.iterdir() if path.is_file()}


def run_killing(
    command: list[str], checkpoint: Path, kills: int, seed: int, most_delay: float, env: dict[str, str] | None = None
) -> None:
    """Run `command` until it exits 0, killing it with SIGKILL `kills` times first, each at a random
    instant (up to `most_delay` s) after it has written `checkpoint` once more: a training loop
    stopped mid-step, as a preempted job is. Each kill must be what ended the run."""
    chance = random.Random(seed)
    done = 0
    while True:
        child = subprocess.Popen(command, env=env)
        if done < kills:  # once the loop is saving, kill it at a random instant of a step
            before = checkpoint.stat().st_mtime_ns if checkpoint.exists() else 0
            deadline = time.monotonic() + 60
            while child.poll() is None and time.monotonic() < deadline:
                if checkpoint.exists() and checkpoint.stat().st_mtime_ns != before:
                    time.sleep(chance.uniform(0, most_delay))
                    child.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.005)
        code = child.wait(timeout=120)
        if code == 0:
            break
        assert code == -signal.SIGKILL
        done += 1
    assert done == kills


def killed_then_resumed(
    pack_cli: Callable[..., subprocess.Popen[str]], source: Path, out: Path, clean: Path
) -> tuple[dict[str, str], dict[str, str]]:
    """A pack (`pack_cli(source, out, *extra)`) killed with SIGKILL once two shards are written,
    finished with --resume (which must reuse them), and the same pack run clean: the shards' sha256
    by name, of the resumed output and of the clean one."""
    process = pack_cli(source, out)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(out.glob("shard-*.tar"))) < 2:
        time.sleep(0.002)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(30)
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    resumed = pack_cli(source, out, "--resume")
    stdout, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    assert "reused from the earlier run" in stdout
    assert pack_cli(source, clean).wait(120) == 0
    return (
        {s.name: s.sha256 for s in read_manifest(out).shards},
        {s.name: s.sha256 for s in read_manifest(clean).shards},
    )


def raw_tar(path: Path, members: list[tuple[str, bytes]], format: int = tarfile.PAX_FORMAT) -> Path:
    """A tar written by Python's tarfile (a writer that is not ours), its members in the order given."""
    with tarfile.open(path, "w", format=format) as tar:
        for name, payload in members:
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def stored_records(out: Path) -> list[tuple[str, Any]]:
    """(shard name, Record) of every record of the output `out`, in stored order, read through
    each format's own reader (what the changes' tests compare before and after)."""
    from shardkit.formats import get_format

    manifest = read_manifest(out)
    backend = get_format(manifest.format)
    found: list[tuple[str, Any]] = []
    for shard in manifest.shards:
        reader = backend.reader(str(out / shard.name))
        try:
            found += [(shard.name, record) for record in reader]
        finally:
            reader.close()
    return found

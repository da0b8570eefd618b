"""The training input, side by side: RandomResizedCrop(224) + horizontal flip into uint8 batches of
64 on the same images and the same cores, round-robin, ratios against ImageFolder + torchvision in
the same run.

usage: python scripts/bench_train.py SRC [--copies 12] [--short 256] [--workers 2] [--rounds 5]
                                         [--peers-python /path/to/venv/bin/python] [--only WORD ...]

SRC is a folder of JPEGs (ImageNet's `n01440764_tench.JPEG` naming gives the classes). They are
resized to short side --short (quality 90, like a pre-resized ImageNet), hard-linked --copies times
into an ImageFolder tree, and packed with `--encode original` (the shards hold the very same bytes).
Each round runs every method for one epoch in a fresh process, after a warm-up epoch and a full garbage
collection there (the first after the imports: one-time, ~150 ms with torchvision loaded; worker
start-up, JIT and page cache are not timed):

  folder: ImageFolder + torchvision v2    DataLoader(num_workers=W, persistent), PIL decode, v2 crop/flip
                                          on the PIL image (Pillow-SIMD's resize), PILToTensor; and the
                                          same with v2 on tensors (ToImage first, as torchvision's own
                                          reference scripts do)
  shards: .iterable() + torchvision v2    the same transforms on open_shards(..., decode="pil")
  shards: loader (crop-decode)            ds.loader(64, 224, crop="random", flip=True, workers=W)
  raw shards: loader (no decode)          the same loader on the same images packed `--encode raw`
                                          (uint8 .npy records: the crop window read from the record)
  ... loader, stats off                   the same two with loader(stats=False): what loader.stats()'s
                                          timing costs (--only "loader" compares them)
  raw shards: memcpy of the records       every raw record copied whole into a buffer on W threads,
                                          nothing else: memory speed for these bytes (best of 5)
  kernel alone, 1 thread (x W) / W threads  the crop-decode kernel on the same windows, no pipeline:
                                          (raw kernel alone: the same on the raw records)
                                          the limit the loader is measured against; the records
                                          in a shuffled order, as the loader's epoch has them (the
                                          shards hold each photo's copies side by side, and
                                          decoding one JPEG again and again ran 5% faster)
  FFCV, DALI (with --peers-python)        FFCV's Loader (RandomResizedCropRGBImageDecoder) on a .beton
                                          of the folder; DALI's CPU pipeline (webdataset reader on our
                                          tars, decoders.image_random_crop, resize, flip); W threads

Peers need their own venv (ffcv, nvidia-dali-cuda120, torch). Prints images/s per round and the
median of the per-round ratios against the first method.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchkit import compiled, jpeg_files, link_classes, pythonpath_env, ratios, span, warm

EPOCH = """
import gc, json, sys, time
import torch
from torch.utils.data import DataLoader
from torchvision.transforms import v2
method, folder, shards = sys.argv[1:4]
workers, batch, size = (int(value) for value in sys.argv[4:7])
torch.set_num_threads(1)
crop = v2.Compose([v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(), v2.PILToTensor()])
if method.startswith("folder"):
    from torchvision.datasets import ImageFolder
    if method == "folder-tensors":  # the recipe of torchvision's reference scripts: v2 on tensors
        crop = v2.Compose([v2.ToImage(), v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip()])
    data = ImageFolder(folder, transform=crop)
    batches = DataLoader(data, batch_size=batch, shuffle=True, num_workers=workers, persistent_workers=True)
elif method == "iterable":
    from shardkit.readers import open_shards
    def transform(sample):
        return crop(sample.image), sample.label
    data = open_shards(shards, decode="pil", shuffle=True, transform=transform).iterable()
    batches = DataLoader(data, batch_size=batch, num_workers=workers, persistent_workers=True)
else:
    from shardkit.readers import open_shards
    stats = method != "loader-stats-off"  # (loader.stats()'s timing, on by default: its cost is measured)
    batches = open_shards(shards, shuffle=True).loader(batch, size, crop="random", flip=True, workers=workers,
                                                       stats=stats)
def epoch():
    count, started = 0, time.perf_counter()
    for images, labels in batches:
        assert images.dtype == torch.uint8 and images.shape[1:] == (3, size, size), images.shape
        count += len(labels)
    return count / (time.perf_counter() - started)
epoch()  # warm-up: worker start-up, page cache
gc.collect()  # the interpreter's first full collection after the imports (~150 ms with torchvision) is a
# one-time cost: it must not land in the one timed epoch of one method and not another's
print(json.dumps(epoch()))
"""

MEMCPY = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from shardkit.readers import open_shards
shards, threads = sys.argv[1], int(sys.argv[2])
dataset = open_shards(shards, decode="bytes")
datas = [np.frombuffer(record.data, np.uint8) for shard in range(len(dataset.manifest.shards))
         for record in dataset.records(shard)]
outs = [np.empty(max(len(d) for d in datas), np.uint8) for _ in range(threads)]
def part(worker):
    out = outs[worker]
    for data in datas[worker::threads]:
        np.copyto(out[:len(data)], data)  # (numpy releases the GIL for the copy)
def run():
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))
    return len(datas) / (time.perf_counter() - started)
run()
print(json.dumps(max(run() for _ in range(5))))
"""

KERNEL = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from shardkit.core import _crop
from shardkit.readers.windows import random_resized_boxes
from shardkit.core.headers import jpeg_size
from shardkit.readers import open_shards
shards, size, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dataset = open_shards(shards, decode="bytes")
datas = [record.data for shard in range(len(dataset.manifest.shards)) for record in dataset.records(shard)]
# in a shuffled order, as the loader reads them: in the shards' order a photo's --copies lie side by
# side, and one JPEG decoded 12 times running measured 5% faster than the same images shuffled
datas = [datas[i] for i in np.random.default_rng(1).permutation(len(datas))]
raw = datas[0][:6] == b"\\x93NUMPY"  # raw records: the same passes with nothing decoded
if raw:
    from shardkit.readers.decode import npy_layout
    layouts = np.array([npy_layout(data, 1 << 40)[:3] for data in datas], np.int64)  # offset, width, height
    sizes = layouts[:, 1:3]
else:
    sizes = np.array([jpeg_size(data) for data in datas])
boxes = random_resized_boxes(sizes[:, 0], sizes[:, 1], np.random.default_rng(0))
flips = (np.arange(len(datas)) % 2).astype(np.uint8)
outs = [np.empty((64, size, size, 3), np.uint8) for _ in range(threads)]
def part(worker):
    for first in range(64 * worker, len(datas), 64 * threads):
        chunk = datas[first:first + 64]
        window = (boxes[first:first + len(chunk)].copy(), flips[first:first + len(chunk)].copy(),
                  np.arange(len(chunk), dtype=np.int32), outs[worker], size, size, 1 << 40)
        if raw:
            _crop.crop_raw_batch(chunk, layouts[first:first + len(chunk)].copy(), *window)
        else:
            _crop.decode_batch(chunk, *window)
def run():
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(part, range(threads)))
    return len(datas) / (time.perf_counter() - started)
run()
print(json.dumps(run()))
"""

PEERS = r"""
import gc, json, math, os, sys, time
method, folder, tars, workers, batch, size, beton = sys.argv[1:8]
workers, batch, size = int(workers), int(batch), int(size)
if method == "ffcv":
    from ffcv.fields.decoders import IntDecoder, RandomResizedCropRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToTensor
    if not os.path.exists(beton):
        from ffcv.fields import IntField, RGBImageField
        from ffcv.writer import DatasetWriter
        from torchvision.datasets import ImageFolder
        writer = DatasetWriter(beton, {"image": RGBImageField(write_mode="jpg", jpeg_quality=90), "label": IntField()},
                               num_workers=workers)
        writer.from_indexed_dataset(ImageFolder(folder))
    loader = Loader(beton, batch_size=batch, num_workers=workers, order=OrderOption.RANDOM, pipelines={
        "image": [RandomResizedCropRGBImageDecoder((size, size)), RandomHorizontalFlip(), ToTensor()],
        "label": [IntDecoder(), ToTensor(), Squeeze()]})
    def epoch():
        count, started = 0, time.perf_counter()
        for images, labels in loader:
            count += images.shape[0]
        return count / (time.perf_counter() - started)
else:
    from nvidia.dali import fn, pipeline_def, types
    paths = sorted(os.path.join(tars, name) for name in os.listdir(tars) if name.endswith(".tar"))
    @pipeline_def(batch_size=batch, num_threads=workers, device_id=None, seed=1)
    def pipe():
        jpg, label = fn.readers.webdataset(paths=paths, ext=["jpg", "cls"], random_shuffle=True, name="R")
        images = fn.decoders.image_random_crop(jpg, device="cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=size, resize_y=size)
        return fn.flip(images, horizontal=fn.random.coin_flip()), label
    pipeline = pipe()
    pipeline.build()
    steps = math.ceil(pipeline.epoch_size("R") / batch)
    def epoch():
        count, started = 0, time.perf_counter()
        for _ in range(steps):
            images, labels = pipeline.run()
            images.as_tensor()
            count += len(images)
        return count / (time.perf_counter() - started)
epoch()
gc.collect()
print(json.dumps(epoch()))
"""


def build(source: Path, root: Path, copies: int, short: int) -> tuple[Path, Path]:
    """An ImageFolder tree of `copies` x the source JPEGs at short side `short`, and its shards."""
    from PIL import Image

    base, folder = root / "base", root / "folder"
    base.mkdir()
    for path in jpeg_files(source):
        with Image.open(path) as image:
            image = image.convert("RGB")
            scale = short / min(image.size)
            image = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
            image.save(base / (path.stem + ".jpg"), quality=90)
    link_classes(base, folder, copies)
    shards = root / "shards"
    subprocess.run([sys.executable, "-m", "shardkit", "pack", str(folder), str(shards), "--encode", "original",
                    "--shard-size", "500"], check=True, capture_output=True, env=pythonpath_env())  # fmt: skip
    return folder, shards


def build_raw(folder: Path, root: Path) -> Path:
    """The same images as raw pixels (`--encode raw --resize none`: the very pixels the JPEGs decode to)."""
    shards = root / "shards-raw"
    subprocess.run([sys.executable, "-m", "shardkit", "pack", str(folder), str(shards), "--encode", "raw",
                    "--resize", "none", "--shard-size", "500"], check=True, capture_output=True,
                   env=pythonpath_env())  # fmt: skip
    return shards


def summary(report: dict[str, dict[str, Any]], rates: dict[str, list[float]], workers: int) -> None:
    """The loader against its kernel alone, and the raw loader against a memcpy, where those ran."""
    loader_name, raw_name = "shards: loader (crop-decode)", "raw shards: loader (no decode)"
    kernel_name, single_name = f"kernel alone, {workers} threads", f"kernel alone, 1 thread (x {workers})"
    copy_name, raw_kernel_name = (
        f"raw shards: memcpy of the records, {workers} thr.",
        f"raw kernel alone, 1 thread (x {workers})",
    )
    ran = set(report)
    if {loader_name, kernel_name} <= ran:
        per_round = ratios(rates[loader_name], rates[kernel_name])
        print(f"loader at {report[loader_name]['median'] / report[kernel_name]['median']:.0%} of the kernel alone on "
              f"{workers} threads (per round {statistics.median(per_round):.0%} {span(per_round)})")  # fmt: skip
    if {loader_name, single_name} <= ran:
        print(f"loader at {report[loader_name]['median'] / report[single_name]['median']:.0%} of {workers} x the "
              f"kernel's single-thread rate")  # fmt: skip
    if {raw_name, loader_name, copy_name} <= ran:
        raw, copy = report[raw_name]["median"], report[copy_name]["median"]
        per_round = ratios(rates[raw_name], rates[loader_name])
        print(f"raw-record loader / JPEG loader: {statistics.median(per_round):.2f}x {span(per_round)}; "
              f"raw loader at {raw / copy:.0%} of a memcpy of its records")  # fmt: skip
    if {raw_name, raw_kernel_name, single_name} <= ran:
        raw, raw_kernel, single = (report[name]["median"] for name in (raw_name, raw_kernel_name, single_name))
        print(f"raw kernel alone: {raw_kernel / workers:,.0f} images/s on one thread "
              f"({raw_kernel / single:.2f}x the JPEG kernel's); the raw loader at {raw / raw_kernel:.0%} of "
              f"{workers} x it")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--copies", type=int, default=12)
    parser.add_argument("--short", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peers-python", help="a venv's python with ffcv and nvidia-dali")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="WORD",
        help="run only the methods whose names contain one of these words (the first is the baseline)",
    )
    args = parser.parse_args()
    compiled()
    with tempfile.TemporaryDirectory(prefix="shardkit-train-") as temp:
        root = Path(temp)
        folder, shards = build(args.source, root, args.copies, args.short)
        raw_shards = build_raw(folder, root)
        images = sum(1 for _ in folder.rglob("*.jpg"))
        common = [str(args.workers), str(args.batch), str(args.size)]
        methods = {
            "folder: ImageFolder + torchvision v2": [sys.executable, "-c", EPOCH, "folder", str(folder), str(shards),
                                                    *common],
            "folder: same, v2 on tensors (ToImage 1st)": [sys.executable, "-c", EPOCH, "folder-tensors", str(folder),
                                                         str(shards), *common],
            "shards: .iterable() + torchvision v2": [sys.executable, "-c", EPOCH, "iterable", str(folder), str(shards),
                                                     *common],
            "shards: loader (crop-decode)": [sys.executable, "-c", EPOCH, "loader", str(folder), str(shards), *common],
            "raw shards: loader (no decode)": [sys.executable, "-c", EPOCH, "loader", str(folder), str(raw_shards),
                                               *common],
            "shards: loader, stats off": [sys.executable, "-c", EPOCH, "loader-stats-off", str(folder), str(shards),
                                          *common],
            "raw shards: loader, stats off": [sys.executable, "-c", EPOCH, "loader-stats-off", str(folder),
                                              str(raw_shards), *common],
            f"raw shards: memcpy of the records, {args.workers} thr.": [sys.executable, "-c", MEMCPY, str(raw_shards),
                                                                          str(args.workers)],
            f"kernel alone, 1 thread (x {args.workers})": [sys.executable, "-c", KERNEL, str(shards), str(args.size),
                                                           "1"],
            f"kernel alone, {args.workers} threads": [sys.executable, "-c", KERNEL, str(shards), str(args.size),
                                                      str(args.workers)],
            f"raw kernel alone, 1 thread (x {args.workers})": [sys.executable, "-c", KERNEL, str(raw_shards),
                                                               str(args.size), "1"],
        }  # fmt: skip
        if args.peers_python:
            beton = str(root / "folder.beton")
            for peer in ("ffcv", "dali"):
                name = "FFCV (.beton of the folder)" if peer == "ffcv" else "DALI CPU (our tars)"
                methods[name] = [args.peers_python, "-c", PEERS, peer, str(folder), str(shards), *common, beton]
        if args.only:
            methods = {name: command for name, command in methods.items() if any(word in name for word in args.only)}
        rates: dict[str, list[float]] = {name: [] for name in methods}
        for round_number in range(args.rounds):
            order = list(methods) if round_number % 2 == 0 else list(reversed(methods))
            for name in order:
                warm(folder, shards, raw_shards)
                done = subprocess.run(methods[name], capture_output=True, text=True, env=pythonpath_env())
                if done.returncode != 0:
                    raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
                rate = json.loads(done.stdout.strip().splitlines()[-1])
                single_thread = name.startswith(("kernel alone, 1 thread", "raw kernel alone, 1 thread"))
                rates[name].append(rate * (args.workers if single_thread else 1))
            print(f"round {round_number + 1}/{args.rounds}: " + ", ".join(f"{rates[n][-1]:,.0f}" for n in methods),
                  file=sys.stderr)  # fmt: skip
        baseline = rates[next(iter(methods))]
        print(f"{images} images at short side {args.short} (JPEG q90), batches of {args.batch} x {args.size}^2 uint8, "
              f"{args.workers} workers/threads, {os.cpu_count()} cores, {args.rounds} rounds")  # fmt: skip
        print(f"{'method':<42} {'images/s':>10} {'range':>15} {'vs folder':>10}")
        report = {}
        for name in methods:
            ratio = ratios(rates[name], baseline)
            median = statistics.median(rates[name])
            report[name] = {"images_per_second": rates[name], "median": median, "ratio": statistics.median(ratio)}
            print(f"{name:<42} {median:>10,.0f} {min(rates[name]):>7,.0f}-{max(rates[name]):<7,.0f} "
                  f"{statistics.median(ratio):>9.2f}x {span(ratio)}")  # fmt: skip
        summary(report, rates, args.workers)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

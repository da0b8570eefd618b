"""What masks and boxes cost the batch loader: images/s of ds.loader with mask= and boxes= against
the same loader without them, over the same output, in the same run.

usage: python scripts/bench_targets.py [--rounds 5] [--size 224] [--workers 2] [--batch 64] [--copies 2]
           [--resize 256] [--json out.json]

The 300-photo ImageNet sample beside the checkout (generated 500x375 images when it is missing), --copies
times, each with a label map (x.seg.png: four rectangles and an ellipse, classes 1..5) and five COCO xywh
boxes in x.json's objects.bbox, packed by --sidecars as webdataset at --resize (short side). Passes:
plain (no targets: the baseline), boxes, mask, and mask+boxes; each a full epoch of ds.loader(--batch,
--size, crop="random", flip=True, workers=--workers, output="numpy") on a dataset opened anew. The
shards are read once, untimed, before each round (page cache); the passes run in a rotated order each
round. Printed: each pass's median images/s, and the median of its per-round ratios to plain with
their range (benchkit.ratios: the machine is shared, so only numbers of one round are compared).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchkit import SAMPLE, environment, jpeg_files, ratios, span, warm
from PIL import Image, ImageDraw, ImageOps

from shardkit import PackConfig, ResizeConfig, open_shards, pack
from shardkit.core.version import __version__
from shardkit.synthetic import write_image

PASSES: dict[str, dict[str, Any]] = {
    "plain": {},
    "boxes": {"boxes": "objects.bbox"},
    "mask": {"mask": "seg.png"},
    "mask+boxes": {"mask": "seg.png", "boxes": "objects.bbox"},
}


def build_source(root: Path, copies: int) -> Path:
    """Sidecar samples: each photo (or a generated image), its label map and its boxes."""
    photos = jpeg_files(SAMPLE)
    if not photos:
        photos = [write_image(root / "generated" / f"g{i:03d}.jpg", 500, 375, seed=i) for i in range(300)]
    source = root / "src"
    source.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for copy in range(copies):
        for n, photo in enumerate(photos):
            stem = source / f"c{copy}_{n:04d}"
            shutil.copyfile(photo, f"{stem}.jpg")
            with Image.open(photo) as opened:
                width, height = ImageOps.exif_transpose(opened).size
            mask = Image.new("L", (width, height), 0)
            draw = ImageDraw.Draw(mask)
            boxes = []
            for label in range(1, 6):
                w, h = int(rng.integers(width // 8, width // 2)), int(rng.integers(height // 8, height // 2))
                x, y = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
                (draw.ellipse if label == 5 else draw.rectangle)((x, y, x + w - 1, y + h - 1), fill=label)
                boxes.append([x, y, w, h])
            mask.save(f"{stem}.seg.png")
            Path(f"{stem}.json").write_text(json.dumps({"objects": {"bbox": boxes, "category": [1, 2, 3, 4, 5]}}))
    return source


def epoch(output: Path, options: dict[str, Any], args: argparse.Namespace) -> float:
    """Images/s of one full epoch of the loader with `options`."""
    dataset = open_shards(output, seed=1)
    loader = dataset.loader(
        args.batch, args.size, crop="random", flip=True, workers=args.workers, output="numpy", **options
    )
    started, count = time.perf_counter(), 0
    for batch in loader:
        count += len(batch.keys)
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--copies", type=int, default=2)
    parser.add_argument("--resize", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_targets_") as tmp:
        root = Path(tmp)
        source = build_source(root, args.copies)
        output = root / "out"
        pack(PackConfig(str(source), str(output), sidecars=True, resize=ResizeConfig(size=args.resize)))
        results: dict[str, list[float]] = {name: [] for name in PASSES}
        names = list(PASSES)
        epoch(output, {}, args)  # (first pass untimed: imports, the kernel, the manifest)
        for round_ in range(args.rounds):
            warm(output)
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                results[name].append(epoch(output, PASSES[name], args))
    print(f"loader {args.batch} x {args.size}px, workers={args.workers}, {args.rounds} rounds, resize {args.resize}")
    print(f"{'pass':<12} {'img/s':>8} {'vs plain':>9} range")
    summary: dict[str, Any] = {"environment": environment(__version__), "args": vars(args) | {"json": None}}
    for name, values in results.items():
        ratio = ratios(values, results["plain"])
        print(f"{name:<12} {statistics.median(values):>8.0f} {statistics.median(ratio):>9.2f} {span(ratio)}")
        summary[name] = {"img_per_s": values, "ratio_median": statistics.median(ratio)}
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()

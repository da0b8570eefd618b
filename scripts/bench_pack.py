"""Pack throughput against a naive Pillow loop, our own kernel on one process, and img2dataset.

usage: python scripts/bench_pack.py SRC [--copies 10] [--repeat 3] [--workers 2]
           [--img2dataset /path/to/venv/bin/img2dataset] [--executor local|ray]

All on the same images (SRC's files, linked --copies times so fixed start-up costs weigh what they
weigh on a real run), `--resize 256 --quality 90`, measured in this run; figures are the median of
--repeat runs with min and max, and the ratios are between medians of this run.
img2dataset runs in its own venv (pip install img2dataset) with file:// URLs:
  --resize_mode keep_ratio --image_size 256 --encode_quality 90 --output_format webdataset
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from benchkit import rates
from PIL import Image

from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
from shardkit.packing.pack import pack
from shardkit.packing.sources import walk


def link_copies(source: Path, copies: int, into: Path) -> list[Path]:
    files = [Path(item.path) for item in walk(source, labels="none").items]
    for copy in range(copies):
        folder = into / f"copy{copy:03d}"
        folder.mkdir(parents=True)
        for path in files:
            (folder / path.name).symlink_to(path.resolve())
    return [into / f"copy{c:03d}" / p.name for c in range(copies) for p in files]


def naive_pillow(paths: list[Path]) -> None:
    """What a first script does: full decode, convert, resize the short side to 256, save."""
    for path in paths:
        with Image.open(path) as image:
            image = image.convert("RGB")
            scale = 256 / min(image.size)
            if scale < 1:
                image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BICUBIC)
            image.save(io.BytesIO(), "JPEG", quality=90)


def shardkit_pack(source: Path, out: Path, workers: int, executor: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    config = PackConfig(
        source=str(source),
        output=str(out),
        resize=ResizeConfig(256),
        encode=EncodeConfig(quality=90),
        shard_size=250,
        workers=workers,
        executor=executor,
    )
    pack(config)


def img2dataset(binary: str, paths: list[Path], work: Path, workers: int) -> None:
    urls = work / "urls.txt"
    urls.write_text("".join(f"file://{p}\n" for p in paths))
    out = work / "i2d"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        [binary, "--url_list", str(urls), "--input_format", "txt", "--output_folder", str(out),
         "--resize_mode", "keep_ratio", "--image_size", "256", "--encode_quality", "90",
         "--output_format", "webdataset", "--processes_count", str(workers), "--thread_count", "4",
         "--number_sample_per_shard", "250"],
        check=True, capture_output=True, timeout=3600, env={**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"},
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--executor", choices=("local", "ray"), default="local")
    parser.add_argument("--img2dataset", default=shutil.which("img2dataset"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_pack_") as temp:
        work = Path(temp)
        paths = link_copies(args.source, args.copies, work / "src")
        n = len(paths)
        print(f"{n:,} images ({args.copies} links to each of {n // args.copies} files), resize 256, quality 90\n")
        naive_pillow(paths[:50])  # warm-up: page cache, imports
        runs: dict[str, list[float]] = {
            "naive Pillow loop, 1 process": rates(lambda: naive_pillow(paths), n, args.repeat),
            "shardkit pack, 1 worker": rates(
                lambda: shardkit_pack(work / "src", work / "out", 1, "local"), n, args.repeat
            ),
            f"shardkit pack, {args.workers} workers": rates(
                lambda: shardkit_pack(work / "src", work / "out", args.workers, "local"), n, args.repeat
            ),
        }
        if args.executor == "ray":
            import ray

            ray.init(num_cpus=args.workers, log_to_driver=False, configure_logging=False)
            runs[f"shardkit pack, ray, {args.workers} CPUs"] = rates(
                lambda: shardkit_pack(work / "src", work / "out", args.workers, "ray"), n, args.repeat
            )
            ray.shutdown()
        if args.img2dataset and os.path.exists(args.img2dataset):
            runs[f"img2dataset, {args.workers} processes"] = rates(
                lambda: img2dataset(args.img2dataset, paths, work, args.workers), n, args.repeat
            )
        else:
            print("(img2dataset not found: pass --img2dataset PATH to include it)\n")
    print(f"{'':40} {'images/s (median)':>18} {'min':>8} {'max':>8}")
    medians = {}
    for name, values in runs.items():
        medians[name] = statistics.median(values)
        print(f"{name:40} {medians[name]:18,.0f} {min(values):8,.0f} {max(values):8,.0f}")
    ours = medians[f"shardkit pack, {args.workers} workers"]
    single = medians["shardkit pack, 1 worker"]
    print("\nratios (medians of this run):")
    naive = medians["naive Pillow loop, 1 process"]
    print(f"  shardkit {args.workers} workers / naive Pillow loop:   {ours / naive:.2f}x")
    for name in medians:
        if name.startswith(("img2dataset", "shardkit pack, ray")):
            print(f"  shardkit {args.workers} workers / {name}: {ours / medians[name]:.2f}x")
    print(f"  parallel efficiency ({args.workers} workers vs 1):   {ours / (args.workers * single):.0%}")


if __name__ == "__main__":
    main()

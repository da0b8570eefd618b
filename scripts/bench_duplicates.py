"""Duplicate finding against imagehash's phash, on the same photos and one core, in one run; then
the near search at scale.

usage: python scripts/bench_duplicates.py [SRC] [--rounds 3] [--scale 1000000] [--threshold 10]
       (needs `pip install imagehash`)

SRC (default: the 300-photo ImageNet sample) gets, for every photo, one planted copy of each kind:
a JPEG re-encode at quality 20, half size, PNG, a 3 % crop on every side, grey, 1.3x brighter.
On one core (one process, no pool):

  shardkit   packing.duplicates' per-file work: read, sha256, decode at reduced DCT scale (Pillow's
             draft), 32x32 grey thumbnail, DCT hash
  imagehash  imagehash.phash(Image.open(path)): a full decode, then its own 32x32 DCT hash
  imagededup imagededup's PHash().encode_image(image_file=path), when it imports: a full decode too
  floor      Image.open + draft("L", 1/8 scale) + load: the decode alone, at the smallest DCT scale and
             without colour: the ceiling of any hash that decodes (libjpeg's entropy decoding stays)

Both hash sets are grouped the same way (pairs within --threshold bits): recall per kind (a copy
grouped with its original) and false pairs (two distinct photos grouped). Images/s are the median
of --rounds, the files read right before each round (this machine evicts pages left ~30 s).

Packed: the same files packed (--resize 256, one worker) carry both hashes in their records and
index.parquet, taken from the decode pack makes anyway. Printed: what the two hashes add to pack's
per-image work (process_image and the sha256, with and without them, interleaved rounds), and
`duplicates OUT` over the packed output (hashes from its index, nothing decoded): images/s and
recall against the same imagehash baseline.

Scale: --scale distinct random hashes plus 1 % planted near copies (1 to --threshold bits
flipped) through core.phash.near_pairs: seconds, the pairs found against the planted ones, and the
peak memory of the search over the hashes' own 8 bytes each (VmHWM before and after).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from benchkit import REPO, environment, jpeg_files, warm

sys.path.insert(0, str(REPO))
from PIL import Image, ImageEnhance

from shardkit import __version__
from shardkit.checks.duplicates import find_duplicates
from shardkit.core.config import EncodeConfig, ResizeConfig
from shardkit.core.pack_options import pack_config
from shardkit.core.phash import components, distances, near_pairs
from shardkit.packing import encode as encode_module
from shardkit.packing.hashes import hash_file as _hash_file
from shardkit.packing.pack import pack

KINDS = ("q20", "half", "png", "crop3", "grey", "bright")


def plant(image: Image.Image, kind: str, stem: Path) -> Path:
    width, height = image.size
    if kind == "png":
        image.save(stem.with_suffix(".png"))
        return stem.with_suffix(".png")
    d = (int(width * 0.03), int(height * 0.03))
    changed = {
        "q20": image,
        "half": image.resize((width // 2, height // 2)),
        "crop3": image.crop((d[0], d[1], width - d[0], height - d[1])),
        "grey": image.convert("L"),
        "bright": ImageEnhance.Brightness(image).enhance(1.3),
    }[kind]
    changed.save(stem.with_suffix(".jpg"), quality=20 if kind == "q20" else 90)
    return stem.with_suffix(".jpg")


def peak_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))


def grouped(hashes: np.ndarray, originals: int, copies: dict[str, list[int]], threshold: int) -> dict[str, float]:
    pairs = near_pairs(hashes, threshold)
    group = components(len(hashes), pairs)
    found = {
        kind: sum(group[c] == group[i] for i, c in enumerate(members)) / len(members)
        for kind, members in copies.items()
    }
    found["false pairs"] = sum(1 for a, b in pairs.tolist() if a < originals and b < originals)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", nargs="?", type=Path, default=REPO.parent / "shared/data/imagenet-sample")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threshold", type=int, default=10)
    parser.add_argument("--scale", type=int, default=1_000_000)
    args = parser.parse_args()
    import imagehash

    print(environment(__version__))
    with tempfile.TemporaryDirectory(prefix="bench-dups-") as temp:
        root = Path(temp)
        originals = jpeg_files(args.source)
        paths = [str(p) for p in originals]
        copies: dict[str, list[int]] = {kind: [] for kind in KINDS}
        for i, path in enumerate(originals):
            image = Image.open(path).convert("RGB")
            for kind in KINDS:
                copies[kind].append(len(paths))
                paths.append(str(plant(image, kind, root / f"{kind}_{i:05d}")))
        ours = np.zeros(len(paths), np.uint64)
        theirs = np.zeros(len(paths), np.uint64)
        try:  # optional: pip install imagededup (it needs scikit-learn)
            from imagededup.methods import PHash

            dedup_phash = PHash(verbose=False)
        except ImportError as error:
            print(f"imagededup: not measured ({error})")
            dedup_phash = None
        theirs_too = np.zeros(len(paths), np.uint64)
        rates: dict[str, list[float]] = {"shardkit": [], "imagehash": [], "floor": [], "imagededup": []}
        for round_number in range(args.rounds):
            names = ("shardkit", "imagehash", "floor", *(("imagededup",) if dedup_phash is not None else ()))
            for name in names if round_number % 2 == 0 else names[::-1]:
                warm(root, args.source)
                started = time.perf_counter()
                for at, path in enumerate(paths):
                    if name == "shardkit":
                        ours[at] = _hash_file(path, True, 1 << 40)[1]
                    elif name == "floor":  # the least any hash that decodes must pay: 1/8 scale, grey
                        image = Image.open(path)
                        image.draft("L", (image.width // 8, image.height // 8))
                        image.load()
                    elif name == "imagededup":
                        theirs_too[at] = int(dedup_phash.encode_image(image_file=path), 16)
                    else:
                        theirs[at] = int(str(imagehash.phash(Image.open(path))), 16)
                rates[name].append(len(paths) / (time.perf_counter() - started))
        print(f"{len(originals)} photos + {len(paths) - len(originals)} planted copies, one core, "
              f"{args.rounds} rounds, threshold {args.threshold} bits")  # fmt: skip
        measured = [
            ("shardkit", ours),
            ("imagehash", theirs),
            *((("imagededup", theirs_too),) if rates["imagededup"] else ()),
        ]
        for name, hashes in measured:
            quality = grouped(hashes, len(originals), copies, args.threshold)
            recall = ", ".join(f"{kind} {quality[kind]:.0%}" for kind in KINDS)
            print(f"{name:<10} {statistics.median(rates[name]):7,.0f} images/s  recall: {recall}; "
                  f"false pairs among distinct photos: {quality['false pairs']}")  # fmt: skip
        ratio = [a / b for a, b in zip(rates["shardkit"], rates["imagehash"], strict=True)]
        print(f"shardkit / imagehash throughput: {statistics.median(ratio):.2f}x [{min(ratio):.2f}-{max(ratio):.2f}]")
        ceiling = [a / b for a, b in zip(rates["floor"], rates["imagehash"], strict=True)]
        print(f"a 1/8-scale grey decode alone (the ceiling of any hash that decodes): "
              f"{statistics.median(rates['floor']):,.0f} images/s, {statistics.median(ceiling):.2f}x imagehash "
              f"[{min(ceiling):.2f}-{max(ceiling):.2f}]")  # fmt: skip
        distinct = distances(ours[: len(originals), None], ours[None, : len(originals)])
        upper = distinct[np.triu_indices(len(originals), 1)]
        print(
            f"shardkit: distinct photos' distances: min {upper.min()}, 0.1st percentile {np.percentile(upper, 0.1):.0f}"
        )
        packed_rows(root, paths, originals, copies, args, statistics.median(rates["imagehash"]))

    rng = np.random.default_rng(0)
    base = rng.integers(0, 2**63, args.scale, dtype=np.uint64) ^ (rng.integers(0, 2, args.scale, dtype=np.uint64) << 63)
    planted = base[: args.scale // 100].copy()
    for bit_count in range(1, args.threshold + 1):
        rows = np.arange(bit_count - 1, len(planted), args.threshold)
        for _ in range(bit_count):
            planted[rows] ^= np.uint64(1) << rng.integers(0, 64, len(rows)).astype(np.uint64)
    hashes = np.concatenate([base, planted])
    before = peak_kib()
    started = time.perf_counter()
    pairs = near_pairs(hashes, args.threshold)
    seconds = time.perf_counter() - started
    found = {(int(a), int(b)) for a, b in pairs.tolist() if b >= args.scale}
    want = {
        (i, args.scale + i)
        for i in range(len(planted))
        if distances(base[i : i + 1], planted[i : i + 1])[0] <= args.threshold
    }
    print(f"near search over {len(hashes):,} hashes (threshold {args.threshold}): {seconds:.1f} s, "
          f"{len(pairs):,} pairs, planted found {len(want & found):,} of {len(want):,}; "
          f"peak memory {peak_kib() / 1024:.0f} MiB (+{(peak_kib() - before) / 1024:.0f} MiB for the search, "
          f"{(peak_kib() - before) * 1024 / len(hashes):.0f} bytes per hash)")  # fmt: skip


def packed_rows(
    root: Path, paths: list[str], originals: list[Path], copies: dict[str, list[int]], args: argparse.Namespace,
    imagehash_rate: float,
) -> None:  # fmt: skip
    """What the hashes cost inside pack, and `duplicates OUT` from the packed output's index."""
    import hashlib

    datas = [Path(path).read_bytes() for path in paths]
    photos = datas[: len(originals)]  # pack's work on the real photos, not on the small planted copies
    resize, encoding = ResizeConfig(256), EncodeConfig()
    real = encode_module.picture_hash
    seconds: dict[str, list[float]] = {"with": [], "without": []}
    for round_number in range(args.rounds):
        for name in ("with", "without") if round_number % 2 == 0 else ("without", "with"):
            encode_module.picture_hash = real if name == "with" else (lambda image: "")  # type: ignore[assignment]
            started = time.perf_counter()
            for data in photos:
                encode_module.process_image(data, resize, encoding)
                if name == "with":
                    hashlib.sha256(data).hexdigest()
            seconds[name].append(time.perf_counter() - started)
    encode_module.picture_hash = real
    extra = [a / b - 1 for a, b in zip(seconds["with"], seconds["without"], strict=True)]
    per_image = statistics.median(seconds["with"]) / len(photos) * 1e3
    print(f"pack's per-photo work (decode, resize 256, encode): {per_image:.2f} ms with both hashes; the hashes "
          f"add {statistics.median(extra):.1%} [{min(extra):.1%}-{max(extra):.1%}]")  # fmt: skip

    source = root / "packed-source"
    source.mkdir()
    for at, path in enumerate(paths):
        (source / f"{at:05d}{Path(path).suffix}").write_bytes(datas[at])
    output = root / "packed"
    pack(pack_config(source, output, resize=256, workers=1, labels="none"))
    rates = []
    for _ in range(args.rounds):
        warm(output)
        report = find_duplicates([output], near=True, threshold=args.threshold)
        rates.append(len(paths) / report.seconds)
    import pyarrow.parquet as pq

    index = pq.read_table(output / "index.parquet", columns=["key", "phash"]).to_pylist()
    hashes = np.zeros(len(paths), np.uint64)
    for row in index:
        hashes[int(row["key"])] = int(row["phash"], 16)
    quality = grouped(hashes, len(originals), copies, args.threshold)
    recall = ", ".join(f"{kind} {quality[kind]:.0%}" for kind in KINDS)
    rate = statistics.median(rates)
    print(f"{'packed OUT':<10} {rate:7,.0f} images/s ({rate / imagehash_rate:,.0f}x imagehash; hashes from "
          f"index.parquet, nothing decoded)  recall: {recall}; false pairs: {quality['false pairs']}")  # fmt: skip


if __name__ == "__main__":
    main()

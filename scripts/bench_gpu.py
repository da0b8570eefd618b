"""The batch loader's device path on a real device: `ds.loader(B, S, device=DEV)` against the CPU
loader (`device=None`, W threads) on the same shards, images and machine, round-robin, after the
checks that its batches are right.

usage: python scripts/bench_gpu.py SHARDS [--copies 20] [--device cuda] [--batch 256] [--size 224]
                                          [--workers W] [--seconds 8] [--rounds 2] [--out DIR]

SHARDS is a shardkit output of JPEGs (e.g. the 300-photo sample packed at --resize 256, in class
folders). Its records are written --copies times into a class-folder tree and packed again with
`--encode original` (the very same bytes, --copies x the images: 300 are too few for batches of
256). Then, with RandomResizedCrop(S) + a random flip, seeded shuffles, uint8 batches of B:

  checks   one epoch through the device loader: shapes, dtype, memory format, device; labels are
           the class of each key; every key once per epoch, the same keys the next epoch; the same
           keys, labels and batches as the CPU loader for the same seed, and the pixels' distance
           from the CPU loader's (the decoders differ: nvJPEG's IDCT and upsampling are not
           libjpeg-turbo's); a normalized bfloat16 batch against the uint8 one.
  stages   one batch's steps, each timed alone (synchronized, median of 5): the window taps on the
           host, the batched decode, the batched resample, the output conversion.
  timing   each method in rounds: a fresh loader, a warm-up epoch, then epochs (a new shuffle each)
           until --seconds have passed, synchronized at the end of each; images/s.

Prints a table last and writes it with the full numbers (JSON) under --out. Runs on a machine with
no GPU too (--device cpu: the device path's torch code on the CPU), which is how it is smoke-tested.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

import shardkit
from shardkit.core.codecs import crop_kernel, turbojpeg_problem
from shardkit.readers import open_shards
from shardkit.readers.device import decode_batch, filter_taps, finish, resample_batch
from shardkit.readers.windows import random_resized_boxes, record_size

PACKAGE_ROOT = Path(shardkit.__file__).resolve().parents[1]  # the shardkit the children must import


def log(*parts: object) -> None:
    print(*parts, flush=True)


def multiply(shards: Path, copies: int, root: Path) -> Path:
    """SHARDS' records `copies` times in a class-folder tree (hard links), packed with --encode
    original: the same bytes, the same classes, each key's class folder its first path part."""
    dataset = open_shards(shards, decode="bytes")
    base, tree = root / "base", root / "tree"
    for shard in range(len(dataset.manifest.shards)):
        for record in dataset.records(shard):
            folder, _, leaf = record.key.rpartition("/")
            stored = base / folder / f"{leaf}.{record.ext}"
            stored.parent.mkdir(parents=True, exist_ok=True)
            stored.write_bytes(record.data)
            for copy in range(copies):
                target = tree / folder / f"{copy}_{leaf}.{record.ext}"
                target.parent.mkdir(parents=True, exist_ok=True)
                os.link(stored, target)
    out = root / "shards"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-m", "shardkit", "pack", str(tree), str(out), "--format", "webdataset",
         "--encode", "original", "--shard-size", "500"],
        capture_output=True, text=True, env=env, check=False, cwd=root,  # (-m puts the cwd first on sys.path)
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"pack failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return out


def sync(torch: Any, device: str | None) -> None:
    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize()


def check(torch: Any, shards: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The device loader's batches: right shapes and types, right labels, every key once, and the
    CPU loader's batches for the same seed (keys, labels; pixels within the decoders' distance)."""
    ds = open_shards(shards, shuffle=True, seed=7)
    classes, total = ds.classes, len(ds)
    size, device = args.size, args.device
    gpu = ds.loader(args.batch, size, flip=True, workers=args.workers, device=device)
    cpu = ds.loader(args.batch, size, flip=True, workers=args.workers)
    found: dict[str, Any] = {"problems": []}
    problems = found["problems"]

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)
            log("CHECK FAILED:", what)

    epochs = []
    diffs, within = [], []
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        keys: list[str] = []
        cpu_batches = iter(cpu) if epoch == 0 else None
        for number, batch in enumerate(gpu):
            images, labels = batch
            n = len(batch.keys)
            expect(images.dtype == torch.uint8, f"dtype {images.dtype}")
            expect(tuple(images.shape) == (n, 3, size, size), f"shape {tuple(images.shape)}")
            expect(images.is_contiguous(memory_format=torch.channels_last), "not channels_last")
            expect(images.device.type == torch.device(device).type, f"images on {images.device}")
            expect(labels.device.type == torch.device(device).type, f"labels on {labels.device}")
            expect(labels.dtype == torch.int64 and tuple(labels.shape) == (n,), f"labels {labels.dtype} {labels.shape}")
            wanted = [classes.index(key.split("/")[0]) if classes else -1 for key in batch.keys]
            expect(labels.cpu().tolist() == wanted, f"batch {number}: labels are not the keys' classes")
            host = images.cpu()
            expect(int(host.min()) < int(host.max()), f"batch {number}: flat images")
            mean = float(host.float().mean())
            expect(20 < mean < 235, f"batch {number}: mean level {mean:.1f}")
            expect(len(set(tuple(image.flatten()[:4096].tolist()) for image in host[:8])) == min(8, n),
                   f"batch {number}: repeated images")  # fmt: skip
            keys += batch.keys
            if cpu_batches is not None:
                reference = next(cpu_batches)
                expect(reference.keys == batch.keys, f"batch {number}: keys differ from the CPU loader's")
                expect(reference.labels.tolist() == labels.cpu().tolist(), f"batch {number}: labels differ")
                if reference.keys == batch.keys:
                    distance = (host.int() - reference.images.int()).abs()
                    diffs.append(float(distance.float().mean()))
                    within.append(float((distance <= 8).float().mean()))
        expect(len(keys) == total and len(set(keys)) == total, f"epoch {epoch}: {len(keys)} keys, "
               f"{len(set(keys))} distinct, of {total}")  # fmt: skip
        epochs.append(keys)
    expect(set(epochs[0]) == set(epochs[1]), "the two epochs hold different keys")
    expect(epochs[0] != epochs[1], "the two epochs are in the same order (no reshuffle)")
    found["mean_abs_diff_vs_cpu_loader"] = statistics.mean(diffs) if diffs else None
    found["share_within_8_levels"] = statistics.mean(within) if within else None
    # a normalized batch: the uint8 batch of the same seed, scaled
    ds.set_epoch(0)
    mean, std = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
    first = next(iter(ds.loader(args.batch, size, flip=True, workers=args.workers, device=device)))
    normal = next(iter(ds.loader(args.batch, size, flip=True, workers=args.workers, device=device,
                                 dtype=torch.bfloat16, mean=mean, std=std)))  # fmt: skip
    expect(normal.images.dtype == torch.bfloat16, f"normalized dtype {normal.images.dtype}")
    expect(bool(torch.isfinite(normal.images.float()).all()), "normalized batch not finite")
    shift = torch.tensor(mean, device=normal.images.device).view(1, 3, 1, 1)
    scale = torch.tensor(std, device=normal.images.device).view(1, 3, 1, 1)
    back = (normal.images.float() * scale + shift) * 255
    error = float((back - first.images.float()).abs().max())
    expect(error < 2.0, f"normalized batch off the uint8 one by {error:.2f} levels")
    found["bf16_max_level_error"] = error
    found["keys"], found["epoch_keys"] = total, len(epochs[0])
    sync(torch, device)
    return found


def stages(torch: Any, shards: Path, args: argparse.Namespace) -> dict[str, float]:
    """One batch's steps of the device path, each alone, synchronized: ms per batch (median of 5)."""
    ds = open_shards(shards, decode="bytes")
    records = [record for shard in range(len(ds.manifest.shards)) for record in ds.records(shard)][: args.batch]
    sizes = np.array([record_size(record, ds.max_pixels) for record in records], np.int64)
    rng = np.random.default_rng(0)
    boxes = random_resized_boxes(sizes[:, 0], sizes[:, 1], rng, (0.08, 1.0), (3 / 4, 4 / 3))
    flips = rng.random(len(records)) < 0.5
    out = (args.size, args.size)
    device = torch.device(args.device)

    def timed(step: Any) -> float:
        times = []
        for _ in range(6):
            sync(torch, args.device)
            started = time.perf_counter()
            step()
            sync(torch, args.device)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:]) * 1000

    def taps() -> None:
        for (w, h), (left, top, width, height) in zip(sizes, boxes, strict=True):
            filter_taps(int(w), left, min(left + width, w), out[1])
            filter_taps(int(h), top, min(top + height, h), out[0])

    images, failures = decode_batch(torch, records, device, ds.max_pixels)
    assert not failures, failures
    pixels = resample_batch(torch, images, boxes, flips, out)
    result = {
        "host: window taps (numpy)": timed(taps),
        "decode (batched)": timed(lambda: decode_batch(torch, records, device, ds.max_pixels)),
        "resample (taps + 2 matmuls)": timed(lambda: resample_batch(torch, images, boxes, flips, out)),
        "finish (uint8, channels_last)": timed(lambda: finish(torch, pixels, None, None, None)),
    }
    if args.device.startswith("cuda"):
        result["peak GPU memory (MB)"] = torch.cuda.max_memory_allocated() / 1e6
    return result


def inside(torch: Any, shards: Path, args: argparse.Namespace) -> dict[str, float]:
    """One epoch of the device loader (after a warm-up one), its device steps' host time summed
    where the loader calls them (the steps this version of readers/device.py has; plan_resample runs
    on the loader threads): ms per batch."""
    import shardkit.readers.device as device_module

    spent: dict[str, float] = {}
    names = ("decode_batch", "flatten_images", "resample_batch", "resample_planned", "plan_resample", "finish")
    originals = {name: getattr(device_module, name) for name in names if hasattr(device_module, name)}

    def timed(name: str, function: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started

        return call

    ds = open_shards(shards, shuffle=True, seed=3)
    loader = ds.loader(args.batch, args.size, flip=True, workers=args.workers, device=args.device)
    for _ in loader:
        pass
    sync(torch, args.device)
    for name, function in originals.items():
        setattr(device_module, name, timed(name, function))
    try:
        ds.set_epoch(1)
        batches, started = 0, time.perf_counter()
        for _ in loader:
            batches += 1
        sync(torch, args.device)
        elapsed = time.perf_counter() - started
    finally:
        for name, function in originals.items():
            setattr(device_module, name, function)
    result = {"epoch (wall, synchronized at the end)": elapsed * 1000 / batches}
    result.update({f"{name} (host)": value * 1000 / batches for name, value in spent.items()})
    return result


def rate(torch: Any, shards: Path, args: argparse.Namespace, device: str | None, epoch0: int) -> dict[str, float]:
    """A fresh loader, a warm-up epoch, then epochs until --seconds: images/s."""
    ds = open_shards(shards, shuffle=True, seed=1)
    loader = ds.loader(args.batch, args.size, flip=True, workers=args.workers, device=device)
    ds.set_epoch(epoch0)
    for _ in loader:
        pass
    sync(torch, device)
    gc.collect()
    count, epochs, started = 0, 0, time.perf_counter()
    while True:
        ds.set_epoch(epoch0 + 1 + epochs)
        for _, labels in loader:
            count += len(labels)
        sync(torch, device)
        epochs += 1
        elapsed = time.perf_counter() - started
        if elapsed >= args.seconds:
            return {"images_per_second": count / elapsed, "epochs": epochs, "seconds": elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shards", type=Path)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    import torch
    import torchvision

    env: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torchvision": torchvision.__version__,
        "cpus": os.cpu_count(), "workers": args.workers, "crop_kernel": crop_kernel() is not None,
        "turbojpeg": turbojpeg_problem() or "yes", "device": args.device, "shardkit": str(PACKAGE_ROOT),
    }  # fmt: skip
    if args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none visible"
    log("environment:", json.dumps(env))
    report: dict[str, Any] = {"environment": env}
    failed = False
    with tempfile.TemporaryDirectory(prefix="shardkit-gpu-") as temp:
        started = time.perf_counter()
        shards = multiply(args.shards, args.copies, Path(temp)) if args.copies > 1 else args.shards
        total = len(open_shards(shards))
        log(f"{total} images ({args.copies} x {args.shards.name}) packed in {time.perf_counter() - started:.1f} s")
        for name, step in (("checks", check), ("stages", stages), ("inside", inside)):
            try:
                started = time.perf_counter()
                report[name] = step(torch, shards, args)
                log(f"{name} ({time.perf_counter() - started:.1f} s):", json.dumps(report[name]))
            except Exception:
                failed = True
                report[name] = {"error": traceback.format_exc()}
                log(f"{name} FAILED:\n{report[name]['error']}")
        methods = {f"loader, device={args.device!r}": args.device, f"loader, CPU ({args.workers} threads)": None}
        rates: dict[str, list[float]] = {name: [] for name in methods}
        for number in range(args.rounds):
            order = list(methods) if number % 2 == 0 else list(reversed(methods))
            for name in order:
                try:
                    measured = rate(torch, shards, args, methods[name], 100 * number)
                except Exception:
                    failed = True
                    log(f"{name} FAILED:\n{traceback.format_exc()}")
                    continue
                rates[name].append(measured["images_per_second"])
                log(f"round {number + 1}: {name}: {measured['images_per_second']:,.0f} images/s "
                    f"({measured['epochs']} epochs, {measured['seconds']:.1f} s)")  # fmt: skip
        report["rates"] = rates
    where = env.get("gpu", "CPU")
    lines = [
        f"{total} images (JPEG, short side ~256), batches of {args.batch} x {args.size}^2 uint8, RandomResizedCrop "
        f"+ flip; {where}, {env['cpus']} cores, {args.workers} loader threads; torch {env['torch']}",
        f"{'method':<40} {'images/s':>10} {'rounds':>21}",
    ]
    for name, values in rates.items():
        median = f"{statistics.median(values):>10,.0f}" if values else f"{'failed':>10}"
        lines.append(f"{name:<40} {median} {', '.join(f'{v:,.0f}' for v in values):>21}")
    if isinstance(report.get("stages"), dict) and "error" not in report["stages"]:
        lines.append(f"one batch of {args.batch}, each step alone (ms):")
        lines += [f"  {name:<38} {value:>10.1f}" for name, value in report["stages"].items()]
    if isinstance(report.get("inside"), dict) and "error" not in report["inside"]:
        lines.append(f"one epoch of the device loader, ms per batch of {args.batch} (host time where it is called):")
        lines += [f"  {name:<38} {value:>10.1f}" for name, value in report["inside"].items()]
    checks = report.get("checks", {})
    if "error" in checks:
        lines.append("checks: FAILED (see the log)")
    else:
        diff, within = checks.get("mean_abs_diff_vs_cpu_loader"), checks.get("share_within_8_levels")
        lines.append(f"checks: {len(checks['problems'])} problems; mean |device - CPU loader| "
                     + (f"{diff:.2f} levels, {within:.1%} within 8" if diff is not None else "not compared")
                     + f"; bf16 vs uint8 {checks['bf16_max_level_error']:.2f} levels max")  # fmt: skip
    table = "\n".join(lines)
    print(table, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_gpu.txt").write_text(table + "\n")
        (args.out / "bench_gpu.json").write_text(json.dumps(report, indent=1))
    if failed or checks.get("problems"):
        sys.exit(1)


if __name__ == "__main__":
    main()

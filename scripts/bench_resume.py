"""Resumable epochs: what resuming costs, whether the new epoch order reads as fast as the old
shuffle buffer, and how well each mixes a class-sorted output. All measured or computed in one run.

usage: python scripts/bench_resume.py [--only resume|throughput|quality] [--repeat 5] [--copies 1001]
           [--rounds 5] [--base-rev 2d000c8] [--base /tmp/bench_resume_base] [--keep-base]

resume: 1,000 generated images packed at 64 px into one shard of 1,000 records, then an output whose
manifest lists that shard --copies times under new names (1,001,000 records by default; a state at
90% stands inside a shard in each of the 8 lanes, and a tar read from inside has its headers walked
from its start first), every name a link to the one file (hard links for webdataset; symbolic links
for LMDB, whose py-lmdb refuses a second name of an open file: --lmdb-links hard shows it). For the
batch loader (256 images of 64 px, 2 threads), the torch IterableDataset in this process, and that
dataset in a DataLoader with 2 workers: seconds from creating the reader to the first batch (or
sample) of a fresh shuffled epoch, and after load_state_dict(a state at 90% of the epoch); prints
the medians of --repeat runs and the median of the per-run ratios resume / fresh with their range.
Counts the records the format reader handed out before that first batch (in this process) and how
many of them the state had consumed.
throughput: images/s of `for s in ds.iterable()` (decoded RGB, and bytes only) and of ds.loader(256,
64, workers=2, output="numpy") over 3,000 images at 128 px, shuffled, each pass on a dataset opened
anew (as each epoch's new DataLoader workers start with nothing cached), with this checkout and with
--base-rev (a git worktree made and removed here unless --base exists; its children import that
revision), alternating, --rounds rounds; ratio = new / base, the median of per-round ratios.
quality: the old order (seeded shard order, then 2d000c8's shuffle buffer) against the new one (8 or
more lanes starting at shard starts, blocks emitted in a seeded permutation; computed with
shardkit.readers.order and epoch, no images) on a class-sorted output (--classes x --per-class
records, shards of 100 or 1,000), for buffers of 1,000 and 10,000, one stream (one rank, no
DataLoader workers), averaged over --epochs epochs: the share of consecutive samples from one shard,
of one label (lag 1), and of one label averaged over lags 1..100 (lower is better; a full
permutation gives ~1/classes); and how each reads: read calls per shard, seeks (a read not starting
where that shard's last one ended) and backward seeks per shard. A full permutation is printed as
the floor; the computed new order is checked against real iteration on a small output first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from benchkit import REPO, base_worktree, environment, pythonpath_env, ratios, remove_worktree, span, warm

from shardkit import PackConfig, ResizeConfig, open_shards, pack
from shardkit.core.manifest import ERRORS_NAME, MANIFEST_NAME, read_manifest, write_json_atomic
from shardkit.core.version import __version__
from shardkit.formats import get_format
from shardkit.readers.epoch import ShardSpace
from shardkit.readers.intervals import merged, runs
from shardkit.readers.order import Progress
from shardkit.readers.split import record_ranges
from shardkit.readers.stream import lanes_for
from shardkit.synthetic import write_image

BATCH, SIZE, WORKERS = 256, 64, 2
AT = 0.9  # where the resumed state stands in the epoch


def make_images(folder: Path, count: int, classes: int, width: int, height: int) -> Path:
    """`count` synthetic JPEGs in `classes` class folders (no corrupt or odd files: one shard each)."""
    for i in range(count):
        write_image(folder / f"c{i % classes:03d}" / f"img_{i:06d}.jpg", width, height, seed=i)
    return folder


def pack_folder(source: Path, out: Path, fmt: str, size: int, shard_size: int) -> Path:
    config = PackConfig(str(source), str(out), format=fmt, resize=ResizeConfig(size), shard_size=shard_size, workers=2)
    pack(config)
    return out


def warm_files(*paths: Path) -> None:
    """Read each file in full (links to one file: read once); the machine evicts untouched pages."""
    seen = set()
    for path in paths:
        info = path.stat()
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            with open(path, "rb", buffering=0) as handle:
                while handle.read(8 << 20):
                    pass


# ---------------------------------------------------------------------------------------------------
# resume


def replicate(small: Path, big: Path, copies: int, links: str) -> Path:
    """An output listing the one shard of `small` `copies` times under new names, each a link to
    that file (same bytes and sha256), with totals to match; no index.parquet (it would name the
    shard once)."""
    manifest = read_manifest(small)
    if len(manifest.shards) != 1:
        raise SystemExit(f"{small}: {len(manifest.shards)} shards, expected one")
    shard = manifest.shards[0]
    big.mkdir()
    target = (small / shard.name).resolve()
    names = [f"shard-{i:06d}{Path(shard.name).suffix}" for i in range(copies)]
    for name in names:
        if links == "hard":
            os.link(target, big / name)
        else:
            os.symlink(target, big / name)
    if (small / ERRORS_NAME).exists():
        os.link(small / ERRORS_NAME, big / ERRORS_NAME)
    records = shard.count * copies
    totals = {**manifest.totals, "records": records, "inputs": records + manifest.totals.get("errors", 0)}
    listed = replace(manifest, shards=[replace(shard, name=name) for name in names], totals=totals, index=None)
    write_json_atomic(big / MANIFEST_NAME, listed.sealed().to_json())
    return big


class ReadLog:
    """Counts the records a format's reader hands out, per read_range call, in this process."""

    def __init__(self, fmt: str) -> None:
        self.reads: list[list[Any]] = []  # [shard file name, start, records so far]
        self.reader = get_format(fmt).reader
        self.original = self.reader.read_range
        log = self

        def read_range(reader: Any, start: int, stop: int) -> Iterator[Any]:
            entry = [os.path.basename(reader.path), start, 0]
            log.reads.append(entry)
            for record in log.original(reader, start, stop):
                entry[2] += 1
                yield record

        self.reader.read_range = read_range

    def remove(self) -> None:
        self.reader.read_range = self.original

    def records(self) -> int:
        return sum(entry[2] for entry in self.reads)

    def consumed(self, dataset: Any, state: dict[str, Any]) -> int:
        """How many of the records read were at positions `state` had already consumed."""
        progress = Progress.from_state(state)
        space = dataset.space(progress)
        split, sequence = progress.start(1, 1, False, space.cuts)
        stream = progress.stream(split, sequence, 0, 0, space.cuts)
        done = progress.splits[split].done[0]
        spans = np.array(merged(stream.consumed(done)), np.int64).reshape(-1, 2)
        where = {dataset.manifest.shards[shard].name: at for at, shard in enumerate(space.order)}
        hits = 0
        for name, start, count in self.reads:
            positions = space.starts[where[name]] + start + np.arange(count)
            at = np.searchsorted(spans[:, 0], positions, side="right") - 1
            hits += int(np.sum((at >= 0) & (positions < spans[np.maximum(at, 0), 1])))
        return hits


def first_batch_loader(dataset: Any, state: dict[str, Any] | None) -> float:
    started = time.perf_counter()
    loader = dataset.loader(BATCH, SIZE, workers=WORKERS, output="numpy")
    if state is not None:
        loader.load_state_dict(state)
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - started
    batches.close()  # stops the decode threads
    return seconds


def first_sample_iterable(dataset: Any, state: dict[str, Any] | None) -> float:
    started = time.perf_counter()
    iterable = dataset.iterable()
    if state is not None:
        iterable.load_state_dict(state)
    samples = iter(iterable)
    next(samples)
    seconds = time.perf_counter() - started
    samples.close()
    return seconds


def first_batch_dataloader(dataset: Any, state: dict[str, Any] | None) -> float:
    from torch.utils.data import DataLoader

    started = time.perf_counter()
    iterable = dataset.iterable()
    if state is not None:
        iterable.load_state_dict(state)
    batches = iter(DataLoader(iterable, batch_size=BATCH, num_workers=WORKERS, collate_fn=list))
    next(batches)
    seconds = time.perf_counter() - started
    del batches  # untimed: the workers are joined here, not in the next run
    return seconds


def resume_states(out: Path) -> dict[str, dict[str, Any]]:
    """States at AT of the epoch: the loader's from its own state_dict() with the count edited, the
    iterable's from state_from_batches (checked against each other)."""
    dataset = open_shards(out, shuffle=True, seed=0)
    loader = dataset.loader(BATCH, SIZE, workers=WORKERS, output="numpy")
    batches = iter(loader)
    next(batches)
    batches.close()
    state = loader.state_dict()
    assert state["splits"][-1]["done"] == [BATCH], state
    done = int(AT * len(loader))
    state["splits"][-1]["done"] = [done * BATCH]
    iterable = dataset.iterable()
    built = iterable.state_from_batches(done, BATCH, 0)
    if built != state:
        raise SystemExit(f"the edited state_dict and state_from_batches disagree:\n{state}\n{built}")
    in_workers = iterable.state_from_batches(int(AT * -(-len(dataset) // BATCH)), BATCH, WORKERS)
    dataset.close()
    return {"loader": state, "iterable": built, "dataloader": in_workers}


def measure_resume(fmt: str, out: Path, base_shard: Path, repeat: int) -> list[str]:
    states = resume_states(out)
    kinds: list[tuple[str, str, Callable[[Any, dict[str, Any] | None], float]]] = [
        ("loader", "loader(256, 64 px, 2 threads)", first_batch_loader),
        ("iterable", "iterable(), first sample", first_sample_iterable),
        ("dataloader", "iterable() in DataLoader(2 workers)", first_batch_dataloader),
    ]
    rows = []
    for kind, label, first in kinds:
        seconds: dict[str, list[float]] = {"fresh": [], "resume": []}
        opened: list[float] = []
        reads: dict[str, int] = {}
        consumed = 0
        for run in range(repeat + 1):  # the first run is not counted: imports, first use
            order = ["fresh", "resume"] if run % 2 == 0 else ["resume", "fresh"]
            for how in order:
                warm_files(out / MANIFEST_NAME, base_shard)
                started = time.perf_counter()
                dataset = open_shards(out, shuffle=True, seed=0)
                opening = time.perf_counter() - started
                log = ReadLog(fmt)
                try:
                    took = first(dataset, states[kind] if how == "resume" else None)
                finally:
                    log.remove()
                if run > 0:
                    seconds[how].append(took)
                    opened.append(opening)
                if run == 1 and kind != "dataloader":  # DataLoader workers read in their own processes
                    reads[how] = log.records()
                    if how == "resume":
                        consumed = log.consumed(dataset, states[kind])
                dataset.close()
        per_run = ratios(seconds["resume"], seconds["fresh"])
        fresh, resumed = statistics.median(seconds["fresh"]), statistics.median(seconds["resume"])
        counts = f"{'-':>10} {'-':>10} {'-':>9}"
        if reads:
            counts = f"{reads['fresh']:>10,} {reads['resume']:>10,} {consumed:>9,}"
        rows.append(
            f"{fmt:>10} {label:<36} {fresh:>8.3f} {resumed:>8.3f} {statistics.median(per_run):>6.2f}x "
            f"{span(per_run):<12} {counts}   {statistics.median(opened):.3f}"
        )
    return rows


def resume(args: argparse.Namespace, temp: Path) -> None:
    source = make_images(temp / "resume-src", 1000, 10, 96, 72)
    rows = []
    for fmt in args.formats.split(","):
        small = pack_folder(source, temp / f"resume-{fmt}-one", fmt, SIZE, 1000)
        links = args.lmdb_links if fmt == "lmdb" else "hard"
        big = replicate(small, temp / f"resume-{fmt}", args.copies, links)
        base_shard = small / read_manifest(small).shards[0].name
        try:
            rows += measure_resume(fmt, big, base_shard, args.repeat)
        except Exception as error:  # one format failing must not lose the others' rows
            rows.append(f"{fmt:>10} failed ({links} links): {type(error).__name__}: {str(error)[:300]}")
        if args.verify:
            from shardkit import verify

            report = verify(big)
            kinds: dict[str, int] = {}
            for problem in report.problems:
                kinds[problem.kind] = kinds.get(problem.kind, 0) + 1
            print(f"verify {fmt}: {report.records:,} records, problems {kinds or 'none'}", file=sys.stderr)
    total = args.copies * 1000
    print(
        f"resume: {total:,} records ({args.copies:,} names of one 1,000-record shard), shuffle=True; seconds from "
        f"creating the reader to the first batch (sample), fresh epoch vs load_state_dict at {AT:.0%}; median of "
        f"{args.repeat}; ratio = resume / fresh (median of per-run ratios); read = records the format reader "
        "handed out by then, re-read = of those, already consumed by the state; open = open_shards() seconds"
    )
    print(f"{'format':>10} {'reader':<36} {'fresh s':>8} {'resume s':>8} {'ratio':>7} {'[range]':<12} "
          f"{'read new':>10} {'read res.':>10} {'re-read':>9}   open s")  # fmt: skip
    for row in rows:
        print(row)


# ---------------------------------------------------------------------------------------------------
# throughput

THROUGHPUT = """
import json, statistics, sys, time
import shardkit
from shardkit import open_shards
from shardkit.core.codecs import crop_kernel
mode, out, passes = sys.argv[1], sys.argv[2], int(sys.argv[3])
def one_pass():  # a dataset of its own, as each epoch's new DataLoader workers have (nothing cached)
    dataset = open_shards(out, shuffle=True, seed=0, decode="bytes" if mode == "bytes" else "rgb")
    if mode == "loader":
        count = sum(len(labels) for _, labels in dataset.loader(256, 64, workers=2, output="numpy"))
    else:
        count = sum(1 for _ in dataset.iterable())
    dataset.close()
    return count
one_pass()  # warm: imports, first use
rates = []
for _ in range(passes):
    started = time.perf_counter()
    count = one_pass()
    rates.append(count / (time.perf_counter() - started))
print(json.dumps({"rate": statistics.median(rates), "count": count, "file": shardkit.__file__,
                  "kernel": crop_kernel() is not None}))
"""


def run_child(checkout: Path, *args: str) -> dict[str, Any]:
    # cwd: `python -c` puts the working folder ahead of PYTHONPATH, so the child imports `checkout`'s shardkit
    done = subprocess.run(
        [sys.executable, "-c", *args], env=pythonpath_env(checkout), cwd=checkout, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {args[1:3]} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def throughput(args: argparse.Namespace, temp: Path) -> None:
    source = make_images(temp / "throughput-src", args.images, 10, 171, 128)
    out = pack_folder(source, temp / "throughput-out", args.format, 128, 500)
    made = base_worktree(args.base, args.base_rev)
    try:
        revisions = {"base": args.base.resolve(), "new": REPO}
        for name, checkout in revisions.items():  # each child must import its own revision
            where = Path(run_child(checkout, "import json, shardkit; print(json.dumps(shardkit.__file__))"))
            if checkout not in where.resolve().parents:
                raise SystemExit(f"{name}: children in {checkout} import shardkit from {where}")
        modes = {
            "rgb": ("iterable(), decode=rgb", 2),
            "bytes": ("iterable(), decode=bytes", 10),
            "loader": ("loader(256, 64 px, 2 threads, numpy)", 3),
        }
        found: dict[tuple[str, str], list[float]] = {(rev, mode): [] for rev in revisions for mode in modes}
        kernels = set()
        for round_number in range(args.rounds):
            order = list(revisions) if round_number % 2 == 0 else list(reversed(revisions))
            for mode, (_, passes) in modes.items():
                for rev in order:
                    warm(out)
                    result = run_child(revisions[rev], THROUGHPUT, mode, str(out), str(passes))
                    if result["count"] != args.images:
                        raise SystemExit(f"{rev} {mode}: {result['count']} images a pass, not {args.images}")
                    found[(rev, mode)].append(result["rate"])
                    kernels.add((rev, result["kernel"]))
            print(f"throughput: round {round_number + 1}/{args.rounds} done", file=sys.stderr)
    finally:
        if made and not args.keep_base:
            remove_worktree(args.base)
    shards = len(read_manifest(out).shards)
    print(
        f"throughput: {args.images:,} images at 128 px ({args.format}, {shards} shards), shuffle=True seed=0; "
        f"images/s, median of {args.rounds} alternating rounds; ratio = new / base ({args.base_rev}), median of "
        f"per-round ratios; crop kernel {sorted(kernels)}"
    )
    print(f"{'reader':<40} {'base img/s':>11} {'new img/s':>11} {'new/base':>9} [range]")
    for mode, (label, _) in modes.items():
        base, new = found[("base", mode)], found[("new", mode)]
        per_round = ratios(new, base)
        print(f"{label:<40} {statistics.median(base):>11,.0f} {statistics.median(new):>11,.0f} "
              f"{statistics.median(per_round):>8.3f}x {span(per_round)}")  # fmt: skip


# ---------------------------------------------------------------------------------------------------
# quality


def buffer_shuffle(samples: Iterator[Any], size: int, seed: tuple[int, ...]) -> Iterator[Any]:
    """2d000c8's shardkit/readers/split.py buffer_shuffle, verbatim."""
    rng = np.random.default_rng(seed)
    buffer: list[Any] = []
    for sample in samples:
        if len(buffer) < size:
            buffer.append(sample)
            continue
        slot = int(rng.integers(size))
        yield buffer[slot]
        buffer[slot] = sample
    order = rng.permutation(len(buffer))
    for slot in order:
        yield buffer[slot]


def counts_space(counts: list[int], seed: int, epoch: int) -> ShardSpace:
    """The epoch's shard sequence as ShardDataset.space() builds it, from record counts alone."""
    shards = [SimpleNamespace(count=c) for c in counts]
    fake = SimpleNamespace(manifest=SimpleNamespace(shards=shards), counts=counts, remote=None)
    return ShardSpace(fake, (seed, epoch), True)  # type: ignore[arg-type]


def old_epoch(counts: list[int], seed: int, epoch: int, buffer: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """(stored index of every sample in emitted order, the (shard, start, stop) reads): 2d000c8's
    epoch_plan and epoch_records for one rank and no workers."""
    space = counts_space(counts, seed, epoch)  # the same seeded shard order as 2d000c8's epoch_plan
    plan = record_ranges(space.order, space.counts, 0, sum(counts))
    stored = np.cumsum([0, *counts])
    sequence = np.concatenate([np.arange(stored[s] + a, stored[s] + b) for s, a, b in plan])
    emitted = np.fromiter(buffer_shuffle(iter(sequence.tolist()), buffer, (seed, epoch, 0, 0)), np.int64)
    return emitted, plan


def new_epoch(counts: list[int], seed: int, epoch: int, buffer: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
    """The same from readers/order and readers/epoch: the stream's blocks (lanes starting at shard
    starts, as ShardSpace's cuts make them), each read in ascending positions as readers.epoch's
    `emitted` does, emitted in the block's order."""
    total = sum(counts)
    lanes = lanes_for(buffer, total / len(counts))  # as ShardDataset.fresh_progress chooses them
    progress = Progress(epoch, seed, True, buffer, [total], total, lanes=lanes)
    space = counts_space(counts, seed, epoch)
    split, sequence = progress.start(1, 1, False, space.cuts)
    stream = progress.stream(split, sequence, 0, 0, space.cuts)
    blocks = list(stream.blocks_from(0))
    reads: list[tuple[int, int, int]] = []
    for block in blocks:
        for begin, end in runs(np.unique(block)):
            reads += record_ranges(space.order, space.counts, begin, end)
    positions = np.concatenate(blocks)
    at = np.searchsorted(space.starts, positions, side="right") - 1
    shard = np.asarray(space.order)[at]
    stored = np.cumsum([0, *counts])
    return stored[shard] + positions - space.starts[at], reads


def read_pattern(reads: list[tuple[int, int, int]], shards: int) -> tuple[float, float, float]:
    """Read calls, seeks and backward seeks per shard: a seek is a read of a shard that does not
    start where the last read of that shard ended (its first read: at record 0)."""
    at = [0] * shards
    seeks = backward = 0
    for shard, start, stop in reads:
        seeks += start != at[shard]
        backward += start < at[shard]
        at[shard] = stop
    return len(reads) / shards, seeks / shards, backward / shards


def mixing(stored: np.ndarray, shard_size: int, per_class: int, lags: int) -> tuple[float, float, float]:
    shard, label = stored // shard_size, stored // per_class
    same_shard = float(np.mean(shard[1:] == shard[:-1]))
    same_label = [float(np.mean(label[lag:] == label[:-lag])) for lag in range(1, lags + 1)]
    return same_shard, same_label[0], float(np.mean(same_label))


def check_order(temp: Path) -> str:
    """new_epoch's order against real iteration (keys) on a small output of several shards."""
    source = make_images(temp / "order-src", 400, 4, 40, 30)
    out = pack_folder(source, temp / "order-out", "webdataset", 32, 50)
    dataset = open_shards(out, shuffle=True, seed=0, shuffle_buffer=80, decode="bytes")
    keys = [[record.key for record in dataset.records(shard)] for shard in range(len(dataset.manifest.shards))]
    stored_keys = [key for shard in keys for key in shard]
    counts = [len(shard) for shard in keys]
    for epoch in (0, 1):
        dataset.set_epoch(epoch)
        emitted, _ = new_epoch(counts, 0, epoch, 80)
        if [sample.key for sample in dataset] != [stored_keys[i] for i in emitted]:
            raise SystemExit(f"the computed new order is not what iteration yields (epoch {epoch})")
    dataset.close()
    return f"computed new order = iteration order ({sum(counts)} records, {len(counts)} shards, buffer 80, epochs 0-1)"


def quality(args: argparse.Namespace, temp: Path) -> None:
    checked = check_order(temp)
    total = args.classes * args.per_class
    rows = []
    for shard_size in (100, 1000):
        counts = [min(shard_size, total - start) for start in range(0, total, shard_size)]
        for buffer in (1000, 10000):
            for method, epoch_of in (("old", old_epoch), ("new", new_epoch)):
                metrics, pattern = [], []
                for epoch in range(args.epochs):
                    stored, reads = epoch_of(counts, 0, epoch, buffer)
                    if not np.array_equal(np.sort(stored), np.arange(total)):
                        raise SystemExit(f"{method}: epoch {epoch} is not a permutation")
                    metrics.append(mixing(stored, shard_size, args.per_class, 100))
                    pattern.append(read_pattern(reads, len(counts)))
                mix, reading = np.mean(metrics, axis=0), np.mean(pattern, axis=0)
                rows.append(
                    f"{shard_size:>6} {buffer:>7} {method:<8} {mix[0]:>10.4f} {mix[1]:>10.4f} {mix[2]:>12.4f} "
                    f"{reading[0]:>11.2f} {reading[1]:>11.2f} {reading[2]:>14.2f}"
                )
        rng = np.random.default_rng(0)
        shuffled = [mixing(rng.permutation(total), shard_size, args.per_class, 100) for _ in range(args.epochs)]
        floor = np.mean(shuffled, axis=0)
        rows.append(f"{shard_size:>6} {'-':>7} {'global':<8} {floor[0]:>10.4f} {floor[1]:>10.4f} {floor[2]:>12.4f}"
                    f" {'(a full permutation: the floor)':>38}")  # fmt: skip
    print(
        f"quality: {args.classes} classes x {args.per_class:,} records stored sorted by class, seed 0, one stream, "
        f"mean of epochs 0-{args.epochs - 1}; same-* = share of sample pairs from one shard / of one label "
        f"(lower is better; ideal label share 1/{args.classes} = {1 / args.classes:.4f}); reads, seeks and "
        f"backward seeks per shard ({checked})"
    )
    print(f"{'shard':>6} {'buffer':>7} {'method':<8} {'same-shard':>10} {'label lag1':>10} "
          f"{'lag 1-100':>12} {'reads/shard':>11} {'seeks/shard':>11} {'backward/shard':>14}")  # fmt: skip
    for row in rows:
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["resume", "throughput", "quality"])
    parser.add_argument("--repeat", type=int, default=5, help="resume: measured runs of each reader")
    parser.add_argument("--copies", type=int, default=1001, help="resume: names of the 1,000-record shard")
    parser.add_argument("--formats", default="webdataset,lmdb", help="resume: formats")
    parser.add_argument("--lmdb-links", choices=["symbolic", "hard"], default="symbolic")
    parser.add_argument("--verify", action="store_true", help="resume: run verify on each big output (slow)")
    parser.add_argument("--rounds", type=int, default=5, help="throughput: alternating rounds")
    parser.add_argument("--images", type=int, default=3000, help="throughput: images")
    parser.add_argument("--format", default="webdataset", help="throughput: format")
    parser.add_argument("--base-rev", default="2d000c8")
    parser.add_argument("--base", type=Path, default=Path("/tmp/bench_resume_base"), help="the base worktree")
    parser.add_argument("--keep-base", action="store_true", help="keep a worktree this run made")
    parser.add_argument("--classes", type=int, default=100, help="quality")
    parser.add_argument("--per-class", type=int, default=1000, help="quality")
    parser.add_argument("--epochs", type=int, default=3, help="quality")
    args = parser.parse_args()
    print(json.dumps(environment(__version__)), file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench_resume-", dir="/tmp") as temp:
        for part, function in (("resume", resume), ("throughput", throughput), ("quality", quality)):
            if args.only in (None, part):
                started = time.perf_counter()
                function(args, Path(temp))
                print(f"({part}: {time.perf_counter() - started:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

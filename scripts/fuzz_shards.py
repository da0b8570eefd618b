"""Fuzz the readers and verify with damaged outputs of every format.

usage: python scripts/fuzz_shards.py [--cases 3000] [--seed 0] [--workers 2] [--json out.json]

Each case copies a clean output and damages it one way: bytes flipped, inserted or cut at random
offsets of a shard, the manifest re-sealed afterwards (so its size and sha256 checks pass and the
readers meet the damage) or not; a random edit of manifest.json, re-sealed or not; or garbage in
errors.jsonl. Then the output is read every way (iteration, random access, by key, verify --deep)
in a worker process with a 4 GiB address-space limit. Outcomes per format and damage:

  clean      nothing read was damaged (e.g. a flip inside pixel data that still decodes)
  refused    a shardkit error (ShardFormatError, ShardReadError, ManifestError) or a verify problem
  FAILED     any other exception, or a verify "internal" problem: a bug
  CRASHED    the worker process died (native code on a hostile file)
  HUNG       no answer within the time limit

Exit code 0 only when nothing FAILED, CRASHED or HUNG.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import random
import resource
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

CASE_SECONDS = 60
BASES = [("webdataset", "jpeg"), ("webdataset", "raw"), ("lmdb", "jpeg"), ("lmdb", "raw"), ("hdf5", "jpeg"),
         ("hdf5", "raw")]  # fmt: skip
DAMAGE = ("flip", "flip-resealed", "insert-resealed", "truncate", "truncate-resealed", "manifest",
          "manifest-resealed", "errors-log")  # fmt: skip


def build_bases(root: Path) -> dict[str, Path]:
    from shardkit.core.config import EncodeConfig, PackConfig, ResizeConfig
    from shardkit.packing.pack import pack
    from shardkit.synthetic import write_image

    source = root / "source"
    for i in range(24):
        write_image(source / f"c{i % 3}" / f"{i:02d}.jpg", 64 + 7 * i, 48 + 5 * i, seed=i, gray=i % 7 == 0)
    bases = {}
    for name, encode in BASES:
        out = root / f"{name}-{encode}"
        pack(PackConfig(str(source), str(out), format=name, resize=ResizeConfig(40), shard_size=8,
                        encode=EncodeConfig(encode=encode), workers=1))  # fmt: skip
        bases[f"{name}-{encode}"] = out
    return bases


def reseal(folder: Path, manifest: dict[str, Any] | None = None) -> None:
    """Rewrite manifest.json with every shard's true size and sha256 and a fresh checksum."""
    if manifest is None:
        manifest = json.loads((folder / "manifest.json").read_text())
        for shard in manifest["shards"]:
            data = (folder / shard["name"]).read_bytes()
            shard["bytes"], shard["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    if isinstance(manifest, dict):
        content = {key: value for key, value in manifest.items() if key != "checksum"}
        manifest["checksum"] = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))


def random_value(rng: random.Random) -> Any:
    return rng.choice([
        -1, 0, 1, 2**31, 2**63, 10**30, -(10**30), 1.5, float("nan"), float("inf"), "", "x", "../../etc/passwd",
        "shard-000000.tar", "\udcff", [], [1, "a"], {}, {"a": 1}, None, True, False, "0" * 64, "a" * 10_000,
        json.loads("[" * 50 + "]" * 50),
    ])  # fmt: skip


def edit_json(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """A copy of `value` with one random node replaced, removed or deeply nested."""
    if isinstance(value, dict) and value and rng.random() < 0.8:
        key = rng.choice(list(value))
        if rng.random() < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: edit_json(value[key], rng, depth + 1)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        index = rng.randrange(len(value))
        if rng.random() < 0.1:
            return value[:index] + value[index + 1 :]
        return [*value[:index], edit_json(value[index], rng, depth + 1), *value[index + 1 :]]
    return random_value(rng)


def damage(folder: Path, kind: str, rng: random.Random) -> str:
    """Damage a copied output in place; returns what was done, for the log."""
    manifest = json.loads((folder / "manifest.json").read_text())
    if kind.startswith("manifest"):
        edited = edit_json(manifest, rng)
        if kind.endswith("resealed"):
            reseal(folder, edited)
        else:
            (folder / "manifest.json").write_text(json.dumps(edited))
        return json.dumps(edited)[:200]
    if kind == "errors-log":
        blob = rng.choice([os.urandom(rng.randrange(1, 200)), b"[" * 100_000, b'{"path": 1}\n', b"1\n", b"\xff\n"])
        (folder / "errors.jsonl").write_bytes(blob)
        return f"errors.jsonl = {blob[:40]!r}"
    shard = folder / rng.choice(manifest["shards"])["name"]
    data = bytearray(shard.read_bytes())
    if kind.startswith("flip"):
        offsets = [rng.randrange(len(data)) for _ in range(rng.choice((1, 1, 2, 4, 8)))]
        for offset in offsets:
            data[offset] = rng.randrange(256) if rng.random() < 0.5 else data[offset] ^ (1 << rng.randrange(8))
        what = f"{shard.name}: flipped bytes at {offsets}"
    elif kind.startswith("insert"):
        offset = rng.randrange(len(data))
        data[offset:offset] = os.urandom(rng.choice((1, 7, 512, 4096)))
        what = f"{shard.name}: bytes inserted at {offset}"
    else:
        offset = rng.randrange(len(data))
        del data[offset:]
        what = f"{shard.name}: cut at {offset}"
    shard.write_bytes(bytes(data))
    if kind.endswith("resealed"):
        reseal(folder)
    return what


def exercise(folder: Path) -> tuple[str, str]:
    """Read a damaged output every way: (outcome, detail)."""
    from shardkit.checks.verify import verify
    from shardkit.core.errors import ShardkitError
    from shardkit.readers.dataset import open_shards

    refused = []
    try:
        dataset = open_shards(folder, on_error="raise")
        for run in (
            lambda: list(dataset),
            lambda: [dataset[i] for i in range(len(dataset))],
            lambda: [dataset.get(key) for key in ("c0/00", "c1/01", "missing")],
        ):
            try:
                run()
            except KeyError:
                pass
            except ShardkitError as error:
                refused.append(type(error).__name__)
        dataset.close()
    except ShardkitError as error:
        refused.append(type(error).__name__)
    report = verify(folder, deep=True, workers=1)
    kinds = {problem.kind for problem in report.problems}
    if "internal" in kinds:
        return "FAILED", next(p.detail for p in report.problems if p.kind == "internal")
    if "crashed" in kinds:
        return "CRASHED", "verify: " + next(p.detail for p in report.problems if p.kind == "crashed")
    if refused or kinds:
        return "refused", ",".join(sorted(set(refused) | kinds))
    return "clean", ""


def worker(connection: Any, bases: dict[str, str], scratch: str, seed: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a hostile allocation shows as MemoryError
    while True:
        case = connection.recv()
        if case is None:
            return
        rng = random.Random(seed * 1_000_003 + case)
        base = rng.choice(sorted(bases))
        kind = rng.choice(DAMAGE)
        folder = Path(scratch) / f"case-{case}"
        shutil.copytree(bases[base], folder)
        try:
            what = damage(folder, kind, rng)
            outcome, detail = exercise(folder)
        except Exception as error:
            what = locals().get("what", "")
            outcome, detail = "FAILED", "".join(traceback.format_exception(error))[-1500:]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        connection.send((case, base, kind, outcome, detail, what))


def run_cases(cases: int, seed: int, workers: int) -> list[tuple]:
    context = multiprocessing.get_context("forkserver")
    results: list[tuple] = []
    with tempfile.TemporaryDirectory(prefix="shardkit-fuzz-") as temp:
        bases = {key: str(path) for key, path in build_bases(Path(temp) / "bases").items()}
        todo = list(range(cases))
        slots: list[dict[str, Any]] = []

        def start() -> dict[str, Any]:
            parent, child = context.Pipe()
            process = context.Process(target=worker, args=(child, bases, temp, seed))  # verify starts children
            process.start()
            child.close()
            return {"process": process, "pipe": parent, "case": None, "since": 0.0}

        slots = [start() for _ in range(workers)]
        while todo or any(slot["case"] is not None for slot in slots):
            for index, slot in enumerate(slots):
                if slot["case"] is None and todo:
                    slot["case"], slot["since"] = todo.pop(0), time.monotonic()
                    slot["pipe"].send(slot["case"])
                if slot["case"] is None:
                    continue
                rng = random.Random(seed * 1_000_003 + slot["case"])
                base, kind = rng.choice(sorted(bases)), rng.choice(DAMAGE)
                try:
                    if slot["pipe"].poll(0.01):
                        results.append(slot["pipe"].recv())
                        slot["case"] = None
                        continue
                except EOFError:
                    slot["process"].join()
                    results.append((slot["case"], base, kind, "CRASHED", f"exit {slot['process'].exitcode}", ""))
                    slots[index] = start()
                    continue
                if time.monotonic() - slot["since"] > CASE_SECONDS:
                    slot["process"].kill()
                    slot["process"].join()
                    results.append((slot["case"], base, kind, "HUNG", f"over {CASE_SECONDS}s", ""))
                    slots[index] = start()
        for slot in slots:
            slot["pipe"].send(None)
            slot["process"].join(10)
    return sorted(results)


def summarize(results: list[tuple]) -> tuple[str, bool]:
    table = Counter((base, kind, outcome) for _, base, kind, outcome, _, _ in results)
    outcomes = ("clean", "refused", "FAILED", "CRASHED", "HUNG")
    lines = [f"{'output':<18} {'damage':<18} " + " ".join(f"{o:>8}" for o in outcomes)]
    for base in sorted({r[1] for r in results}):
        for kind in DAMAGE:
            counts = [table[(base, kind, outcome)] for outcome in outcomes]
            if sum(counts):
                lines.append(f"{base:<18} {kind:<18} " + " ".join(f"{c:>8}" for c in counts))
    totals = Counter(r[3] for r in results)
    lines.append(f"{len(results)} cases: " + ", ".join(f"{totals[o]} {o}" for o in outcomes))
    bad = [r for r in results if r[3] in ("FAILED", "CRASHED", "HUNG")]
    for case, base, kind, outcome, detail, what in bad[:10]:
        lines.append(f"\n{outcome} case {case} ({base}, {kind}): {what}\n{detail}")
    return "\n".join(lines), not bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", type=Path, help="write every case's outcome here")
    args = parser.parse_args()
    started = time.perf_counter()
    results = run_cases(args.cases, args.seed, args.workers)
    text, ok = summarize(results)
    print(text)
    print(f"({time.perf_counter() - started:.0f}s, seed {args.seed})")
    if args.json:
        keys = ("case", "output", "damage", "outcome", "detail", "what")
        args.json.write_text(json.dumps([dict(zip(keys, r, strict=True)) for r in results], indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

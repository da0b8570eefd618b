"""The pack driver's memory on a huge URL table: walked and planned, nothing downloaded.

usage: python scripts/bench_table_memory.py [--rows 10000000] [--kind parquet|csv|jsonl]
           [--row-group 100000] [--table PATH]

A table of --rows rows (url https://example.invalid/i/<n>.jpg, a caption of ~100 characters, an int
column) is written streamed, a batch of --row-group rows at a time (a parquet row group each), to a
temporary folder, or to --table, kept and reused by later runs when it holds --rows rows. A child
process then does what `shardkit pack TABLE OUT --resize 256` does before its first download:
`pack_config`, `prepare` (the walk) and `plan_shards` over the walk's items as packing/pack.py cuts
them, consuming the stream; it prints rows, shards, seconds (and when the first shard was cut: the
wait before a worker can start) and its peak RSS, and the peak before the walk (interpreter and
imports). The issue's goal: under 300 MB.

Peak RSS is the child's VmHWM. getrusage's ru_maxrss is printed beside it but is only right because
the table is written by a process of its own: Linux keeps ru_maxrss across exec, so a child spawned
by a parent holding 500 MB reports at least 500 MB before its first line runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchkit import WARM_CHUNK, pythonpath_env

CHILD = """
import json, resource, sys, time
from shardkit.core.pack_options import pack_config
from shardkit.formats import get_format
from shardkit.packing.pack import prepare
from shardkit.packing.plan import plan_shards

def peaks():
    hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    return int(hwm.split()[1]) / 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

imported = peaks()[0]
started = time.perf_counter()
config = pack_config(sys.argv[1], sys.argv[2], resize=256)
found = prepare(config, None).found
items = shards = 0
first = None
specs = plan_shards(found.items, suffix=get_format(config.format).suffix, shard_size=config.shard_size,
                    shard_bytes=config.shard_bytes, shuffle=config.shuffle, seed=config.seed)
for spec in specs:
    first = time.perf_counter() - started if first is None else first
    shards += 1
    items += len(spec.items)
seconds = time.perf_counter() - started
hwm, maxrss = peaks()
print(json.dumps({"items": items, "skipped": sum(1 for _ in found.skipped), "shards": shards, "seconds": seconds,
                  "first_shard": first, "peak_mb": hwm, "ru_maxrss_mb": maxrss, "imported_mb": imported}))
"""


def caption(n: int) -> str:
    return f"photo {n}: a tabby cat sitting on a sunny windowsill, looking at the birds outside, #{n % 997}"


def batches(rows: int, size: int) -> Iterator[dict[str, list[Any]]]:
    for start in range(0, rows, size):
        numbers = range(start, min(rows, start + size))
        yield {
            "url": [f"https://example.invalid/i/{n}.jpg" for n in numbers],
            "caption": [caption(n) for n in numbers],
            "aesthetic": [n % 10 for n in numbers],
        }


def write_table(path: Path, rows: int, size: int, kind: str) -> None:
    """The table, a batch at a time: this process never holds more than one batch either."""
    import pyarrow as pa

    if kind == "jsonl":
        with open(path, "w", encoding="utf-8") as out:
            for batch in batches(rows, size):
                columns = zip(*batch.values(), strict=True)
                out.writelines(json.dumps(dict(zip(batch, row, strict=True))) + "\n" for row in columns)
        return
    schema = pa.schema([("url", pa.string()), ("caption", pa.string()), ("aesthetic", pa.int64())])
    if kind == "parquet":
        import pyarrow.parquet as pq

        with pq.ParquetWriter(path, schema) as writer:
            for batch in batches(rows, size):
                writer.write_table(pa.table(batch, schema=schema), row_group_size=size)
    else:
        import pyarrow.csv as pacsv

        with pacsv.CSVWriter(path, schema) as writer:
            for batch in batches(rows, size):
                writer.write_table(pa.table(batch, schema=schema))


def rows_held(path: Path, kind: str) -> int | None:
    """How many rows a kept table holds (None when it is missing or not cheap to tell)."""
    if not path.exists():
        return None
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as handle:
        return sum(1 for _ in handle) - (kind == "csv")


def warm(path: Path) -> None:
    """Read `path` once, untimed: this machine's page cache forgets a file left alone for ~30 s."""
    with open(path, "rb", buffering=0) as handle:
        while handle.read(WARM_CHUNK):
            pass


def ensure_table(args: argparse.Namespace, table: Path) -> None:
    """The table at `table`, written by a child process (see the module's note on ru_maxrss)."""
    command = [sys.executable, __file__, "--write-only", "--table", str(table), "--rows", str(args.rows),
               "--kind", args.kind, "--row-group", str(args.row_group)]  # fmt: skip
    subprocess.run(command, check=True)


def measure(table: Path, out: Path) -> dict[str, float]:
    warm(table)
    done = subprocess.run([sys.executable, "-c", CHILD, str(table), str(out)], capture_output=True, text=True,
                          env=pythonpath_env())  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--kind", choices=("parquet", "csv", "jsonl"), default="parquet")
    parser.add_argument("--row-group", type=int, default=100_000, help="rows per written batch (parquet row group)")
    parser.add_argument("--table", type=Path, help="keep the table here, and reuse it when it has --rows rows")
    parser.add_argument("--write-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.write_only:
        if rows_held(args.table, args.kind) != args.rows:
            started = time.perf_counter()
            write_table(args.table, args.rows, args.row_group, args.kind)
            print(f"wrote {args.table} ({args.rows:,} rows) in {time.perf_counter() - started:.0f}s", file=sys.stderr)
        return
    with tempfile.TemporaryDirectory(prefix="bench-table-memory-") as temp:
        table = args.table or Path(temp) / f"urls.{args.kind}"
        ensure_table(args, table)
        size_mb = table.stat().st_size / 1e6
        found = measure(table, Path(temp) / "out")
    verdict = "under" if found["peak_mb"] < 300 else "OVER"
    print(f"{args.kind} table, {args.rows:,} rows ({size_mb:,.0f} MB): {found['items']:,} items, "
          f"{found['skipped']:,} skipped, {found['shards']:,} shards; walked and planned in {found['seconds']:.1f}s, "
          f"the first shard cut after {found['first_shard']:.1f}s")  # fmt: skip
    print(f"driver peak RSS {found['peak_mb']:.0f} MB (VmHWM; getrusage says {found['ru_maxrss_mb']:.0f} MB; "
          f"{found['imported_mb']:.0f} MB after imports): {verdict} the 300 MB goal")  # fmt: skip
    if found["items"] + found["skipped"] != args.rows:
        print(f"warning: {found['items'] + found['skipped']:,} items and skips for {args.rows:,} rows")


if __name__ == "__main__":
    main()

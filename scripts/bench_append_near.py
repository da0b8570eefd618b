"""An append's near-duplicate decision (--dedup near) against a large output, with and without
looking the new files up in the output's records (issue #48).

usage: python scripts/bench_append_near.py [--records 1000000] [--new 10000] [--threshold 10]
           [--repeats 3]

Hashes are generated (random 64-bit values; a tenth of the new files a few bits from a record, a
tenth of them near each other), the input `keep_first` gets from an append: the output's records as
`Earlier`, the new files as `Hashed`. Timed in this process, same run, alternating: `keep_first` as
it runs (the new files looked up, then only the records near them grouped), and with the lookup
budget at 0, which groups every record with the new files, as an append did before. Both must
decide the same; the script checks it. Prints seconds, the ratio and the load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from shardkit.packing import dedup
from shardkit.packing.dedup import Earlier, Hashed, keep_first
from shardkit.packing.sources import Item


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--new", type=int, default=10_000)
    parser.add_argument("--threshold", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    records = rng.integers(0, 2**63, args.records, dtype=np.uint64)
    new = rng.integers(0, 2**63, args.new, dtype=np.uint64)
    tenth = args.new // 10
    flips = np.uint64(1) << rng.integers(0, 64, (tenth, 3)).astype(np.uint64)
    new[:tenth] = records[rng.integers(0, args.records, tenth)] ^ flips[:, 0] ^ flips[:, 1]
    new[tenth : 2 * tenth] = new[2 * tenth : 3 * tenth] ^ flips[:, 2]
    earlier = Earlier(
        [f"r{n}" for n in range(args.records)], [f"/r/{n}.jpg" for n in range(args.records)],
        [None] * args.records, records, np.ones(args.records, bool),
    )  # fmt: skip
    items = [Item(f"/n/{n}.jpg", f"{n}.jpg", f"n{n}") for n in range(args.new)]
    table = Hashed([None] * args.new, new, np.ones(args.new, bool), [])
    budget = dedup._LOOKUP_BUDGET_PER_RECORD
    print(f"load average before: {os.getloadavg()}")
    times: dict[str, list[float]] = {"looked up": [], "all grouped (before)": []}
    answers = {}
    for _ in range(args.repeats):
        for name, per_record in (("looked up", budget), ("all grouped (before)", 0)):
            dedup._LOOKUP_BUDGET_PER_RECORD = per_record
            started = time.perf_counter()
            result = keep_first(items, table, args.threshold, earlier)
            times[name].append(time.perf_counter() - started)
            answers[name] = ([i.key for i in result.kept], [(r.path, r.duplicate_of) for r in result.dropped])
    dedup._LOOKUP_BUDGET_PER_RECORD = budget
    assert answers["looked up"] == answers["all grouped (before)"], "the two decided differently"
    _, dropped = answers["looked up"]
    print(f"{args.records:,} records, {args.new:,} new files, threshold {args.threshold}: {len(dropped):,} dropped")
    for name, seconds in times.items():
        print(f"  {name:22} {statistics.median(seconds):7.2f} s  [{min(seconds):.2f}-{max(seconds):.2f}]")
    ratio = statistics.median(times["all grouped (before)"]) / statistics.median(times["looked up"])
    print(f"  looked up: {ratio:.1f}x faster; load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()

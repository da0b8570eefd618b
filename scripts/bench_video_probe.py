"""Video probe throughput against its floor, both measured in this run: PyAV opening each file and
decoding its first frame, in the same number of processes (the least a probe that counts a video
readable only once a frame decodes can do).

usage: python scripts/bench_video_probe.py [--links 2000] [--workers 2] [--repeat 3]

A few generated videos (mp4 H.264, webm VP9, avi MPEG-4, mkv; 320x240, 2 s) are hard-linked
--links times into class folders; warm cache. Rounds alternate the two methods; the ratio is taken
within each round, so a noisy neighbour slows both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from benchkit import ratios, span

from shardkit.packing.video_probe import probe_videos
from shardkit.synthetic import write_video

SOURCES = ("a.mp4", "b.webm", "c.avi", "d.mkv")


def make_tree(root: Path, links: int) -> list[str]:
    originals = root / "originals"
    for index, name in enumerate(SOURCES):
        write_video(originals / name, 320, 240, seconds=2.0, fps=24, seed=index)
    paths = []
    for index in range(links):
        name = SOURCES[index % len(SOURCES)]
        target = root / "tree" / f"class_{index % 10}" / f"v{index:06d}{Path(name).suffix}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(originals / name, target)
        paths.append(str(target))
    return paths


def first_frames(paths: list[str]) -> int:
    """The floor's job: open, decode one frame, close."""
    import av

    for path in paths:
        with av.open(path) as container:
            next(container.decode(video=0))
    return len(paths)


def floor(paths: list[str], workers: int) -> float:
    chunks = [paths[start : start + 16] for start in range(0, len(paths), 16)]
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        assert sum(pool.map(first_frames, chunks)) == len(paths)
    return len(paths) / (time.perf_counter() - started)


def shardkit(root: Path, count: int, workers: int) -> float:
    started = time.perf_counter()
    report = probe_videos(root, workers=workers)
    assert report.videos == count, report.problems
    return count / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--links", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        root = Path(temp)
        paths = make_tree(root, args.links)
        first_frames(paths[: len(SOURCES)])  # warm: the imports, the page cache of the originals
        probe_rates, floor_rates = [], []
        for _ in range(args.repeat):
            probe_rates.append(shardkit(root / "tree", len(paths), args.workers))
            floor_rates.append(floor(paths, args.workers))
        print(f"{len(paths):,} videos (hard links of {len(SOURCES)}), {args.workers} processes, {args.repeat} rounds")
        print(f"shardkit probe       {statistics.median(probe_rates):8,.0f} videos/s  {span(probe_rates)}")
        print(f"floor (first frame)  {statistics.median(floor_rates):8,.0f} videos/s  {span(floor_rates)}")
        shares = ratios(probe_rates, floor_rates)
        print(f"probe / floor        {statistics.median(shares):8.2f}x  {span(shares)}")


if __name__ == "__main__":
    main()

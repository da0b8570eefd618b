"""What packing clips buys a video training job: clips/s of the clip loader (ds.loader(frames=T))
against decoding the same clips from the source videos with PyAV, on the same threads, in one run.

usage: PYTHONPATH=. python scripts/bench_video.py [--sources 3] [--seconds 10] [--width 1280] [--height 720]
           [--fps 30] [--clip-seconds 2] [--clip-fps 8] [--short 256] [--size 224] [--workers 2] [--batch 8]
           [--rounds 3] [--json out.json] [--keep DIR]

Sources: --sources videos from synthetic.write_video (H.264 mp4, --width x --height at --fps, a
keyframe every 2 s). Clips, as pack will cut them: every --clip-seconds of each source, at --clip-fps,
resized to --short on the short side and encoded as H.264 MP4 clips with tests/video_clips.py's
encoder, into a webdataset output (pack cannot cut clips yet). Passes, each a full epoch of the same
clips, T = clip-seconds x clip-fps frames each, random-resized crop to --size, flip:
  loader     ds.loader(--batch, --size, frames=T, workers=--workers, output="numpy"), FFmpeg 1 thread a clip
  loader-ff2 the same with 2 FFmpeg threads a clip (readers/clips.DECODE_THREADS)
  source     each clip from its source on a pool of --workers threads: open, seek to its start (the
             keyframe before it), decode to its end, take the frames at the clip's times, crop to a
             random-resized window of the source's size, resize to --size, flip (Pillow, as the loader)
Printed: each pass's median images/s (frames out) and clips/s, and the median of the per-round ratios
loader / source with their range (benchkit.ratios: the machine is shared).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from benchkit import REPO, environment, ratios, span
from PIL import Image

sys.path.insert(0, str(REPO))

import shardkit
from shardkit.formats.base import Record
from shardkit.readers import clips as clip_module
from shardkit.readers.clips import frame_rgb
from shardkit.readers.dataset import open_shards
from shardkit.readers.windows import random_resized_boxes
from shardkit.synthetic import video_frame, write_video
from tests.video_clips import clip_meta, clip_mp4, write_output


def make_sources(folder: Path, args: argparse.Namespace) -> list[Path]:
    return [write_video(folder / f"v{i}.mp4", args.width, args.height, args.seconds, args.fps, seed=i,
                        gop=2 * args.fps) for i in range(args.sources)]  # fmt: skip


def clip_times(args: argparse.Namespace) -> list[float]:
    return [s * args.clip_seconds for s in range(int(args.seconds // args.clip_seconds))]


def source_index(start: float, j: int, args: argparse.Namespace) -> int:
    """The source frame shown at the clip's frame j (the clip's time, to the source's frame before it)."""
    return int(round(start * args.fps + j * args.fps / args.clip_fps, 6))


def make_clips(folder: Path, sources: list[Path], args: argparse.Namespace) -> Path:
    """The clips pack would cut: frames at clip-fps, resized to the short side, H.264."""
    frames = round(args.clip_seconds * args.clip_fps)
    stored_h = args.short
    stored_w = round(args.width * args.short / args.height / 2) * 2  # (even: yuv420p)
    records = []
    for i, _ in enumerate(sources):
        for start in clip_times(args):
            shown = [video_frame(args.width, args.height, source_index(start, j, args), i) for j in range(frames)]
            small = [Image.fromarray(f).resize((stored_w, stored_h), Image.Resampling.BILINEAR) for f in shown]
            pixels = [np.asarray(image) for image in small]
            meta = clip_meta(frames, args.width, args.height, args.clip_fps, source=f"v{i}.mp4", start=start,
                             end=start + args.clip_seconds, stored_width=stored_w, stored_height=stored_h)  # fmt: skip
            data = clip_mp4(pixels, args.clip_fps, "veryfast", 20)
            records.append(Record(f"v{i}-{round(start * 1000):07d}", data, "mp4", i, meta))
    return write_output(folder / "clips", "webdataset", [records])


def loader_pass(output: Path, args: argparse.Namespace, threads: int) -> int:
    frames = round(args.clip_seconds * args.clip_fps)
    loader = open_shards(output).loader(args.batch, args.size, frames=frames, flip=True, workers=args.workers,
                                        output="numpy")  # fmt: skip
    clip_module.DECODE_THREADS = threads  # (read at each clip: kept for the whole epoch)
    try:
        return sum(len(batch.keys) for batch in loader)
    finally:
        clip_module.DECODE_THREADS = 1


def source_clip(path: Path, start: float, index: int, args: argparse.Namespace) -> np.ndarray:
    """One clip straight from its source: seek, decode to its end, crop and resize its frames."""
    import av

    frames = round(args.clip_seconds * args.clip_fps)
    wanted = {source_index(start, j, args): j for j in range(frames)}
    rng = np.random.default_rng([index, 0x6C6F6164])
    left, top, w, h = random_resized_boxes(np.array([args.width]), np.array([args.height]), rng)[0]
    flip = rng.random() < 0.5
    out = np.empty((frames, args.size, args.size, 3), np.uint8)
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_count = 1
        container.seek(int(start / stream.time_base), stream=stream, backward=True)
        for frame in container.decode(stream):
            number = round(float(frame.pts * stream.time_base) * args.fps)
            if number in wanted:
                image = Image.fromarray(frame_rgb(frame)).resize((args.size, args.size), Image.Resampling.BILINEAR,
                                                box=(left, top, left + w, top + h))  # fmt: skip
                out[wanted[number]] = np.asarray(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image)
            if number >= max(wanted):
                break
    return out


def source_pass(sources: list[Path], args: argparse.Namespace) -> int:
    jobs = [(path, start) for path in sources for start in clip_times(args)]
    with ThreadPoolExecutor(args.workers) as pool:
        done = list(pool.map(lambda job: source_clip(job[1][0], job[1][1], job[0], args), enumerate(jobs)))
    return len(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("sources", 3), ("seconds", 10.0), ("width", 1280), ("height", 720), ("fps", 30),
                          ("clip-seconds", 2.0), ("clip-fps", 8), ("short", 256), ("size", 224), ("workers", 2),
                          ("batch", 8), ("rounds", 3)):  # fmt: skip
        parser.add_argument(f"--{name}", type=type(default), default=default)
    parser.add_argument("--json")
    parser.add_argument("--keep", help="a folder to keep the sources and clips in, and reuse them from")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-video-"))
    try:
        began = time.perf_counter()
        made = (folder / "clips" / "manifest.json").exists()
        sources = sorted((folder / "src").glob("v*.mp4")) if made else make_sources(folder / "src", args)
        output = folder / "clips" if made else make_clips(folder, sources, args)
        print(f"made {len(sources)} sources and {len(clip_times(args)) * len(sources)} clips "
              f"in {time.perf_counter() - began:.0f} s", flush=True)  # fmt: skip
        frames = round(args.clip_seconds * args.clip_fps)
        passes = {"loader": lambda: loader_pass(output, args, 1), "loader-ff2": lambda: loader_pass(output, args, 2),
                  "source": lambda: source_pass(sources, args)}  # fmt: skip
        rates: dict[str, list[float]] = {name: [] for name in passes}
        for round_ in range(args.rounds):
            names = list(passes)[round_ % len(passes) :] + list(passes)[: round_ % len(passes)]
            for name in names:
                began = time.perf_counter()
                clips = passes[name]()
                rates[name].append(clips / (time.perf_counter() - began))
        results: dict[str, Any] = {"environment": environment(shardkit.__version__), "args": vars(args)}
        for name, values in rates.items():
            clips_s = statistics.median(values)
            print(f"{name:11s} {clips_s * frames:8.0f} images/s (frames) {clips_s:7.1f} clips/s")
            results[name] = {"clips_per_s": values, "frames_per_s": [v * frames for v in values]}
        for name in ("loader", "loader-ff2"):
            found = ratios(rates[name], rates["source"])
            print(f"{name} / source: {statistics.median(found):.1f}x {span(found)}")
            results[f"{name}/source"] = found
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

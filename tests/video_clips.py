"""Clip records made by hand, as pack will make them (core/clips.py's contract), for the read side's
tests and bench while pack cannot cut clips yet: an in-memory H.264 MP4 and outputs of any format."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from shardkit.core.manifest import Manifest, ShardInfo, sha256_file, write_json_atomic
from shardkit.formats import get_format
from shardkit.formats.base import Record
from shardkit.synthetic import video_frame


def clip_mp4(
    frames: Sequence[np.ndarray] | np.ndarray, fps: int = 8, preset: str = "ultrafast", crf: int = 16
) -> bytes:
    """An MP4 of H.264 yuv420p at constant `fps`, its first frame a keyframe, from HxWx3 uint8 frames."""
    import av

    buffer = io.BytesIO()
    height, width = frames[0].shape[:2]
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps, options={"preset": preset, "crf": str(crf)})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for pixels in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def clip_meta(frames: int, width: int, height: int, fps: int = 8, **more: Any) -> dict[str, Any]:
    meta = {"source": "v.mp4", "start": 0.0, "end": frames / fps, "fps": fps, "frames": frames, "width": width,
            "height": height, "stored_width": width, "stored_height": height, "codec": "h264"}  # fmt: skip
    return {**meta, **more}


def clip_record(key: str, label: int | None, frames: int = 6, width: int = 64, height: int = 48,
                first: int = 0, seed: int = 0) -> Record:  # fmt: skip
    """A clip of synthetic.video_frame's frames first .. first + frames - 1 (each says its number)."""
    pixels = [video_frame(width, height, first + i, seed) for i in range(frames)]
    return Record(key, clip_mp4(pixels), "mp4", label, clip_meta(frames, width, height))


def write_output(folder: Path, name: str, shards: Sequence[Sequence[Record]]) -> Path:
    """An output of `name`'s format holding `shards`, with a sealed manifest, as pack leaves one."""
    folder.mkdir(parents=True)
    infos = []
    for number, records in enumerate(shards):
        path = folder / f"shard-{number:06d}{get_format(name).suffix}"
        writer = get_format(name).writer(str(path))
        for record in records:
            writer.add(record)
        writer.close()
        infos.append(ShardInfo(path.name, len(records), path.stat().st_size, sha256_file(path)))
    count = sum(len(records) for records in shards)
    totals = {"inputs": count, "records": count, "errors": 0}
    write_json_atomic(folder / "manifest.json", Manifest(name, infos, totals=totals).sealed().to_json())
    (folder / "errors.jsonl").write_text("")
    return folder

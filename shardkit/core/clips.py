"""What a video clip is once packed: the contract between the write side (probe and pack cut
videos into clips) and the read side (Sample.video, the clip loader). Shared here, in core, because
neither side imports the other.

A clip is one record: `Record.ext` is CLIP_EXT and `Record.data` an MP4 file (H.264, yuv420p,
constant frame rate, a keyframe at its first frame), so it decodes from its start with PyAV and
plays in any tool. `Record.meta` holds, beyond what an image's meta holds, the keys of CLIP_META."""

from __future__ import annotations

CLIP_EXT = "mp4"
VIDEO_EXTENSIONS = frozenset({"mp4", "m4v", "mov", "mkv", "webm", "avi"})  # what a walk offers as a video
# meta of a clip: `source` (the video's path under SRC), `start` and `end` (seconds on the source's
# timeline), `fps` (the clip's, constant), `frames` (how many it holds), `width`/`height` (the
# source as displayed), `stored_width`/`stored_height` (the clip's frames), `codec` (the source's)
CLIP_META = ("source", "start", "end", "fps", "frames", "width", "height", "stored_width", "stored_height", "codec")

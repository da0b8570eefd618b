"""A folder of videos (pack --clip-seconds, probe of a folder holding videos): class sub-folders or
flat, walked as the image folder convention walks images (folder.py), one `Item` per video file.
The worker cuts each item into clips (packing/clips.py); images beside the videos are listed as
skipped, never packed with them."""

from __future__ import annotations

import os

from .folder import VIDEO_SUFFIXES, from_folder, holds_file
from .item import SourceWalk


def from_videos(root: str, labels: str, keys: bool) -> SourceWalk:
    """The videos of a folder of class sub-folders (a label per top-level folder) or a flat one."""
    found = from_folder(root, labels, keys, VIDEO_SUFFIXES)
    found.layout = "videos"  # (labelled or not: `classes` says)
    return found


def holds_videos(root: str) -> bool:
    """Whether a folder holds a video anywhere below it (stops at the first found): what turns "no
    images found" into the advice to cut the videos into clips."""
    return os.path.isdir(root) and holds_file(root, "", set(), VIDEO_SUFFIXES)

"""Seeded synthetic images and a small realistic dataset, for the demo, tests and benchmarks.

Pictures are smooth gradients with shapes and mild noise, so JPEG sizes and decode costs look
like photographs rather than flat colour or pure noise.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy.typing as npt

# Width x height shares that resemble ImageNet's mix (most are 500x375 or 375x500).
_IMAGENET_LIKE = [((500, 375), 0.45), ((375, 500), 0.15), ((500, 333), 0.12), ((333, 500), 0.04),
                  ((640, 480), 0.06), ((1024, 768), 0.04), ((300, 225), 0.06), ((150, 120), 0.04),
                  ((1600, 1200), 0.02), ((500, 500), 0.02)]  # fmt: skip


def picture(width: int, height: int, seed: int = 0, channels: int = 3) -> npt.NDArray[np.uint8]:
    """An HxWxC uint8 array that compresses like a photo."""
    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    x = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    planes = []
    for _ in range(channels):
        a, b, c = rng.uniform(0.5, 4.0, 3)
        phase = rng.uniform(0, 6.28)
        plane = 0.5 + 0.25 * np.sin(a * 6.28 * x + phase) * np.cos(b * 6.28 * y) + 0.2 * np.sin(c * 6.28 * (x + y))
        planes.append(plane)
    image = np.stack(planes, axis=-1)
    cy, cx = rng.uniform(0.2, 0.8, 2)
    radius = rng.uniform(0.1, 0.3)
    disc = ((y - cy) ** 2 + (x - cx) ** 2) < radius**2
    image[disc] = rng.uniform(0, 1, channels)
    image += rng.normal(0, 0.03, image.shape).astype(np.float32)
    # numpy's stubs type np.clip of an array of unknown dtype as Any; astype makes it uint8
    pixels: npt.NDArray[np.uint8] = (np.clip(image, 0, 1) * 255).astype(np.uint8)
    return pixels


def encode(array: np.ndarray, fmt: str = "JPEG", **options: object) -> bytes:
    buffer = io.BytesIO()
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[array.shape[2] if array.ndim == 3 else 1]
    Image.fromarray(array.squeeze() if mode == "L" else array, mode).save(buffer, fmt, **options)
    return buffer.getvalue()


def write_image(path: str | os.PathLike[str], width: int, height: int, seed: int = 0, **options: object) -> Path:
    """Write a synthetic image; the format follows the extension (.jpg, .png, .webp, .gif, .bmp)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = Image.registered_extensions()[path.suffix.lower()]
    gray = bool(options.pop("gray", False))
    array = picture(width, height, seed, 1 if gray else 3)
    if fmt == "JPEG":
        options.setdefault("quality", 90)
    path.write_bytes(encode(array, fmt, **options))
    return path


def rotated_jpeg(path: str | os.PathLike[str], width: int, height: int, orientation: int, seed: int = 0) -> Path:
    """A JPEG stored at width x height with an EXIF orientation tag."""
    exif = Image.Exif()
    exif[0x0112] = orientation
    return write_image(path, width, height, seed, exif=exif.tobytes())


def make_sample_dataset(out: str | os.PathLike[str], images: int = 240, classes: int = 8, seed: int = 0) -> Path:
    """A class-folder dataset with a realistic size mix, a few odd files and one corrupt file."""
    out = Path(out)
    rng = np.random.default_rng(seed)
    sizes, shares = zip(*_IMAGENET_LIKE, strict=False)
    choice = rng.choice(len(sizes), size=images, p=np.array(shares) / sum(shares))
    for i in range(images):
        folder = out / f"n{1000 + i % classes:08d}"
        width, height = sizes[choice[i]]
        name = f"img_{i:05d}"
        if i % 50 == 7:
            write_image(folder / f"{name}.jpg", width, height, seed + i, gray=True)
        elif i % 50 == 13:
            write_image(folder / f"{name}.png", width, height, seed + i)
        elif i % 50 == 21:
            rotated_jpeg(folder / f"{name}.jpg", width, height, orientation=6, seed=seed + i)
        elif i % 50 == 29:
            write_image(folder / f"{name}.jpg", width, height, seed + i, progressive=True)
        elif i % 50 == 37:
            write_image(folder / f"it's a {name}.jpg", width, height, seed + i)
        else:
            write_image(folder / f"{name}.jpg", width, height, seed + i)
    (out / f"n{1000:08d}" / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    return out


VIDEO_CODECS = {".mp4": "libx264", ".mov": "libx264", ".mkv": "libx264", ".webm": "libvpx-vp9", ".avi": "mpeg4"}


def video_frame(width: int, height: int, index: int, seed: int = 0) -> npt.NDArray[np.uint8]:
    """Frame `index` of a generated video: a picture that moves by 3 pixels a frame, with the frame
    number written in its top-left 8x8 block's grey level (index * 8 % 256), so a test can tell
    which frame it got back after a lossy codec."""
    base = picture(width + 256, height, seed)
    shift = (3 * index) % 256
    frame = np.ascontiguousarray(base[:, shift : shift + width])
    frame[:8, :8] = (index * 8) % 256
    return frame


def write_video(
    path: str | os.PathLike[str],
    width: int = 320,
    height: int = 240,
    seconds: float = 2.0,
    fps: int = 24,
    seed: int = 0,
    codec: str | None = None,
    gop: int | None = 12,
    *,
    rotation: tuple[int, bool, bool] | None = None,
    picture: Callable[[int], npt.NDArray[np.uint8]] | None = None,
) -> Path:
    """A real video file written with PyAV (the `video` extra): the container from the suffix (.mp4,
    .mov, .mkv, .webm, .avi), the codec its common one (H.264, VP9 for .webm, MPEG-4 for .avi) unless
    given; frames from `video_frame` (or `picture(index)`, of width x height), at constant `fps`, a
    keyframe every `gop` frames (None: the codec's own interval). `rotation` (degrees counter-
    clockwise, hflip, vflip) is the display matrix a player turns and mirrors the frames by."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec or VIDEO_CODECS[path.suffix.lower()], rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if rotation is not None:
            degrees, hflip, vflip = rotation
            stream.set_display_rotation(degrees, hflip=hflip, vflip=vflip)
        for index in range(round(seconds * fps)):
            pixels = video_frame(width, height, index, seed) if picture is None else picture(index)
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path

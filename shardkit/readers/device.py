"""The loader's device path (`ds.loader(..., device="cuda")`): the loader's threads only read
records and draw the crop windows (the same windows and flips as the CPU path, from the same
seeded generator); decoding, cropping, resizing and flipping happen on the device, a batch at a time.

- Decode: JPEGs through torchvision.io.decode_jpeg on the whole batch's list (nvJPEG's batched
  decode on CUDA); raw (.npy) records are their pixels, copied to the device; anything else
  (PNG, a JPEG the batched call refuses, CMYK) is decoded on the CPU and copied.
- Crop + resize + flip: one batched operation for the whole batch. Pillow's antialiased bilinear
  filter is separable: for each image the taps of its rows and of its columns (reversed for a
  flip), computed on a loader thread from the headers' sizes and the windows (`plan_resample`:
  numpy, vectorized over the batch, Pillow's float64 formulas, a few weights per output pixel)
  and made dense matrices on the device (`dense_taps`: one scatter); the windows, padded to the
  batch's largest, are gathered from the decoded images in one indexed read (`gather_windows`:
  the images laid end to end by one call (`flatten_images`), each window's element offsets
  computed on the device), and the two passes are two batched matmuls, rounded to whole levels
  after each pass as Pillow's integer passes are.
  The same filter as the CPU loader, not an approximation of it (roi_align averages point
  samples; grid_sample does not antialias): the CPU loader differs only where it decodes at a DCT
  scale (a box at least twice the output), which the device path does not do (full-size decode).
- Output: uint8 (N, 3, H, W), or normalized ((x / 255 - mean) / std) float16, bfloat16 or float32,
  in channels_last memory, on the device.
- No host waits: what the device needs from the host (the taps' and windows' numbers, the labels,
  mean and std) goes up in a few pinned, non-blocking copies (`to_device`); a copy from pageable
  memory waits for the stream's earlier work first. The device decoder's lane runs the decode on one
  thread of its own and the rest on another, on a side stream, a batch or two ahead of the batch
  being trained on (readers/device_decoder.py).

With device="cpu" the same torch code runs on the CPU: that is how CI tests it (no GPU there).

One difference from the CPU loader on bad input: a JPEG whose entropy data is damaged (its headers
whole) decodes here with grey blocks where the damage is, as nvJPEG and torchvision decode it; the
CPU kernel refuses it on libjpeg's warning. `shardkit verify --deep` finds such records.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..core.errors import ConfigError, ImageError
from ..formats.base import Record
from .decode import decode

_JPEG = ("jpg", "jpeg")


def check_device(torch: Any, device: Any) -> Any:
    """A torch.device for `device`, refused in one line where it cannot run."""
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r} ({error})") from None
    if where.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device={device!r}, but torch sees no CUDA device (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda}); use device='cpu' or leave device out for the CPU loader"
            )
        if where.index is not None and where.index >= torch.cuda.device_count():
            raise ConfigError(f"device={device!r}: torch sees {torch.cuda.device_count()} CUDA device(s)")
    elif where.type != "cpu":
        raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', not {device!r}")
    return where


def check_normalize(
    torch: Any, dtype: Any, mean: Sequence[float] | None, std: Sequence[float] | None
) -> tuple[Any, Any, Any]:
    """(dtype, mean, std) as the device path uses them: uint8 output when dtype is None."""
    if dtype is None:
        if mean is not None or std is not None:
            raise ConfigError("mean and std need a floating dtype (torch.float16, torch.bfloat16 or torch.float32)")
        return None, None, None
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ConfigError(f"dtype must be torch.float16, torch.bfloat16 or torch.float32, not {dtype!r}")
    mean = (0.0, 0.0, 0.0) if mean is None else tuple(float(v) for v in mean)
    std = (1.0, 1.0, 1.0) if std is None else tuple(float(v) for v in std)
    if len(mean) != 3 or len(std) != 3 or not all(math.isfinite(v) for v in (*mean, *std)) or min(std) <= 0:
        raise ConfigError(f"mean and std must be 3 finite numbers (std > 0), not {mean} and {std}")
    return dtype, mean, std


def filter_taps(in_size: int, in0: float, in1: float, out_size: int) -> tuple[np.ndarray, int]:
    """Pillow's antialiased bilinear filter for the span in0..in1 of an in_size line resized to
    out_size (precompute_coeffs, support 1, as shardkit/core/_crop.c): (out_size, taps) weights
    as a dense (out_size, end - first) matrix over source pixels first..end, and `first`."""
    scale = (in1 - in0) / out_size
    filterscale = max(scale, 1.0)
    support = filterscale
    centers = in0 + (np.arange(out_size) + 0.5) * scale
    lows = np.maximum((centers - support + 0.5).astype(np.int64), 0)  # (int() truncates toward 0: >= -0.5 here)
    highs = np.minimum((centers + support + 0.5).astype(np.int64), in_size)
    first, end = int(lows.min()), int(highs.max())
    x = np.arange(first, end)
    weights = np.clip(1.0 - np.abs((x[None, :] - centers[:, None] + 0.5) / filterscale), 0.0, None)
    weights[(x[None, :] < lows[:, None]) | (x[None, :] >= highs[:, None])] = 0.0
    totals = weights.sum(axis=1, keepdims=True)
    weights = np.divide(weights, totals, out=np.zeros_like(weights), where=totals != 0)
    return weights, first


def encoded_jpegs(torch: Any, records: Sequence[Record]) -> list[Any]:
    """The JPEG records' bytes as the CPU uint8 tensors torchvision's decoder takes (nvJPEG copies
    them up itself), None for the others: made on a loader thread, off the device's thread."""
    return [torch.frombuffer(bytearray(r.data), dtype=torch.uint8) if r.ext in _JPEG else None for r in records]


def decode_batch(
    torch: Any, records: Sequence[Record], device: Any, max_pixels: int, encoded: Sequence[Any] | None = None
) -> tuple[list[Any], dict[int, str]]:
    """Each record's image as a (3, H, W) uint8 tensor on `device` (None where it failed), and
    the failures (index -> reason). `encoded`: encoded_jpegs(records), where already made."""
    images: list[Any] = [None] * len(records)
    failures: dict[int, str] = {}
    jpegs = [i for i, record in enumerate(records) if record.ext in _JPEG]
    if jpegs:
        datas = encoded_jpegs(torch, [records[i] for i in jpegs]) if encoded is None else [encoded[i] for i in jpegs]
        _decode_jpegs(torch, datas, jpegs, images, device)
    for i, record in enumerate(records):
        if images[i] is not None:
            continue
        try:  # (raw records: decode_npy's checked copy; PNG, CMYK JPEGs: Pillow)
            pixels = np.require(decode(record.data, record.ext, max_pixels=max_pixels), requirements="W")
            images[i] = torch.from_numpy(pixels).to(device).permute(2, 0, 1)
        except ImageError as error:
            failures[i] = error.reason
        except (ValueError, OSError) as error:  # (what Pillow raises past pillow_errors)
            failures[i] = f"cannot decode ({type(error).__name__}: {error})"
    return images, failures


def _decode_jpegs(torch: Any, datas: list[Any], jpegs: list[int], images: list[Any], device: Any) -> None:
    """The JPEGs `datas` (CPU uint8 tensors) into `images` at `jpegs`, in one batched call (nvJPEG's
    on CUDA: it blocks until the batch is decoded, with the GIL released); a JPEG the call refuses
    stays None (the CPU decode says why, or converts it: CMYK)."""
    # torchvision 0.29 deprecates its decoders in favour of TorchCodec's: the warning is silenced.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            decoded = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:  # one bad (or CMYK) JPEG fails the batched call: one at a time then
            decoded = [None] * len(jpegs)
            for n, data in enumerate(datas):
                with contextlib.suppress(RuntimeError):  # (the CPU decode below says why)
                    decoded[n] = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)
        for i, image in zip(jpegs, decoded, strict=True):
            images[i] = image


# What one resample call holds on the device stays under this: a batch of large photos (256 x 12 MP
# windows would be 37 GB of float32) is resampled a part at a time. A part's cost: its images laid
# end to end (3 bytes a pixel) and, per pixel of its padded windows, WINDOW_PIXEL_BYTES (the float32
# windows, 12; the gather's int64 offsets of one channel, 8; its uint8 result, 1; rounded up).
WINDOW_BYTES = 1 << 30
WINDOW_PIXEL_BYTES = 24


def to_device(torch: Any, array: np.ndarray, device: Any) -> Any:
    """A small host array on `device` without waiting: on CUDA through pinned memory, non-blocking
    (a copy from pageable memory first waits for the stream's earlier work, which would stall the
    thread that queues the batches); on the CPU the array itself."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def resample_batch(
    torch: Any, images: Sequence[Any], boxes: np.ndarray, flips: np.ndarray, size: tuple[int, int]
) -> Any:
    """Crop box i of images[i] (3, H, W) resized to `size` with Pillow's antialiased bilinear
    filter and flipped where flips[i]: (N, 3, out_h, out_w) float32 holding whole levels 0..255."""
    shapes = np.array([(int(image.shape[1]), int(image.shape[2])) for image in images], np.int64).reshape(-1, 2)
    plan = plan_resample(shapes, boxes, flips, size)
    return resample_planned(torch, flatten_images(torch, images), shapes, plan, size)


class LineTaps:
    """filter_taps of a batch of lines, compact: line i's source pixels first[i]..end[i], and for
    each output pixel its taps' weights (float32, summing to 1) at `index` (relative to first[i],
    in that span; a line's unused taps weigh 0 and point at its last pixel). Rows reversed for a flip."""

    def __init__(self, first: np.ndarray, end: np.ndarray, weights: np.ndarray, index: np.ndarray) -> None:
        self.first, self.end, self.weights, self.index = first, end, weights, index

    def take(self, rows: Any) -> LineTaps:
        return LineTaps(self.first[rows], self.end[rows], self.weights[rows], self.index[rows])


def line_taps(
    in_sizes: np.ndarray, in0: np.ndarray, in1: np.ndarray, out_size: int, flips: np.ndarray | None = None
) -> LineTaps:
    """filter_taps of a batch of lines at once, on the host, by the same float64 formulas, without
    a dense matrix: (N, out_size, taps) weights, taps the most any output pixel of the batch has
    (2 x support + 2 at most: 4 to 8 for a 256-pixel photo's crop to 224), a few hundred KB a batch."""
    in_sizes = np.asarray(in_sizes, np.int64)
    in0, in1 = np.asarray(in0, np.float64), np.asarray(in1, np.float64)
    scale = (in1 - in0) / out_size
    support = np.maximum(scale, 1.0)
    centers = in0[:, None] + (np.arange(out_size) + 0.5)[None, :] * scale[:, None]
    lows = np.maximum((centers - support[:, None] + 0.5).astype(np.int64), 0)  # (truncation, as filter_taps)
    highs = np.minimum((centers + support[:, None] + 0.5).astype(np.int64), in_sizes[:, None])
    first, end = lows[:, 0].copy(), highs[:, -1].copy()  # (the centers grow with the output)
    taps = max(int((highs - lows).max(initial=1)), 1)
    x = lows[:, :, None] + np.arange(taps)[None, None, :]
    weights = 1.0 - np.abs((x - centers[:, :, None] + 0.5) / support[:, None, None])
    np.clip(weights, 0.0, None, out=weights)
    weights *= x < highs[:, :, None]
    totals = weights.sum(axis=2, keepdims=True)
    np.divide(weights, totals, out=weights, where=totals != 0)
    index = np.minimum(x, np.maximum(highs, lows + 1)[:, :, None] - 1) - first[:, None, None]
    if flips is not None and np.any(flips):
        flipped = np.asarray(flips, bool)
        weights[flipped] = weights[flipped, ::-1]
        index[flipped] = index[flipped, ::-1]
    return LineTaps(first, end, weights.astype(np.float32), index)


class ResamplePlan:
    """What a batch's resample needs from the host, made from the headers' sizes and the windows on a
    loader thread (numpy, off the device's thread): each image's rows' and columns' taps."""

    def __init__(self, shapes: np.ndarray, rows: LineTaps, cols: LineTaps) -> None:
        self.shapes, self.rows, self.cols = shapes, rows, cols

    def take(self, rows: Any) -> ResamplePlan:
        return ResamplePlan(self.shapes[rows], self.rows.take(rows), self.cols.take(rows))


def plan_resample(shapes: np.ndarray, boxes: np.ndarray, flips: np.ndarray, size: tuple[int, int]) -> ResamplePlan:
    """The taps of crop box i of an image of shapes[i] (height, width) resized to `size`, its columns
    reversed where flips[i]."""
    shapes = np.asarray(shapes, np.int64).reshape(-1, 2)
    heights, widths = shapes[:, 0], shapes[:, 1]
    left, top = boxes[:, 0].astype(np.float64), boxes[:, 1].astype(np.float64)
    cols = line_taps(widths, left, np.minimum(left + boxes[:, 2], widths), size[1], np.asarray(flips, bool))
    rows = line_taps(heights, top, np.minimum(top + boxes[:, 3], heights), size[0])
    return ResamplePlan(shapes, rows, cols)


def flatten_images(torch: Any, images: Sequence[Any]) -> Any:
    """The images (3, H, W) laid end to end, each in C order: one uint8 tensor, in one call (not a
    reshape per image from Python: each call into torch lets another thread take the GIL)."""
    if len(images) == 1:
        return images[0].reshape(-1)
    return torch._utils._flatten_dense_tensors(list(images))  # (one cat of their flat views, as DDP's buckets)


def resample_planned(torch: Any, flat: Any, shapes: np.ndarray, plan: ResamplePlan, size: tuple[int, int]) -> Any:
    """resample_batch of images given laid end to end (`flatten_images`), of `shapes` (N, 2), with
    their `plan`: (N, 3, out_h, out_w) float32 holding whole levels 0..255."""
    shapes = np.asarray(shapes, np.int64).reshape(-1, 2)
    planes = shapes[:, 0] * shapes[:, 1]
    starts = np.concatenate([[0], np.cumsum(3 * planes)[:-1]]).astype(np.int64)
    spans_h, spans_w = plan.rows.end - plan.rows.first, plan.cols.end - plan.cols.first
    parts, start, span, pending = [], 0, (0, 0), 0
    for i in range(len(shapes)):
        grown = (max(span[0], int(spans_h[i])), max(span[1], int(spans_w[i])))
        pixels = 3 * int(planes[i])
        cost = pending + pixels + (i + 1 - start) * WINDOW_PIXEL_BYTES * grown[0] * grown[1]
        if i > start and cost > WINDOW_BYTES:
            parts.append((start, i))
            start, grown, pending = i, (int(spans_h[i]), int(spans_w[i])), 0
        span, pending = grown, pending + pixels
    parts.append((start, len(shapes)))
    pieces = [_resample_part(torch, flat, starts[a:b], shapes[a:b], plan.take(slice(a, b)), size) for a, b in parts]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def dense_taps(torch: Any, taps: LineTaps, span: int, device: Any) -> Any:
    """LineTaps as the matmul takes them, on `device`: (N, out_size, span) float32, line i's weights
    over source pixels first[i]..first[i] + span (zero past its own end). Two copies up, two ops:
    the weights added at their places into zeros (a line's unused taps add an exact 0)."""
    weights, index = to_device(torch, taps.weights, device), to_device(torch, taps.index, device)
    n, out_size, _ = taps.weights.shape
    dense = torch.zeros((n, out_size, span), dtype=torch.float32, device=device)
    return dense.scatter_add_(2, index, weights)


def gather_windows(
    torch: Any, images: Sequence[Any], top: np.ndarray, rows: np.ndarray, left: np.ndarray, cols: np.ndarray
) -> Any:
    """The windows images[i][:, top[i] : top[i] + rows[i], left[i] : left[i] + cols[i]], padded to the
    largest: (N, 3, max rows, max cols) float32, in one indexed read of the images laid end to end
    (no copy per image from Python). The padding repeats each window's last row and column: the
    taps weigh it zero, and a finite level times zero adds exactly nothing."""
    shapes = np.array([(int(image.shape[1]), int(image.shape[2])) for image in images], np.int64).reshape(-1, 2)
    planes = shapes[:, 0] * shapes[:, 1]
    starts = np.concatenate([[0], np.cumsum(3 * planes)[:-1]]).astype(np.int64)
    return _gather_flat(torch, flatten_images(torch, images), starts, shapes, top, rows, left, cols)


def _gather_flat(
    torch: Any,
    flat: Any,
    starts: np.ndarray,
    shapes: np.ndarray,
    top: np.ndarray,
    rows: np.ndarray,
    left: np.ndarray,
    cols: np.ndarray,
) -> Any:
    """gather_windows of images laid end to end in `flat`, image i at element starts[i]."""
    device = flat.device
    n, span_h, span_w = len(shapes), int(rows.max()), int(cols.max())
    planes, widths = shapes[:, 0] * shapes[:, 1], shapes[:, 1]
    numbers = np.stack([starts, planes, widths, top, rows, left, cols], axis=1).astype(np.int64)
    numbers = to_device(torch, numbers, device)
    starts_d, planes_d, widths_d, top_d, rows_d, left_d, cols_d = numbers.unbind(1)
    y = torch.minimum(torch.arange(span_h, device=device)[None, :], rows_d[:, None] - 1) + top_d[:, None]
    x = torch.minimum(torch.arange(span_w, device=device)[None, :], cols_d[:, None] - 1) + left_d[:, None]
    offsets = (starts_d[:, None] + y * widths_d[:, None])[:, :, None] + x[:, None, :]  # channel 0: (N, h, w)
    windows = torch.empty((n, 3, span_h, span_w), dtype=torch.float32, device=device)
    for channel in range(3):
        windows[:, channel] = torch.take(flat, offsets)
        if channel < 2:
            offsets += planes_d[:, None, None]
    return windows


def _resample_part(
    torch: Any, flat: Any, starts: np.ndarray, shapes: np.ndarray, plan: ResamplePlan, size: tuple[int, int]
) -> Any:
    device = flat.device
    rows, cols = plan.rows, plan.cols
    spans_h, spans_w = rows.end - rows.first, cols.end - cols.first
    windows = _gather_flat(torch, flat, starts, shapes, rows.first, spans_h, cols.first, spans_w)
    x_taps = dense_taps(torch, cols, int(spans_w.max()), device)
    y_taps = dense_taps(torch, rows, int(spans_h.max()), device)
    # Columns, then rows (the kernel's order), each pass rounded and clipped to a level as
    # Pillow's fixed-point passes are: (N, 3, h, w) @ (N, 1, w, out_w), then (N, 1, out_h, h) @ that.
    with _full_float32(torch):
        across = torch.matmul(windows, x_taps.transpose(1, 2).unsqueeze(1)).round_().clamp_(0, 255)
        return torch.matmul(y_taps.unsqueeze(1), across).round_().clamp_(0, 255)


@contextlib.contextmanager
def _full_float32(torch: Any) -> Any:
    """float32 matmuls at full precision: a training script's allow_tf32 (or
    set_float32_matmul_precision("high")) would move levels by one. The setting is the process's,
    not the thread's: it is set only while the two matmuls are queued, so a training step queued
    by another thread in that short window runs at full precision too (slower, never less
    exact)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def finish(torch: Any, pixels: Any, dtype: Any, mean: Any, std: Any) -> Any:
    """uint8 levels, or ((x / 255) - mean) / std in `dtype`; channels_last memory either way."""
    if dtype is None:
        out = pixels.to(torch.uint8)
    else:
        shift = to_device(torch, np.asarray(mean, np.float32), pixels.device).view(1, 3, 1, 1)
        scale = to_device(torch, np.asarray(std, np.float32), pixels.device).view(1, 3, 1, 1)
        out = ((pixels / 255.0 - shift) / scale).to(dtype)
    return out.contiguous(memory_format=torch.channels_last)

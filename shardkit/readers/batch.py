"""The batch loader's collate stage: `Batch`, what the loader hands out, made from a decoder's
buffer and records (`Assembly`), its rows taken and batches joined, and full batches made from the
decoded chunks of positions under on_error="skip" (the carry).

The loader decodes a stream as chunks of `batch_size` positions, each chunk's windows and flips
seeded by its number (readers/chunks.py); a record that fails is dropped from its chunk. So that
every batch but an epoch's last holds exactly `batch_size` records, `full_batches` hands the kept
records out in batches of that size: a batch a chunk left short takes the first records of the
next one, the rest of that chunk opening the batch after. Decoding is the same whatever is
skipped (the same chunks, numbers and pixels), and where the stream stands is, besides the count
of positions whose chunks were wholly handed out, a *carry*: how many kept records of the next
chunk batches took, and through which of its positions they reach (readers/order.py,
`Split.carry`). A resumed loader decodes that chunk again, the same way, and drops those records; a
new split of the epoch (another world size) counts the carry's positions as used.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..core.errors import ConfigError
from ..formats.base import Record
from .decode import record_fields
from .epoch import Cursor


class Batch(tuple[Any, Any]):
    """(images, labels), as `for images, labels in loader` wants, with `.keys`, `.texts` and
    `.fields` alongside (lists, one per image, in the order of the images).

    images: uint8 (N, 3, H, W), in channels_last memory (the buffer is N x H x W x 3); labels:
    int64 (N,), -1 for unlabelled records. Torch tensors, or numpy arrays with output="numpy".
    texts: each image's caption (a string, a list of them, or None); fields: its columns (a dict).
    windows: float64 (N, 4) numpy, each image's crop as x0, y0, x1, y1 in its stored pixels;
    flips: bool (N,) numpy, whether it was flipped. With loader(mask=...), masks: uint8 (N, H, W)
    label maps through the same windows and flips; with loader(boxes=...), boxes: per image float32
    (k, 4) x0, y0, x1, y1 in output pixels, and box_index: int64 (k,), which of the record's boxes
    they are (readers/targets.py); with loader(box_labels=...), box_labels: per image int64 (k,),
    the class id of each of those boxes (readers/box_classes.py). None when not asked for.

    With loader(frames=T), a batch of clips: images uint8 (N, T, 3, H, W) (the buffer is
    N x T x H x W x 3), one window and flip per clip, and offsets: int64 (N,) numpy, the first of
    each clip's frames taken (readers/clips.py); offsets is None for images.
    """

    keys: list[str]
    texts: list[str | list[str] | None]
    fields: list[dict[str, Any]]
    windows: np.ndarray | None
    flips: np.ndarray | None
    masks: Any
    boxes: list[Any] | None
    box_index: list[Any] | None
    box_labels: list[Any] | None
    offsets: np.ndarray | None
    kept: list[int] | None  # the rows of its chunk it holds (None: all of them); the loader's own

    def __new__(
        cls,
        images: Any,
        labels: Any,
        keys: list[str],
        texts: list[str | list[str] | None] | None = None,
        fields: list[dict[str, Any]] | None = None,
    ) -> Batch:
        batch = super().__new__(cls, (images, labels))
        batch.keys = keys
        batch.texts = texts if texts is not None else [None] * len(keys)
        batch.fields = fields if fields is not None else [{} for _ in keys]
        batch.windows = batch.flips = batch.masks = batch.offsets = None
        batch.boxes = batch.box_index = batch.box_labels = None
        batch.kept = None
        return batch

    def target_tensors(self) -> list[Any]:
        """The masks', boxes', box indexes' and box labels' tensors (none when not asked for)."""
        found = [] if self.masks is None else [self.masks]
        return [*found, *(self.boxes or ()), *(self.box_index or ()), *(self.box_labels or ())]

    @property
    def images(self) -> Any:
        return self[0]

    @property
    def labels(self) -> Any:
        return self[1]


def labels_of(records: Sequence[Record]) -> np.ndarray:
    """A batch's labels: int64, -1 for an unlabelled record."""
    return np.array([-1 if r.label is None else r.label for r in records], dtype=np.int64)


def add_texts(batch: Batch, records: Sequence[Record]) -> None:
    """The records' captions and fields on their batch (sidecar fields as bytes), where any has one."""
    if any(r.text is not None or r.columns is not None or r.files for r in records):
        batch.texts = [r.text for r in records]
        batch.fields = [record_fields(r, "bytes") for r in records]


class Assembly(NamedTuple):
    """How the loader's batches are made, cut and joined: torch (None for numpy output),
    torchvision's tv_tensors (None without it), and whether CPU images are pinned."""

    torch: Any
    typed: Any
    pin_memory: bool

    def buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        """A batch's uint8 images, N x H x W x 3 (clips: N x T x H x W x 3), pinned where batches are."""
        if self.pin_memory:
            pinned: np.ndarray = self.torch.empty(shape, dtype=self.torch.uint8, pin_memory=True).numpy()
            return pinned
        return np.empty(shape, np.uint8)

    def batch(self, images: np.ndarray, records: Sequence[Record]) -> Batch:
        """A Batch of a buffer's images, seen as (N, 3, H, W) (clips: (N, T, 3, H, W)) while the
        memory stays channels_last, with its records' labels, keys, captions and fields."""
        order = (0, 3, 1, 2) if images.ndim == 4 else (0, 1, 4, 2, 3)
        labels, keys = labels_of(records), [r.key for r in records]
        if self.torch is None:
            batch = Batch(images.transpose(order), labels, keys)
        else:
            batch = Batch(self.torch.from_numpy(images).permute(order), self.torch.from_numpy(labels), keys)
        add_texts(batch, records)
        return batch

    def rows(self, batch: Batch, start: int, stop: int) -> Batch:
        """Rows [start, stop) of a batch (views of its arrays; the batch itself when all of them)."""
        if start == 0 and stop == len(batch.keys):
            return batch
        part = Batch(batch.images[start:stop], batch.labels[start:stop], batch.keys[start:stop],
                     batch.texts[start:stop], batch.fields[start:stop])  # fmt: skip
        for name in ("windows", "flips", "offsets", "boxes", "box_index", "box_labels"):
            value = getattr(batch, name)
            setattr(part, name, None if value is None else value[start:stop])
        if batch.masks is not None:
            part.masks = self._typed_mask(batch.masks[start:stop])
        return part

    def joined(self, parts: list[Batch]) -> Batch:
        """One batch of `parts`' rows in order, images in channels_last memory as each part's."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        images = self._images([part.images for part in parts])
        labels = self._cat([part.labels for part in parts])
        batch = Batch(images, labels, *([row for part in parts for row in getattr(part, name)]
                                        for name in ("keys", "texts", "fields")))  # fmt: skip
        for name in ("windows", "flips", "offsets"):
            if getattr(first, name) is not None:
                setattr(batch, name, np.concatenate([getattr(part, name) for part in parts]))
        for name in ("boxes", "box_index", "box_labels"):
            if getattr(first, name) is not None:
                setattr(batch, name, [row for part in parts for row in getattr(part, name)])
        if first.masks is not None:
            batch.masks = self._typed_mask(self._cat([part.masks for part in parts]))
        return batch

    def _cat(self, arrays: list[Any]) -> Any:
        if isinstance(arrays[0], np.ndarray):
            return np.concatenate(arrays)
        return self.torch.cat(arrays)

    def _images(self, images: list[Any]) -> Any:
        """Images joined in their memory's order (N x H x W x 3, or N x T x H x W x 3 for clips)."""
        clips = images[0].ndim == 5
        inward, outward = ((0, 1, 3, 4, 2), (0, 1, 4, 2, 3)) if clips else ((0, 2, 3, 1), (0, 3, 1, 2))
        if isinstance(images[0], np.ndarray):
            return np.concatenate([image.transpose(inward) for image in images]).transpose(outward)
        joined = self.torch.cat([image.permute(inward) for image in images])
        if self.pin_memory and joined.device.type == "cpu":
            joined = joined.pin_memory()
        return joined.permute(outward)

    def _typed_mask(self, masks: Any) -> Any:
        """Masks typed as torchvision's Mask again (slicing or joining one gives a plain tensor)."""
        if self.typed is None or isinstance(masks, np.ndarray):
            return masks
        return self.typed.Mask(masks)


class Decoded(NamedTuple):
    """A decoded chunk as the loader hands it to `full_batches`."""

    batch: Batch | None  # its kept records, in order (None: none kept)
    positions: int  # the stream positions it covers
    offsets: list[int]  # each kept record's place among them, ascending


def full_batches(
    chunks: Iterable[Decoded], position: Cursor, batch_size: int, drop_last: bool, assembly: Assembly
) -> Iterator[Batch]:
    """Batches of exactly `batch_size` of the chunks' kept records, in order; the last of the epoch
    holds what is left (none with drop_last). Before each is handed out, `position` says where the
    stream stands after it: the positions of every chunk wholly handed out, and a carry for the
    chunk it took only the first records of. A resumed carry (the cursor's, from a state) drops the
    records of the first chunk it says were taken."""
    resumed = position.carry
    waiting: list[Batch] = []
    count = used = 0  # records waiting; positions of chunks wholly taken, not counted yet
    for chunk in chunks:
        kept, at, counted = len(chunk.offsets), 0, False
        if resumed is not None:
            at, resumed = _resumed(chunk, resumed), None
        while at < kept:
            assert chunk.batch is not None
            take = min(batch_size - count, kept - at)
            waiting.append(assembly.rows(chunk.batch, at, at + take))
            count, at = count + take, at + take
            if count < batch_size:
                break
            if at == kept:
                position.advance(used + chunk.positions)
                counted = True
            else:
                position.advance(used)
                position.carry_over(at, chunk.offsets[at - 1] + 1)
            used = 0
            yield assembly.joined(waiting)
            waiting, count = [], 0
        if not counted:
            used += chunk.positions
    position.advance(used)  # (with drop_last, the records left are dropped: the epoch is over)
    if waiting and not drop_last:
        yield assembly.joined(waiting)


def _resumed(chunk: Decoded, carry: tuple[int, int]) -> int:
    """Where a resumed chunk's records start: after the `taken` records a state's carry says batches
    took, those before its position `through`. A state whose carry does not name them (edited,
    or saved on other data or with other loader options: a record that now fails, or no longer
    does) is refused."""
    taken, through = carry
    before = bisect.bisect_left(chunk.offsets, through)
    if before != taken:
        raise ConfigError(
            f"this state's carry says {taken:,} records of its chunk were handed out, and {before:,} of the "
            f"chunk's first {through:,} positions are records here: a state resumes the data and loader "
            "options it was saved with"
        )
    return taken

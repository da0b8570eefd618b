"""What a dataset and a weighted mix share: one epoch's iteration, the batch loader and the torch
IterableDataset over it. Each needs `rank`, `world_size`, `drop_last`, `on_error` (an OnError,
readers/handlers), `epoch`, `max_pixels`, `len()`, `fresh_progress()` and `space()` (readers/epoch,
readers/order); what it offers the loader and the torch glue is readers.epoch.Epochs."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..core.errors import require
from .epoch import Cursor, EpochRecord, Space, check_progress, cursor, decoded, stream_items
from .handlers import OnError
from .order import Progress, check_epoch
from .split import rank_and_world

if TYPE_CHECKING:
    from .box_classes import BoxClasses
    from .loader import BatchLoader
    from .torch_data import ShardIterableDataset


class EpochIteration:
    rank: int | None
    world_size: int | None
    drop_last: bool
    on_error: OnError
    epoch: int
    max_pixels: int  # the largest image a record may claim (a mix: its sources' smallest)

    def __len__(self) -> int:
        raise NotImplementedError

    def epoch_length(self, seed: int, epoch: int) -> int:
        """Positions in the epoch of this seed and number (a mix that stops at its first exhausted
        source: they depend on both)."""
        return len(self)

    def fresh_progress(self) -> Progress:
        raise NotImplementedError

    def space(self, progress: Progress) -> Space:
        raise NotImplementedError

    def box_vocabulary(self, path: str) -> BoxClasses:
        """The classes loader(box_labels=path) numbers boxes by (readers/box_classes.py)."""
        raise NotImplementedError

    def first_items(self) -> list[EpochRecord]:
        """The first record of each output, read without on_error (none where it cannot be read):
        what the batch loader checks its options against when it is made."""
        raise NotImplementedError

    def set_epoch(self, epoch: int) -> None:
        """Changes the shuffle for the next pass (call it on every rank, as with DistributedSampler)."""
        self.epoch = check_epoch(epoch)

    def samples_per_rank(self) -> int:
        """How many samples each rank's iteration yields per epoch (the same on every rank).

        The epoch's sequence (shards in stored or seeded-shuffled order, records in stored order; a
        mix's weighted draws) is cut into one contiguous run per rank, then per DataLoader worker,
        so shards are read as streams and every rank yields exactly this many samples: distributed
        training needs equal step counts on all ranks. When the ranks do not divide the total, the
        last runs wrap around to the start of the sequence (at most world_size - 1 repeats), or
        drop_last=True leaves the remainder out. With one rank, every sample comes exactly once.
        """
        _, world = rank_and_world(self.rank, self.world_size)
        if world == 1:
            return len(self)
        return len(self) // world if self.drop_last else -(-len(self) // world)

    def epoch_items(
        self, progress: Progress | None = None, workers: tuple[int, int] | None = None, carry: bool = False
    ) -> tuple[Cursor, Iterator[EpochRecord | None]]:
        """This rank's and DataLoader worker's stream of the epoch, from where `progress` stands
        (the start of the epoch by default), undecoded: an EpochRecord per position, None where a damaged
        shard was skipped. What iteration decodes and the batch loader crop-decodes; the Cursor
        counts what the consumer took. carry=True: the caller (the batch loader) resumes a state's
        carry itself (readers/batch.py); otherwise its positions count as used."""
        if progress is None:
            progress = self.fresh_progress()
            space = self.space(progress)
        else:
            space = check_progress(self, progress)
        position = cursor(self, progress, space, workers, carry)
        return position, stream_items(space, position.stream, position.done)

    def __iter__(self) -> Iterator[Any]:
        return self.iterate()

    def iterate(self, progress: Progress | None = None) -> Iterator[Any]:
        """The samples of this rank's (and DataLoader worker's) epoch, from where `progress` stands."""
        position, items = self.epoch_items(progress)
        return decoded(position, items, self.on_error)

    def loader(
        self,
        batch_size: int,
        size: int | tuple[int, int],
        *,
        crop: str | None = "random",
        flip: bool = False,
        workers: int | None = None,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        resize: int | None = None,
        output: str = "torch",
        pin_memory: bool = False,
        prefetch: int | None = None,
        drop_last: bool = False,
        device: Any = None,
        dtype: Any = None,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        mask: str | None = None,
        boxes: str | None = None,
        box_format: str = "xywh",
        frames: int | None = None,
        mask_missing: int | None = None,
        box_labels: str | None = None,
        stats: bool = True,
        progress: bool = False,
    ) -> BatchLoader:
        """Batches for training: `for images, labels in ds.loader(64, 224, flip=True): ...`.

        Each image is cropped and resized to `size` (an int, or (height, width)) as it is decoded,
        only what the crop needs decoded (shardkit.readers.loader): crop="random" is torchvision's
        RandomResizedCrop(size, scale, ratio); "center" is Resize(resize) then CenterCrop(size)
        (resize defaults to size / 0.875: 224 -> 256); None resizes whole images (records packed at
        the size pass through unchanged). flip: a random horizontal flip. Batches hold uint8 images
        (N, 3, H, W) in channels_last memory and int64 labels (-1 when unlabelled), as torch tensors
        (numpy arrays with output="numpy", pinned with pin_memory=True), with `.keys`; `workers`
        threads decode (default: one per core) while up to `prefetch` batches wait. The epoch is this
        rank's, split and shuffled like iteration; crops and flips repeat for the same seed, epoch
        and rank, whatever `workers` is. len() is the number of batches (with on_error="skip", at
        most that: every batch but the epoch's last holds exactly batch_size records, a skipped
        record replaced by the next of the stream, so ranks that skip different records may get
        different counts). `state_dict()` and `load_state_dict()` stop and resume it exactly (with
        on_error="skip" on several ranks, each rank resumes from the state it saved).

        device="cuda" (or "cuda:N"; "cpu" runs the same torch code on the CPU): the threads only
        read records and draw the same windows and flips; decoding (nvJPEG, batched), crop, resize
        and flip run on the device, a batch at a time (shardkit.readers.device). dtype
        (torch.float16, bfloat16 or float32) with mean and std (per channel, on the 0..1 scale)
        normalizes them there.

        Every batch says each image's window (`batch.windows`: x0, y0, x1, y1 in stored pixels) and
        `batch.flips`. mask="seg.png" (a sidecar field): `batch.masks`, uint8 (N, H, W) label maps
        cropped, resized nearest-neighbour and flipped as the images; mask_missing=255 (0-255) fills
        a record's missing mask instead of failing. boxes="objects.bbox" (a column, or a dotted path
        into one; in the original image's pixels, box_format "xywh" as COCO or "xyxy"):
        `batch.boxes[i]`, float32 (k, 4) x0, y0, x1, y1 in output pixels, clipped, boxes left without
        area dropped, and `batch.box_index[i]`, int64 (k,), which of the record's boxes they are.
        box_labels="objects.category" (categories aligned with boxes=): `batch.box_labels[i]`, int64
        (k,), each kept box's class id in one vocabulary made from the output's index.parquet,
        `loader.box_classes` (sorted categories, text numbered by place, whole numbers as they are).
        Typed as torchvision's tv_tensors where it is installed. A record lacking the field, whose
        mask is not its image's size, or whose box_labels do not match its boxes, is a failure
        on_error handles. A dataset's transform= is not applied here: it takes samples, not batches.

        frames=T reads an output of video clips (readers/clips.py): images uint8 (N, T, 3, H, W),
        T consecutive frames of each clip from an offset drawn like the windows (the middle ones
        unless crop="random"; a clip with fewer repeats its last frame), one window and one flip for
        all of a clip's frames; `batch.offsets` says each clip's first frame. No device=, mask= or
        boxes= with it. Every keyword is checked when loader() is called (readers/options.py), and
        so is the data: frames= on images, or no frames= on clips, is a ConfigError then.

        `loader.stats()`: where the time went, and a verdict (readers/stats.py); stats=False leaves
        the timing out; progress=True shows a live line on stderr.
        """
        from .loader import BatchLoader
        from .options import LoaderOptions, given

        _warn_of_transform(self)
        return BatchLoader(self, given(LoaderOptions, locals()))

    def iterable(self) -> ShardIterableDataset:
        """This dataset as a torch IterableDataset (for DataLoader's iterable mode), checkpointable
        (torchdata's Stateful protocol: StatefulDataLoader saves and restores it)."""
        require("torch", "torch")
        from .torch_data import ShardIterableDataset

        return ShardIterableDataset(self)


def _warn_of_transform(dataset: Any) -> None:
    """A dataset's (or a mix's sources') transform= does not reach the batch loader: said once."""
    if getattr(dataset, "transform", None) is not None or any(
        getattr(source, "transform", None) is not None for source in getattr(dataset, "sources", ())
    ):
        warnings.warn("transform= applies to ds[i] and iteration, not to the batch loader", UserWarning, stacklevel=3)

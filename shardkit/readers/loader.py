"""The training input: `ds.loader(...)`'s batches of random-resized (or center) crops, decoded
straight from the shards into one buffer per batch. A loader is a chain of stages, each one job:

    order     the epoch's positions to items, this rank's, resumable  readers/order, stream, epoch
    read      the items cut into chunks of batch_size positions       readers/chunks
    decode    a chunk's records to pixels through their windows       a Decoder (readers/decoding):
              (CPU kernel or Pillow, device, or clips), chosen once   cpu_decoder, device_decoder,
              on the loader threads                                   clip_decoder; readers/windows
    targets   masks, boxes and box labels through the same windows    readers/batch_targets
    collate   batches of exactly batch_size kept records, the state's readers/batch
              carry where a batch took part of the next chunk

Crops and flips come from a generator seeded by (seed, epoch, rank, chunk number), so they do not
depend on the number of threads, and every batch says them (windows, flips). Every configuration
error is raised when the loader is made, before anything is decoded. Reading never imports the
pack side."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Callable, Generator, Iterator
from typing import Any

from ..core.codecs import crop_kernel
from ..core.errors import ConfigError, require
from .batch import Assembly, Batch, full_batches
from .batch_targets import TargetStage
from .chunks import chunks
from .clip_decoder import ClipDecoder
from .cpu_decoder import CpuDecoder
from .decoding import Decoder, Parts, StreamKey
from .device_decoder import DeviceDecoder
from .epoch import EpochRecord, Epochs, check_progress
from .loader_threads import Pending, decoded_ahead, loader_pool, stop
from .options import LoaderOptions
from .order import Progress
from .progress_line import with_progress
from .split import rank_and_world
from .stats import LoaderClock, LoaderStats
from .targets import tv_tensors
from .windows import WindowDraw

# the decoders, by LoaderOptions.decoder: a new kind of batch is one module and one row here
DECODERS: dict[str, Callable[[Parts], Decoder]] = {"cpu": CpuDecoder, "device": DeviceDecoder, "clips": ClipDecoder}


class BatchLoader:
    """Iterable of `Batch`es over one epoch of a dataset or mix for this rank (see EpochIteration.loader)."""

    def __init__(self, dataset: Epochs, options: LoaderOptions) -> None:
        self.dataset, self.options = dataset, options
        self.batch_size, self.size, self.drop_last = options.batch_size, options.out_size, options.drop_last
        self.workers, self.prefetch = options.threads, options.ahead
        self.device, self.frames = options.torch_device, options.frames
        self.mask_missing = None if options.mask_missing is None else int(options.mask_missing)
        self._clock = LoaderClock(options.threads, enabled=options.stats)
        parts = loader_parts(dataset, options, self._clock)
        # the keywords as the stages took them, under their names (options holds them as given)
        draw = parts.windows
        self.crop, self.flip, self.scale, self.ratio = draw.crop, draw.flip, draw.scale, draw.ratio
        self.resize = draw.resize
        self.output, (self.dtype, self.mean, self.std) = options.output, options.normalize
        self.mask, self.boxes, self.box_format = options.mask, options.boxes, options.box_format
        self.box_labels = options.box_labels
        self.pin_memory, self.kernel = parts.assembly.pin_memory, parts.kernel
        self._classes, self._assembly = parts.targets.classes, parts.assembly
        self._decoder = DECODERS[options.decoder](parts)
        for item in dataset.first_items():  # frames= on images, or none on clips, refused now
            self._decoder.refuse(item)
        self._progress: Progress | None = None  # where the running (or last) epoch stands
        self._resume: Progress | None = None  # a loaded state, for the next iteration

    @property
    def box_classes(self) -> list[Any] | None:
        """The classes `batch.box_labels` number boxes by (ds.box_classes(box_labels)), None without
        box_labels=: with text categories a box's id is its category's place in this list."""
        return None if self._classes is None else list(self._classes.classes)

    def __len__(self) -> int:
        """Batches per epoch on this rank: exact when no record is skipped; with on_error="skip" an
        upper bound (batches are filled from the stream, so skips end the epoch sooner)."""
        samples = self.dataset.samples_per_rank()
        return samples // self.batch_size if self.drop_last else -(-samples // self.batch_size)

    def stats(self, since_last: bool = False) -> LoaderStats:
        """Where this loader's time went, since it started, or with since_last=True since the last
        call that gave since_last=True (a plain call only reads): the training loop's own step and
        its waits for reading, object storage, the decode threads and collating; the threads' busy
        seconds; samples/s; and a verdict, `input-bound` or `compute-bound`, with the stage that
        dominates (readers/stats.py). Safe to call from another thread while the loop runs: a wait
        or a step in progress counts up to the call. `print(loader.stats())` shows a table."""
        if not self.options.stats:
            raise ConfigError("this loader was made with stats=False: it keeps no times")
        return self._clock.stats(since_last)

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands in its epoch: a small JSON-able dict (readers/order). Saved after
        batch k, `load_state_dict` in a fresh process continues at batch k+1, with the same samples,
        crops and flips; with another world size, the rest of the epoch split anew. With
        on_error="skip" on several ranks, it is this rank's: each rank saves and loads its own."""
        progress = self._progress or self._resume or self.dataset.fresh_progress()
        return progress.to_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes where `state` stood (then epochs start whole again)."""
        progress = Progress.from_state(state)
        check_progress(self.dataset, progress)
        rank, world = rank_and_world(self.dataset.rank, self.dataset.world_size)
        progress.check_layout(world, 1, self.dataset.drop_last, rank)
        carry = progress.splits[-1].carry if progress.splits else None
        if carry is not None and carry[1] >= self.batch_size:
            raise ConfigError(
                f"this state's carry reaches {carry[1]:,} positions into a chunk of batch_size {self.batch_size:,}: "
                "resume it with the batch size it was saved with"
            )
        self._resume, self._progress = progress, None

    def __iter__(self) -> Iterator[Batch]:
        epoch = self._epoch()
        try:  # the epoch's set-up and its threads' stop run inside the clock's waits: the loop waits on them
            yield from self._clock.batches(epoch)
        finally:  # (a no-op where the clock closed it: this only covers an interruption before that)
            epoch.close()

    def _epoch(self) -> Generator[Batch, None, None]:
        progress = self._resume if self._resume is not None else self.dataset.fresh_progress()
        self._resume, self._progress = None, progress
        # threads do not split the epoch; the loader resumes a carry itself (readers/batch.py)
        position, items = self.dataset.epoch_items(progress, workers=(0, 1), carry=True)
        rank, world = rank_and_world(self.dataset.rank, self.dataset.world_size)
        skipping = self.dataset.on_error.name == "skip"
        if world > 1 and skipping:  # each rank's counts are its own
            progress.splits[position.split].rank = rank
        pool, named = loader_pool(self.workers)
        lane = self._decoder.lane(self._on_device)
        pending: deque[Pending] = deque()
        try:
            read = chunks(items, self.batch_size, position.done // self.batch_size, not self.drop_last or skipping)
            decoded = decoded_ahead(
                read, position.stream.key, self._decode, pool, lane, pending, self.prefetch, self._clock
            )
            batches = full_batches(decoded, position, self.batch_size, self.drop_last, self._assembly)
            if self.options.progress:
                batches = with_progress(batches, self._clock, len(self))
            yield from batches
        finally:  # an exception, Ctrl-C or a consumer that stopped early: nothing keeps running
            stop(pool, lane, named, pending)

    def _decode(self, key: StreamKey, number: int, chunk: list[EpochRecord]) -> Any:
        """A chunk's decode step, on a loader thread: the decoder's."""
        with self._clock.timed("busy:decode"):
            return self._decoder.decode(key, number, chunk)

    def _on_device(self, *made: Any) -> Batch | None:
        """The last step of the decoder's own lane, on the lane's thread (the device path's: the
        batch made on the device)."""
        with self._clock.timed("busy:device"):
            return self._decoder.make(*made)


def loader_parts(dataset: Epochs, options: LoaderOptions, clock: LoaderClock | None = None) -> Parts:
    """The stages a loader's decoder works with, made once for `dataset`: how windows are drawn,
    the targets stage (its box_labels= vocabulary made from the index alone: the same ids on every
    rank, worker and resume), how batches are made (pinned where asked and possible), the kernel."""
    torch = require("torch", "torch") if options.output == "torch" else None
    pin_memory = torch is not None and options.pin_memory and _pinnable(torch) and options.torch_device is None
    classes = None if options.box_labels is None else dataset.box_vocabulary(options.box_labels)
    # imported here, not on a loader thread (an import there would hold the import lock)
    typed = tv_tensors() if torch is not None and (options.mask is not None or options.boxes is not None) else None
    assembly = Assembly(torch, typed, pin_memory)
    clock = clock or LoaderClock(options.threads, enabled=False)
    targets = TargetStage(options, classes, dataset.max_pixels, _tensor(torch, options.torch_device), typed, clock)
    scale, ratio = (options.scale[0], options.scale[1]), (options.ratio[0], options.ratio[1])
    windows = WindowDraw(options.crop, scale, ratio, options.out_size, options.resize_to, bool(options.flip))
    return Parts(options, dataset, windows, targets, assembly, crop_kernel(), clock)


def _pinnable(torch: Any) -> bool:
    """Whether CPU batches can be pinned: a CUDA device must be there (a warning says so where not)."""
    if torch.cuda.is_available():
        return True
    warnings.warn("pin_memory=True, but no CUDA device is available: batches are not pinned", stacklevel=4)
    return False


def _tensor(torch: Any, device: Any) -> Callable[[Any], Any] | None:
    """How a host array of targets becomes what a batch holds: itself (numpy output), a tensor on
    the CPU, or a tensor on the device."""
    if torch is None:
        return None
    if device is None:
        return torch.from_numpy  # type: ignore[no-any-return]
    from .device import to_device

    def on_device(array: Any) -> Any:
        return to_device(torch, array, device)

    return on_device

"""The torch side of the readers, imported only when torch is wanted (`ShardDataset.iterable()`)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from ..core.errors import ConfigError
from .epoch import Epochs, check_progress
from .order import Progress, round_robin_counts
from .split import rank_and_world


class ShardIterableDataset(IterableDataset[Any]):
    """Iterable-mode wrapper: each DataLoader worker and rank reads its own run of the epoch.

    The epoch lives in shared memory: with persistent_workers=True the workers keep their copy of
    the dataset between epochs, and set_epoch() in the training process must still reach them.

    Checkpointing follows torchdata's Stateful protocol (`state_dict`, `load_state_dict`), so
    `torchdata.stateful_dataloader.StatefulDataLoader` saves and restores each worker's position.
    With a plain DataLoader, `state_from_batches` builds the state from the number of batches the
    training loop consumed; `load_state_dict` before the DataLoader's next iteration resumes there.
    """

    def __init__(self, dataset: Epochs) -> None:
        super().__init__()
        self.dataset = dataset
        self._epoch: Any = multiprocessing.RawValue("q", dataset.epoch)
        self._progress: Progress | None = None  # where the running (or last) iteration stands
        self._resume: Progress | None = None  # a loaded state, for the next iteration

    def __iter__(self) -> Iterator[Any]:
        self.dataset.set_epoch(self._epoch.value)
        progress = self._resume if self._resume is not None else self.dataset.fresh_progress()
        self._resume, self._progress = None, progress
        return self.dataset.iterate(progress)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (what DataLoader and training loops count steps by)."""
        return int(self.dataset.samples_per_rank())

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)  # checks it first: the shared value is an int64
        self._epoch.value = epoch

    def state_dict(self) -> dict[str, Any]:
        """Where this process's iteration stands (in a DataLoader worker: that worker's stream)."""
        progress = self._progress or self._resume or self.dataset.fresh_progress()
        info = get_worker_info()
        return progress.to_state(info.id if info is not None else None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The next iteration resumes where `state` stood: the epoch and seed it carries, this
        process's rank and worker layout (another world size or worker count splits the rest of the
        epoch anew; that needs a whole state, not one worker's)."""
        progress = Progress.from_state(state)
        check_progress(self.dataset, progress)
        self._resume, self._progress = progress, None
        if get_worker_info() is None:  # in a worker, the shared epoch is the training process's
            self.set_epoch(progress.epoch)

    def state_from_batches(
        self, batches: int, batch_size: int, num_workers: int = 0, drop_last: bool = False
    ) -> dict[str, Any]:
        """The state of this epoch after a plain DataLoader(self, batch_size, num_workers, drop_last)
        handed out `batches` batches: workers take turns, one batch each, as DataLoader does."""
        progress = self.dataset.fresh_progress()
        rank, world = rank_and_world(self.dataset.rank, self.dataset.world_size)
        workers = max(1, num_workers)
        cuts = self.dataset.space(progress).cuts
        split, sequence = progress.start(world, workers, self.dataset.drop_last, cuts)
        lengths = [progress.stream(split, sequence, rank, worker, cuts).length for worker in range(workers)]
        counts, turn = round_robin_counts(lengths, batches, batch_size, drop_last)
        progress.splits[split].done, progress.splits[split].turn = list(counts), turn
        return progress.to_state()

    def __getstate__(self) -> dict[str, Any]:
        # Shared memory travels only to processes being started (DataLoader workers); pickled any
        # other way (Ray, a file), the epoch goes as a number and gets shared memory of its own.
        state = dict(self.__dict__)
        if get_spawning_popen() is None:
            state["_epoch"] = self._epoch.value
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        if isinstance(state["_epoch"], int):
            state["_epoch"] = multiprocessing.RawValue("q", state["_epoch"])
        self.__dict__.update(state)


def register_sample_collate(sample_type: type) -> None:
    """Teach torch's default_collate the Sample: keys, images, labels and meta collate as
    default_collate collates them (lists, stacked tensors, a dict of lists), and `text` and `fields`
    become lists, one per sample, None and all (default_collate refuses None and would stack
    nothing else); so do images, clips' videos and labels where any of them is None (an image's
    video, a clip's image, an unlabelled record's label). Images (or videos)
    of different sizes, which torch cannot stack, are a ConfigError saying what batches them.
    Uses torch's collate_fn_map, what its `collate` documents for custom types."""
    try:
        from torch.utils.data._utils.collate import collate, default_collate_fn_map
    except ImportError:  # a torch without the map: its default_collate is left as it is
        return

    def collate_samples(batch: Any, *, collate_fn_map: Any = None) -> Any:
        parts = list(zip(*batch, strict=True))
        image, video, label = (_stacked(list(parts[i]), collate, collate_fn_map) for i in (1, 6, 2))
        key, meta = (collate(list(parts[i]), collate_fn_map=collate_fn_map) for i in (0, 3))
        return sample_type(key, image, label, meta, list(parts[4]), list(parts[5]), video)

    default_collate_fn_map.setdefault(sample_type, collate_samples)


def _stacked(part: list[Any], collate: Any, collate_fn_map: Any) -> Any:
    """Images, clips' videos or labels stacked as default_collate stacks them; a list where any is
    None (a clip's image, an image's video, an unlabelled record's label), which default_collate
    refuses."""
    if any(item is None for item in part):
        return part
    shapes = list(dict.fromkeys(tuple(item.shape) for item in part if hasattr(item, "shape")))
    if len(shapes) > 1:
        raise ConfigError(
            f"DataLoader(batch_size={len(part)}) stacks a batch's images, and these differ in size "
            f"({_shape(shapes[0])} and {_shape(shapes[1])}): batch them with ds.loader(batch_size, size), which "
            "crops each to one size, or give open_shards(..., transform=...) one that does"
        )
    return collate(part, collate_fn_map=collate_fn_map)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(side) for side in shape)

"""The torch side of the readers, imported only when torch is wanted (`ShardDataset.iterable()`)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from multiprocessing.context import get_spawning_popen
from typing import Any

from torch.utils.data import IterableDataset


class ShardIterableDataset(IterableDataset):
    """Iterable-mode wrapper: each DataLoader worker and rank reads its own run of the epoch.

    The epoch lives in shared memory: with persistent_workers=True the workers keep their copy of
    the dataset between epochs, and set_epoch() in the training process must still reach them.
    """

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset
        self._epoch: Any = multiprocessing.RawValue("q", dataset.epoch)

    def __iter__(self) -> Iterator[Any]:
        self.dataset.set_epoch(self._epoch.value)
        return iter(self.dataset)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (what DataLoader and training loops count steps by)."""
        return self.dataset.samples_per_rank()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.value = epoch
        self.dataset.set_epoch(epoch)

    def __getstate__(self) -> dict:
        # Shared memory travels only to processes being started (DataLoader workers); pickled any
        # other way (Ray, a file), the epoch goes as a number and gets shared memory of its own.
        state = dict(self.__dict__)
        if get_spawning_popen() is None:
            state["_epoch"] = self._epoch.value
        return state

    def __setstate__(self, state: dict) -> None:
        if isinstance(state["_epoch"], int):
            state["_epoch"] = multiprocessing.RawValue("q", state["_epoch"])
        self.__dict__.update(state)


def register_sample_collate(sample_type: type) -> None:
    """Teach torch's default_collate the Sample: keys, images, labels and meta collate as they did
    before samples had captions (lists, stacked tensors, a dict of lists), and `text` and `fields`
    become lists, one per sample, None and all (default_collate refuses None and would stack
    nothing else). Uses torch's collate_fn_map, what its `collate` documents for custom types."""
    try:
        from torch.utils.data._utils.collate import collate, default_collate_fn_map
    except ImportError:  # a torch without the map: its default_collate is left as it is
        return

    def collate_samples(batch: Any, *, collate_fn_map: Any = None) -> Any:
        parts = list(zip(*batch, strict=True))
        key, image, label, meta = (collate(list(part), collate_fn_map=collate_fn_map) for part in parts[:4])
        return sample_type(key, image, label, meta, list(parts[4]), list(parts[5]))

    default_collate_fn_map.setdefault(sample_type, collate_samples)

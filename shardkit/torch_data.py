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
        self.dataset.set_epoch(self._epoch_value())
        return iter(self.dataset)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (what DataLoader and training loops count steps by)."""
        return self.dataset.samples_per_rank()

    def set_epoch(self, epoch: int) -> None:
        if isinstance(self._epoch, int):
            self._epoch = epoch
        else:
            self._epoch.value = epoch
        self.dataset.set_epoch(epoch)

    def _epoch_value(self) -> int:
        return self._epoch if isinstance(self._epoch, int) else self._epoch.value

    def __getstate__(self) -> dict:
        # Shared memory travels only to processes being started (DataLoader workers); pickled any
        # other way (Ray, a file), the dataset carries the epoch as a plain number.
        state = dict(self.__dict__)
        if get_spawning_popen() is None:
            state["_epoch"] = self._epoch_value()
        return state

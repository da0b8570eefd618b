"""The torch side of the readers, imported only when torch is wanted (`ShardDataset.iterable()`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterableDataset


class ShardIterableDataset(IterableDataset):
    """Iterable-mode wrapper: each DataLoader worker and rank reads its own run of the epoch."""

    def __init__(self, dataset: Any) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        return iter(self.dataset)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (what DataLoader and training loops count steps by)."""
        return self.dataset.samples_per_rank()

    def set_epoch(self, epoch: int) -> None:
        self.dataset.set_epoch(epoch)

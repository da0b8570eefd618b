"""The batch loader's decode stage as one small contract: a `Decoder` turns a chunk of read records
into a batch, and the loader picks one when it is made (readers/loader.py's DECODERS: the CPU's
crop-decode, the device path, the clips). Each decoder draws its windows with the same
`WindowDraw`, hands a record that fails to the dataset's on_error (`kept_rows`), and says which
records it cannot take at all (`refuse`: a ConfigError, since the data and the options disagree;
the loader asks it of each output's first record when it is made).

    refuse(item)                 a record of the wrong kind (an image for clips, a clip for images)
    decode(key, number, chunk)   on a loader thread: the chunk's Batch (None: every record
                                 skipped), or what the decoder's own lane goes on with
    lane(make)                   for one epoch: how those results become batches, in order
    make(*made)                  the last step of the decoder's own lane, on the lane's thread
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from ..core.errors import ShardReadError
from .batch import Assembly, Batch
from .batch_targets import TargetStage
from .epoch import EpochRecord, Epochs
from .handlers import OnError
from .stats import LoaderClock
from .windows import WindowDraw

if TYPE_CHECKING:
    from .options import LoaderOptions

StreamKey = tuple[int, ...]  # (seed, epoch, split, rank, worker): what seeds a stream's windows


class Parts(NamedTuple):
    """What the loader hands the decoder it picks: its options, the dataset or mix it reads (its
    on_error and max_pixels), how windows are drawn, the targets stage, how batches are made, the
    compiled crop kernel (None where it was not built), and the loader's clock (readers/stats)."""

    options: LoaderOptions
    dataset: Epochs
    windows: WindowDraw
    targets: TargetStage
    assembly: Assembly
    kernel: Any
    clock: LoaderClock


class Lane(Protocol):
    """How one epoch's decode results become batches, in the order they were submitted."""

    def submit(self, work: Future[Any]) -> Future[Any]:
        """The work a loader thread does for one chunk, taken on (the same future where it is done)."""
        ...

    def handed(self, work: Future[Any]) -> Batch | None:
        """The batch of a submitted chunk, waited for (None: every record skipped)."""
        ...

    def close(self) -> None:
        """Ends the lane's own threads (none where it has none)."""
        ...


class Decoder(Protocol):
    """Records to pixels for one kind of batch (see the module's docstring)."""

    def refuse(self, item: EpochRecord) -> None: ...

    def decode(self, key: StreamKey, number: int, chunk: list[EpochRecord]) -> Any: ...

    def lane(self, make: Callable[..., Batch | None]) -> Lane: ...

    def make(self, *made: Any) -> Batch | None: ...


class InOrder:
    """The lane of a decoder that makes whole batches on the loader threads: each is its result."""

    def submit(self, work: Future[Any]) -> Future[Any]:
        return work

    def handed(self, work: Future[Any]) -> Batch | None:
        batch: Batch | None = work.result()
        return batch

    def close(self) -> None:
        return None


class WholeOnThreads:
    """What a decoder that makes whole batches on the loader threads shares: the in-order lane, and
    no lane step of its own to make."""

    def lane(self, make: Callable[..., Batch | None]) -> Lane:
        return InOrder()

    def make(self, *made: Any) -> Batch | None:
        """Nothing is left to make: the loader thread's result is the batch."""
        batch: Batch | None = made[0]
        return batch


def kept_rows(chunk: list[EpochRecord], failures: dict[int, str], on_error: OnError) -> list[int] | None:
    """The rows of a chunk to keep (None: all of them) once each failed record went to on_error,
    which raises for the first under on_error="raise"."""
    if not failures:
        return None
    for i in sorted(failures):
        item = chunk[i]
        on_error(
            ShardReadError(f"{item.shard_name}: record {item.record.key}: cannot decode ({failures[i]})"),
            item.dataset,
        )
    return [i for i in range(len(chunk)) if i not in failures]

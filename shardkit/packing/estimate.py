"""What each item will take in its shard, estimated up front, so that --shard-bytes cuts the plan by
the bytes written, not the source's: its header (a read of its first bytes) gives the output's pixels
under the resize geometry, times the bytes per pixel of a deterministic sample really packed once,
plus the format's measured overhead per record and per shard."""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.config import EncodeConfig, PackConfig, ResizeConfig
from ..core.errors import HeaderError
from ..core.headers import read_header
from ..formats import get_format
from ..formats.base import Record
from .plan import ShardSpec
from .sources import Item

SAMPLE_ITEMS = 64  # enough items for a stable mean of the bytes per pixel
NPY_HEADER = 128  # np.save's header of an (h, w, 3) uint8 array (padded to 64 bytes, <= 128 here)


@dataclass(frozen=True)
class OutputSizes:
    """The estimate's parameters: fixed for a pack's settings and its sample's files, so the same
    source always gets the same plan (a --resume cuts it again and finds the same shards)."""

    resize: ResizeConfig
    encode: EncodeConfig
    bytes_per_pixel: float | None  # of a re-encoded image; None: no sample item packed (source bytes then)
    per_record: int  # metadata, label, container headers and padding, and any sidecar fields
    per_shard: int  # the format's own bytes, whatever the records (a tar's end, LMDB's meta pages)

    def of(self, item: Item) -> int:
        """The bytes `item` adds to its shard; 0 for a file whose header cannot be read (it fails)."""
        try:
            header, size = read_header(item.path)
        except (OSError, HeaderError):
            return 0
        if header.width * header.height > self.encode.max_pixels:
            return 0
        from .encode import can_keep_original, plan_geometry  # (imaging: --shard-bytes only)

        geometry = plan_geometry(*header.displayed_size, self.resize)
        pixels = geometry.size[0] * geometry.size[1]
        if can_keep_original(header, geometry, self.encode):
            image = size  # its own bytes
        elif self.encode.encode == "raw":
            image = pixels * 3 + NPY_HEADER  # exact
        elif self.bytes_per_pixel is None:
            image = size
        else:
            image = round(pixels * self.bytes_per_pixel)
        return image + self.per_record


def calibrate(items: Sequence[Item], config: PackConfig) -> OutputSizes:
    """Pack up to SAMPLE_ITEMS items evenly spaced through `items` as a worker would, and write them
    through the format's writer twice (the first one alone, then all) to learn the format's overhead
    per record and per shard."""
    from .worker import ShardJob, pack_record  # (worker imports the plan: here, not at the top)

    count = min(SAMPLE_ITEMS, len(items))
    sample = [items[i * len(items) // count] for i in range(count)]
    job = ShardJob(ShardSpec(0, "sample", ()), "", config.format, config.resize, config.encode, "")
    records = [record for record in map(lambda item: pack_record(item, job), sample) if record is not None]
    if not records:
        return OutputSizes(config.resize, config.encode, None, 0, 0)
    encoded = [record for record in records if record.meta.get("encoding") != "original"]
    pixels = sum(record.meta["stored_width"] * record.meta["stored_height"] for record in encoded)
    per_pixel = sum(len(record.data) for record in encoded) / pixels if pixels else None
    one, whole = _written(config.format, records[:1]), _written(config.format, records)
    images = sum(len(record.data) for record in records)
    per_record = (
        (whole - one - (images - len(records[0].data))) // (len(records) - 1)
        if len(records) > 1
        else one - len(records[0].data)
    )
    per_shard = max(0, whole - images - per_record * len(records))
    return OutputSizes(config.resize, config.encode, per_pixel, max(0, per_record), per_shard)


def _written(format: str, records: list[Record]) -> int:
    """The bytes of a shard holding `records`."""
    backend = get_format(format)
    with tempfile.TemporaryDirectory(prefix="shardkit-calibrate-") as folder:
        path = Path(folder) / f"sample{backend.suffix}"
        writer = backend.writer(str(path))
        for record in records:
            writer.add(record)
        writer.close()
        return path.stat().st_size

"""Where a pack writes: the `Output` contract, and `open_output`, which picks the kind once from
the output's URL (`storage.location.locate`): a local folder (folder_output.FolderOutput) or a
bucket prefix (bucket_output.BucketOutput). The pack driver calls these operations and never asks
which kind it holds; each shard job carries the `Destination` its output gives (shard_writing.py),
and the worker never asks either.

Every output has a local folder (`folder`) that the pack claims with the folder rules
(folder_output.claim: lock, ledger, overlap, clearing) and keeps its state in: done markers, index
parts, then errors.jsonl, index.parquet and the manifest. For a folder output it is the output
itself; for a bucket, a staging folder whose files go up at the end (`publish`).

A pack calls, in order: `open` (before any local state), `local_config` (the config of the pack
into `folder`, which the driver then claims), `begin` (before the first shard), `destination` for
each job and `intact` for each shard a resume may keep, `mark_done` as each shard comes back,
`publish` once finish has written the manifest into `folder`, and `report` on the result.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..core.config import PackConfig
from ..storage.location import locate
from ..storage.urls import is_remote
from .bucket_output import BucketOutput, staging_folder
from .folder_output import FolderOutput
from .working_folder import temp_dir

if TYPE_CHECKING:
    from ..core.manifest import Manifest
    from .finish import PackResult
    from .shard_writing import Destination, ShardResult


class Output(Protocol):
    """What a pack needs of where it writes."""

    url: str  # the output as the user named it (a folder or a URL)
    folder: Path  # the local folder the pack claims and keeps its state in
    shards_here: bool  # its shards are files in `folder`: the driver may join a shard's parts
    # there, and a --resume may keep the records of a shard it writes again

    def open(self, config: PackConfig) -> Manifest | None:
        """Refuses a destination the pack must not write, before any local state is made; with
        --resume, the manifest of a finished output it holds, which the driver compares with its
        plan (None: nothing to compare here)."""
        ...

    def complete(self, manifest: Manifest) -> bool:
        """Whether every shard of `manifest` (which `open` handed back) is there with its size."""
        ...

    def local_config(self, config: PackConfig) -> PackConfig:
        """The config of the pack into `folder` (for a bucket: its staging folder, made here)."""
        ...

    def begin(self) -> None:
        """Called once the claim is settled, before the first shard is written."""
        ...

    def destination(self, name: str) -> Destination:
        """Where the worker puts the shard `name` once it is written."""
        ...

    def intact(self, result: ShardResult) -> bool:
        """Whether a shard an earlier run finished (its done marker in `folder`) is still there,
        whole, so that a resume may keep it."""
        ...

    def mark_done(self, result: ShardResult) -> None:
        """The driver's side of a shard that came back: its done marker and index part in
        `folder`, where its worker did not write them."""
        ...

    def publish(self, manifest: Manifest) -> None:
        """The end of the pack, once finish wrote the manifest into `folder`: the output made
        whole where it lives, and `folder`'s state removed (kept when rows failed for a passing
        cause, for --resume)."""
        ...

    def report(self, result: PackResult) -> PackResult:
        """The pack's result as the output names itself."""
        ...


def open_output(config: PackConfig) -> Output:
    """`config.output` as an Output: a path or file:// URL a local folder, any other URL a bucket
    prefix whose local folder is its staging folder. Nothing is touched here."""
    location = locate(config.output, _output_options(config), manifest=False)
    if isinstance(location, Path):
        return FolderOutput(config.output, Path(config.output))
    staging = staging_folder(location.url, config.staging)
    # where a worker writes a shard to upload: a Ray task sees no folder of the driver's, its node's own
    scratch = None if config.executor == "ray" else str(temp_dir(staging))
    return BucketOutput(location, staging, scratch)


def _output_options(config: PackConfig) -> dict[str, Any] | None:
    """The storage options that reach the output. One set serves the source and the output: with
    a bucket source and a local output they are the source's (a local output takes none)."""
    return None if is_remote(config.source) and not is_remote(config.output) else config.storage_options

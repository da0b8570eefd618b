"""Finishing a pack: once every shard is done, the index parts joined into index.parquet, the
format's output-level companion files, errors.jsonl (every input not packed, in order), then
manifest.json, atomically and last, all in the pack's local folder (the output's `publish` makes
the output whole from there); and what the run did, as a PackResult."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.config import PackConfig
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    Manifest,
    ShardInfo,
    info_of,
    write_json_atomic,
    write_lines_atomic,
    write_text_atomic,
)
from ..formats import get_format
from ..runtime.timeline import mark
from ..storage.urls import is_remote
from .failed_rows import FailedRows
from .index import join as join_index
from .index import part_path, write_part
from .index import row as index_row
from .resume import CREATED_BY
from .shard_writing import PICTURE_COUNTS, TIMED_STEPS, ShardResult
from .sources import SourceWalk
from .sources.labelling import Labelling, labelling
from .working_folder import state_dir, writing


@dataclass
class PackResult:
    output: str
    manifest: Manifest
    inputs: int
    records: int
    errors: int
    shards: int
    reused_shards: int
    input_bytes: int
    output_bytes: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    resize: int | None = None
    nodes: int = 1  # machines (Ray nodes) that wrote shards in this run
    already_complete: bool = False  # --resume found the same pack finished: nothing was done
    duplicates: int = 0  # of the errors: copies --dedup left out
    labels: Labelling | None = None  # how the samples were labelled, and what in the source's layout to look at

    @property
    def images_per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0

    @property
    def warnings(self) -> list[str]:
        """The lines the summary warns with: the source's layout, and pictures that came out a
        single colour."""
        said = list(self.labels.warnings) if self.labels is not None else []
        encode = self.manifest.settings.get("encode")
        background = encode.get("background") if isinstance(encode, dict) else None
        pictures = single_colour_warning(self.manifest.totals, background)
        return said + ([pictures] if pictures else [])

    def to_json(self) -> dict[str, Any]:
        """What `pack --json` writes: the summary's numbers, and the manifest's totals (errors per
        cause among them) and format; the manifest itself is in the output."""
        return {
            "output": self.output, "format": self.manifest.format, "inputs": self.inputs,
            "records": self.records, "errors": self.errors, "duplicates": self.duplicates,
            "shards": self.shards, "reused_shards": self.reused_shards, "input_bytes": self.input_bytes,
            "output_bytes": self.output_bytes, "seconds": self.seconds,
            "images_per_second": self.images_per_second, "stage_seconds": dict(self.stage_seconds),
            "resize": self.resize, "nodes": self.nodes, "already_complete": self.already_complete,
            "totals": dict(self.manifest.totals), "labels": None if self.labels is None else asdict(self.labels),
            "warnings": self.warnings,
        }  # fmt: skip


def single_colour_warning(totals: dict[str, int], background: object) -> str:
    """The warning for pictures stored with every pixel alike ("" none): where transparency was
    flattened onto the background (white artwork on white), the --background to pack again with."""
    single = totals.get("single_colour", 0)
    if not single:
        return ""
    images = f"{single:,} image{'s' if single != 1 else ''} came out a single colour (every pixel alike)"
    flattened = totals.get("single_colour_flattened", 0)
    if not flattened:
        return f"{images}; none had transparency"
    rgb = list(background) if isinstance(background, (list, tuple)) else None
    colour = ",".join(map(str, rgb)) if rgb is not None else "the background"
    other = "255,255,255" if rgb is not None and sum(rgb) <= 3 * 127 else "0,0,0"  # (a dark one: white)
    which = f"{flattened:,} of them" if flattened < single else "each" if single > 1 else "it"
    return (
        f"{images}; {which} had transparency, flattened onto {colour}: pack again with --background {other} "
        "(or another colour the pictures lack)"
    )


def finish(
    config: PackConfig, found: SourceWalk, ordered: list[ShardResult], inputs: int, settings: dict[str, Any],
    plan: str, output: Path, failed: FailedRows,
) -> PackResult:  # fmt: skip
    """Write index.parquet, the companions, errors.jsonl and the manifest (last) into the local
    folder `output` for the shard results in plan order (their failed rows in `failed`'s parts),
    and say what was done; the working folder
    stays for the output's `publish`. What the manifest says of each shard comes from its result: a
    pack to a bucket needs no shard here (its resume keeps only shards whose index part is in the
    state, so none is read again)."""
    skipped = found.skipped
    errors, transient, causes = failed.totals(skipped)
    records = sum(r.shard.count for r in ordered)
    duplicates = sum(1 for row in skipped if row.stage == "duplicate")
    totals = {"inputs": inputs, "records": records, "errors": errors}
    if config.clips.seconds is not None:  # records are clips: each video packed (whole) or listed, once
        totals["videos"] = inputs - errors
    if config.dedup != "none":  # of the errors, the copies left out: what a later run can say without reading
        totals["duplicates"] = duplicates
    counts = [result.counts for result in ordered]
    if config.clips.seconds is None and all(count is not None for count in counts):  # (unknown: not said)
        totals.update({name: sum(count.get(name, 0) for count in counts if count) for name in PICTURE_COUNTS})
    if found.source.downloads:  # rows per cause of failure, and those a --resume tries again
        totals["transient"] = transient
        totals.update(causes)
    # (a local source by its absolute path: a later append tells its own inputs by it, from any folder)
    path = str(config.source) if is_remote(config.source) else os.path.abspath(config.source)
    source = {"path": path, "layout": found.layout}
    manifest = Manifest(
        format=config.format,
        shards=[r.shard for r in ordered],
        classes=found.classes,
        settings={**settings, "source": source, "plan": plan},
        totals=totals,
        created_by=CREATED_BY,
    ).sealed()
    state = state_dir(output)
    with writing(output, INDEX_NAME):
        index = join_index((_index_part(output, config.format, r.shard) for r in ordered), output, state)
    companions = [r.companion for r in ordered if r.companion is not None]
    companions += _output_companions(config.format, [r.shard for r in ordered], output, state)
    manifest = replace(manifest, index=index, companions=companions).sealed()
    with writing(output, ERRORS_NAME):
        lines = failed.lines(skipped, (r.shard.name for r in ordered))
        write_lines_atomic(output / ERRORS_NAME, lines, temp_dir=state)
    with writing(output, MANIFEST_NAME):
        write_json_atomic(output / MANIFEST_NAME, manifest.to_json(), temp_dir=state)
    mark("manifest")
    return PackResult(
        output=str(output),
        manifest=manifest,
        inputs=inputs,
        records=records,
        errors=errors,
        shards=len(ordered),
        reused_shards=sum(1 for r in ordered if r.reused or r.already_uploaded),
        input_bytes=sum(r.input_bytes for r in ordered),
        output_bytes=sum(r.shard.bytes for r in ordered),
        seconds=0.0,
        stage_seconds=_stage_seconds(ordered),
        resize=config.resize.pixels,
        nodes=len({r.worker.split(":")[0] for r in ordered if not r.reused}) or 1,
        duplicates=duplicates,
        labels=labelling(found, config.labels),
    )


def _stage_seconds(ordered: list[ShardResult]) -> dict[str, float]:
    """Where the workers' time went in this run (reused shards took none)."""
    seconds = dict.fromkeys(TIMED_STEPS, 0.0)
    for result in ordered:
        if not result.reused:
            for stage, spent in result.timings.items():
                seconds[stage] = seconds.get(stage, 0.0) + spent
    return seconds


def _output_companions(format: str, shards: list[ShardInfo], output: Path, state: Path) -> list[ShardInfo]:
    """The files the format wants beside the whole output for other readers (`Backend.output_files`:
    wids' shard list for WebDataset), written before the manifest that lists them."""
    output_files = get_format(format).output_files
    if output_files is None:
        return []
    companions = []
    for name, data in output_files(shards):
        with writing(output, name):
            write_text_atomic(output / name, data.decode(), temp_dir=state)
        companions.append(info_of(name, sum(shard.count for shard in shards), data))
    return companions


def _index_part(output: Path, format: str, shard: ShardInfo) -> Path:
    """A shard's part of the index; rebuilt from the shard when a resumed pack kept a shard whose
    part is missing (written by a shardkit without an index)."""
    path = part_path(state_dir(output), shard.name)
    if not path.exists():
        reader = get_format(format).reader(str(output / shard.name))
        try:
            write_part(path, [index_row(record, shard.name, i) for i, record in enumerate(reader)])
        finally:
            reader.close()
    return path


def already_complete(
    manifest: Manifest, config: PackConfig, seconds: float, labels: Labelling | None = None
) -> PackResult:
    """What --resume says of an output it found finished with the same plan: nothing was done
    (`labels`: how the source labels its samples, from its walk)."""
    return PackResult(
        output=config.output,
        manifest=manifest,
        inputs=manifest.totals.get("inputs", 0),
        records=manifest.records,
        errors=manifest.totals.get("errors", 0),
        shards=len(manifest.shards),
        reused_shards=len(manifest.shards),
        input_bytes=0,
        output_bytes=sum(shard.bytes for shard in manifest.shards),
        seconds=seconds,
        resize=config.resize.pixels,
        already_complete=True,
        duplicates=manifest.totals.get("duplicates", 0),
        labels=labels,
    )

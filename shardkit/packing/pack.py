"""A pack, orchestrated: the output claimed, the source walked and planned, shards written in
parallel as the plan is cut, errors.jsonl and the manifest last. The rooms it calls on:

- `sources/`: the walk of a source, typed items and the inputs not taken;
- `plan`: shards cut from the walk, the plan's fingerprint;
- `resume`: the settings that decide the bytes, what an earlier run left that may be kept;
- `running` and `worker`: shard jobs on local processes or Ray, one shard per job;
- `finish`: index.parquet, companions, errors.jsonl, the manifest;
- `output` and `publish`: the output folder (claimed, cleared) and an output URL.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.config import PackConfig
from ..core.errors import ConfigError, OutputError, describe
from ..core.manifest import MANIFEST_NAME
from ..core.pools import default_workers
from ..core.processes import exit_if_importing_main
from ..core.timeline import mark
from ..formats import get_format
from ..storage.location import locate
from ..storage.store import Store
from ..storage.urls import is_remote
from .dedup import Fallbacks, dedup_items, fallback_stamps, settle
from .estimate import calibrate
from .finish import PackResult, already_complete, finish
from .index import load_soon
from .output import (
    HASHES_NAME,
    claim,
    clear,
    refuse_overlap,
    refuse_sources_inside,
    remove_old_temp_files,
    remove_temp_shards,
    state_dir,
    temp_dir,
    writing,
)
from .parts import Joining, split_last
from .plan import PlanDigest, ShardSpec, fingerprint, plan_shards
from .publish import (
    RemoteOutput,
    claim_remote,
    clear_staging,
    in_bucket,
    publish,
    retire_earlier,
    staging_folder,
    upload_fields,
)
from .resume import remove_stale_shards, resumable, retried_shard, reused_shard, settings_of, write_state
from .running import Planned, ProgressCallback, Tally, ray_session, run_jobs
from .sources import Item, SourceList, SourceWalk, walk
from .sources.labelling import labelling
from .upload import keep
from .worker import PartResult, ShardJob, ShardResult

__all__ = ["HashProgress", "PackResult", "ProgressCallback", "Tally", "pack", "resolve_resize"]

HashProgress = Callable[[int, int], None]  # files hashed, of how many (pack --dedup's first pass)


def pack(
    config: PackConfig,
    *,
    progress: ProgressCallback | None = None,
    dedup_progress: HashProgress | None = None,
    tally: Tally | None = None,
) -> PackResult:
    """Pack `config.source` into shards in `config.output`. Returns what was done.

    Everything that can be refused (bad output, overlap with the source, another pack running, files
    shardkit did not write) is refused before any shard is written, and leaves the folder as it was.
    Shards are planned as the walk goes and written as soon as each is planned: the driver holds
    what is in flight, not the whole list (except for --shuffle and --dedup, which need the whole
    list; --dedup hashes every file first, reported through `dedup_progress`). `tally` counts a
    table of URLs' downloaded bytes and failures per cause as shards come back.
    """
    exit_if_importing_main()  # (before the output's lock, which the driver holds)
    location = locate(config.output, _output_options(config), manifest=False)
    if not isinstance(location, Path):
        return _pack_to_remote(config, location, progress, dedup_progress, tally)
    return _pack_into(config, progress, dedup_progress, tally=tally)


def _pack_into(
    config: PackConfig,
    progress: ProgressCallback | None,
    dedup_progress: HashProgress | None,
    remote: RemoteOutput | None = None,
    tally: Tally | None = None,
) -> PackResult:
    """A pack into the folder `config.output`; with `remote`, that folder is the staging state of a
    pack to a bucket, into which each shard is uploaded as soon as it is written, and the files
    beside the whole output once all are (packing/publish.py)."""
    started = time.perf_counter()
    mark("pack")
    if not is_remote(config.source):
        refuse_overlap(config.source, config.output)
    with ray_session(config):  # connected before anything is written or deleted
        held = claim(config.output, resume=config.resume, overwrite=config.overwrite)
        output = held.output
        try:
            prepared = prepare(config, dedup_progress, output=output)
            config, found, settings = prepared.config, prepared.found, prepared.settings
            finished = resumable(output, settings, lambda: _dry_plan(config, found)) if config.resume else None
            if config.overwrite:
                clear(held)
            if finished is None:
                if config.resume and (output / MANIFEST_NAME).exists():
                    # a pack finished with rows a passing fault kept out: its manifest goes first,
                    # since the shards that held those rows are written again
                    with writing(output, MANIFEST_NAME):
                        (output / MANIFEST_NAME).unlink()
                write_state(output, settings)
        except BaseException:
            held.release(undo=True)
            raise
        if finished is not None:
            held.release(undo=True)  # as it was found: nothing to do
            return already_complete(finished, config, time.perf_counter() - started, labelling(found, config.labels))
        try:
            remove_temp_shards(output)  # half shards of workers killed in an earlier run
            remove_old_temp_files(output)
            if remote is not None:
                retire_earlier(remote)  # before the first shard goes up
            specs = _plan(config, found.items)
            result = _write_all(config, found, specs, settings, output, progress, prepared.fallbacks, remote, tally)
            if remote is not None:
                publish(output, remote, result.manifest)
                if not result.manifest.totals.get("transient"):  # else its state stays, for a --resume
                    clear_staging(output, result.manifest)
        except BaseException:
            remove_temp_shards(output)  # the workers are stopped by now; what is complete stays for --resume
            raise
        finally:
            held.release(undo=False)
    result.seconds = time.perf_counter() - started
    return result


@dataclass
class Prepared:
    """A pack's inputs, settled before anything is written: the config with resize resolved, the
    walk (less --dedup's copies, each kept item's copies as its fallbacks) and the settings that
    decide the output's bytes."""

    config: PackConfig
    found: SourceWalk
    settings: dict[str, Any]
    fallbacks: dict[str, Fallbacks] = field(default_factory=dict)  # places index found.skipped


def _output_options(config: PackConfig) -> dict[str, Any] | None:
    """The storage options that reach the output. One set serves the source and the output: with
    a bucket source and a local output they are the source's (a local output takes none)."""
    return None if is_remote(config.source) and not is_remote(config.output) else config.storage_options


def _refuse_for_buckets(config: PackConfig) -> None:
    """What a bucket source does not take yet, refused before any work: both read local files."""
    if config.dedup != "none":
        raise ConfigError(f"{config.source}: --dedup hashes local files; it does not take a bucket source yet")
    if config.shard_bytes is not None:
        raise ConfigError(
            f"{config.source}: --shard-bytes estimates each image's output from its local file; "
            "use --shard-size with a bucket source"
        )
    if is_remote(config.output):
        source, output = config.source.rstrip("/"), config.output.rstrip("/")
        if output == source or output.startswith(source + "/"):
            raise OutputError(
                f"{config.output}: lies inside the source prefix {config.source}; write the shards elsewhere"
            )


def _walk(config: PackConfig) -> SourceWalk:
    return walk(
        config.source, labels=config.labels, table=config.table, sidecars=config.sidecars,
        storage_options=config.storage_options, web=config.web, videos=config.clips.seconds is not None,
    )  # fmt: skip


def _refuse_for_videos(config: PackConfig) -> None:
    """What a pack of videos does not take (yet), refused by name before any work: each weighs
    or hashes an image's pixels, which a video is not."""
    where = config.source
    if config.dedup != "none":
        raise ConfigError(f"{where}: --dedup compares images; it does not take videos (--clip-seconds) yet")
    if config.shard_bytes is not None:
        raise ConfigError(
            f"{where}: --shard-bytes estimates images; with --clip-seconds use --shard-size (videos a shard)"
        )
    if config.resize.size == "auto":
        raise ConfigError(
            f"{where}: --resize auto follows probe's advice for images; give --resize N with --clip-seconds"
        )
    if config.resize.mode == "center-crop":
        raise ConfigError(f"{where}: clips keep the whole frame; --resize-mode center-crop is for images")
    if config.encode.encode != "jpeg":
        raise ConfigError(f"{where}: clips are always H.264 MP4; --encode is for images")


def prepare(config: PackConfig, dedup_progress: HashProgress | None, output: Path | None = None) -> Prepared:
    """The one preparation of a local and a remote pack: walk the source (a list naming files in
    the local `output` is refused), resolve --resize auto, and with --dedup hash every file (kept in
    the output's state folder for a resume) and leave out the copies."""
    if is_remote(config.source):
        _refuse_for_buckets(config)
    if config.clips.seconds is not None:
        _refuse_for_videos(config)
    found = _walk(config)
    if found.layout == "spans" and config.clips.stride is not None:
        raise ConfigError(
            f"{config.source}: the table's start and end columns give each clip's span; leave out --clip-stride"
        )
    if found.layout == "urls" and config.dedup != "none":
        raise ConfigError(
            f"{config.source}: --dedup compares the images before packing, and a table of URLs is downloaded "
            "while packing; pack it, then run `shardkit duplicates OUT`"
        )
    if found.layout == "urls" and config.shard_bytes is not None:
        raise ConfigError(
            f"{config.source}: --shard-bytes estimates each image's output from its local file, and a table "
            "of URLs is downloaded while packing; use --shard-size"
        )
    if found.listed is not None and output is not None:
        refuse_sources_inside([item.path for item in found.listed.items], config.output)
    config = resolve_resize(config)
    fallbacks: dict[str, Fallbacks] = {}
    if config.dedup != "none":
        cache = None if output is None else state_dir(output) / HASHES_NAME
        found, fallbacks = _deduplicated(found, config, dedup_progress, cache)
    return Prepared(config, found, settings_of(config, urls=found.layout == "urls"), fallbacks)


def resolve_resize(config: PackConfig) -> PackConfig:
    """Resize "auto": the probe's recommendation for `config.train_size`, computed by the same
    function `probe` uses (a streamed probe of the source first: bounded memory, whatever its size)."""
    if config.resize.size != "auto":
        return config
    from .probe import probe

    recommendation = probe(
        config.source, train_size=config.train_size, workers=config.workers, storage_options=config.storage_options
    ).recommendation
    size = recommendation.resize if recommendation is not None else None
    return replace(config, resize=replace(config.resize, size=size))


def _pack_to_remote(
    config: PackConfig,
    store: Store,
    progress: ProgressCallback | None,
    dedup_progress: HashProgress | None,
    tally: Tally | None = None,
) -> PackResult:
    """A pack into a URL: the bucket is checked first; the driver keeps its state (done markers,
    index parts, errors) in a local staging folder, resumable as any output, while the workers
    upload each shard as it is written; the manifest goes up last (see publish)."""
    started = time.perf_counter()
    get_format(config.format)
    remote = claim_remote(store, resume=config.resume, overwrite=config.overwrite)
    if config.resume and remote.manifest is not None and not remote.manifest.totals.get("transient"):
        # A finished output in the bucket: the same plan means nothing to do (its objects' sizes are
        # trusted here; `shardkit verify URL` checks their bytes), another one is refused.
        prepared = prepare(config, dedup_progress)
        plan = fingerprint(prepared.settings, _dry_plan(prepared.config, prepared.found))
        if remote.manifest.settings.get("plan") != plan:
            raise OutputError(
                f"{store.url}: holds a finished pack made with other settings or inputs; use --overwrite to replace it"
            )
        if all(remote.held.get(shard.name) == shard.bytes for shard in remote.manifest.shards):
            resolved = replace(prepared.config, output=store.url)
            labels = labelling(prepared.found, config.labels)
            return already_complete(remote.manifest, resolved, time.perf_counter() - started, labels)
    staging = staging_folder(store.url, config.staging)
    # Only a run stopped before its end leaves state to resume; anything else there (the files
    # of a run stopped as it cleared them) is staging's own, replaced.
    resume = config.resume and state_dir(staging).exists()
    occupied = staging.is_dir() and any(staging.iterdir())
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{staging}: cannot stage the shards here ({describe(error)})") from None
    local = replace(
        config, output=str(staging), resume=resume, overwrite=occupied and not resume, staging=None,
        storage_options=config.storage_options if is_remote(config.source) else None,  # (the source's too)
    )  # fmt: skip
    result = _pack_into(local, progress, dedup_progress, remote, tally)
    return replace(result, output=store.url, already_complete=False, seconds=time.perf_counter() - started)


def _plan(config: PackConfig, items: Iterable[Item]) -> Iterator[ShardSpec]:
    """The shards to write. --shard-bytes weighs each item by its estimated output, calibrated on
    a sample spread over the whole walk: the walk is read whole first, as for --shuffle."""
    weigh, per_shard = None, 0
    if config.shard_bytes is not None:
        items = list(items)
        sizes = calibrate(items, config)
        weigh, per_shard = sizes.of, sizes.per_shard
    return plan_shards(
        items,
        suffix=get_format(config.format).suffix,
        shard_size=config.shard_size,
        shard_bytes=config.shard_bytes,
        shuffle=config.shuffle,
        seed=config.seed,
        weigh=weigh,
        per_shard=per_shard,
    )


def _deduplicated(
    found: SourceWalk, config: PackConfig, progress: HashProgress | None, cache: Path | None = None
) -> tuple[SourceWalk, dict[str, Fallbacks]]:
    """The walk with the copies left out (each a Failure at stage "duplicate", beside the walk's
    own skips), and each kept item's copies, its fallbacks (their places in the walk's skipped
    rows): every file is hashed first, so the walk is read whole, as --shuffle reads it. The
    hashes are kept in `cache` as they come (the output's state folder), for a resume."""
    items = list(found.items)
    total = len(items)
    kept, dropped, fallbacks = dedup_items(
        items, config.dedup, config.dedup_threshold, config.encode.max_pixels, config.workers,
        None if progress is None else lambda done: progress(done, total),
        # a table's rows may only name files in its folder: one outside is never the copy kept
        confine=found.confine, cache=cache,
        reuse=config.resume,  # an --overwrite starts over: nothing of an earlier run is taken
    )  # fmt: skip
    offset = len(found.skipped)  # the walk is read whole: its skipped rows are all in
    skipped = [*found.skipped, *dropped]
    listed = SourceList(found.root, found.layout, kept, found.classes, skipped)
    moved = {key: fallback._replace(copies=[(item, offset + place) for item, place in fallback.copies])
             for key, fallback in fallbacks.items()}  # fmt: skip
    return replace(found, items=kept, skipped=skipped, listed=listed, runs=None), moved


def _dry_plan(config: PackConfig, found: SourceWalk) -> Iterator[ShardSpec]:
    """The plan again, from a walk of its own (the writing keeps `found`'s): a finished pack is
    compared with it before anything is done."""
    items = found.listed.items if found.listed is not None else _walk(config).items
    return _plan(config, items)


def _write_all(
    config: PackConfig,
    found: SourceWalk,
    specs: Iterator[ShardSpec],
    settings: dict[str, Any],
    output: Path,
    progress: ProgressCallback | None,
    fallbacks: dict[str, Fallbacks] | None = None,
    remote: RemoteOutput | None = None,
    tally: Tally | None = None,
) -> PackResult:
    """Write the shards not done yet as the plan is cut, then finish. On --resume, a shard is
    reused when its done marker has its own hash: the same settings and the same files (names,
    sizes, mtimes; and its fallbacks'), and the shard is still there (in the folder; with `remote`,
    in the bucket, on record as uploaded); a shard whose files changed is written again. With
    --dedup, errors.jsonl says what the workers did with the fallbacks (`settle`)."""
    fallbacks = fallbacks or {}
    digest = PlanDigest(settings)
    results: dict[int, ShardResult] = {}
    job_specs: list[int] = []  # job number -> shard index
    planned = Planned()
    confine = found.confine
    web = config.web if found.layout == "urls" else None
    # where a shard to upload is written: a Ray task sees no folder of the driver's, its node's own
    scratch = None if config.executor == "ray" else str(temp_dir(output))

    def jobs() -> Iterator[ShardJob]:
        for spec in specs:
            copies = {item.key: tuple(c for c, _ in fallbacks[item.key].copies) for item in spec.items
                      if item.key in fallbacks}  # fmt: skip
            shard_hash = fallback_stamps(digest.add(spec), copies)
            planned.shards += 1
            planned.images += len(spec.items)
            previous = reused_shard(output, spec, shard_hash, intact) if config.resume else None
            if previous is not None:
                results[spec.index] = previous
                planned.reused_images += len(spec.items)
                planned.reused_errors += len(previous.errors)
                continue
            # (a shard in a bucket is written again whole: its records are not here to keep)
            retried = retried_shard(output, spec, shard_hash) if config.resume and web and not remote else None
            yield ShardJob(
                spec, str(output), config.format, config.resize, config.encode, shard_hash, confine, copies,
                found.options, web=web, earlier=None if retried is None else retried.errors,
                earlier_counts=None if retried is None else retried.counts,
                **({} if remote is None else upload_fields(remote, spec.name, scratch)),
                clips=config.clips if config.clips.seconds is not None else None,
            )  # fmt: skip
        planned.walked = True

    def numbered(upcoming: Iterator[ShardJob]) -> Iterator[ShardJob]:
        for job in upcoming:
            job_specs.append(job.spec.index)
            if job.part is not None:
                parts[len(job_specs) - 1] = job
            if len(job_specs) == 1:
                mark("planned")  # the first job, handed to the workers
            yield job

    intact = None if remote is None else in_bucket(remote, output)
    workers = config.workers or default_workers()
    # Parts are encoded by local workers and written here: not for a Ray task (its node's files),
    # a shard to upload, a URL table's downloads (a worker's own pool) or videos (a clip is a job).
    splits = (
        workers > 1 and config.executor == "local" and remote is None and web is None and config.clips.seconds is None
    )
    parts: dict[int, ShardJob] = {}  # job number -> its part job, until that part is back
    joining = Joining()
    upcoming = split_last(jobs(), workers) if splits else jobs()
    try:
        # index.parquet's writer is imported on a thread while the shards are written, once the
        # workers have their first jobs: the import holds the GIL (pyarrow's libraries load with
        # it held), and begun before the walk it delayed the walk, the plan and the pool's start
        # by 30-70 ms of a 700- or 3,500-image pack's first 0.3 s.
        for job_number, outcome in run_jobs(config, numbered(upcoming), planned, progress, started=load_soon):
            if isinstance(outcome, PartResult):
                whole = joining.add(parts.pop(job_number), outcome)
                if whole is None:
                    continue
                outcome = whole
            result = outcome
            if remote is not None:
                keep(output, result)  # its index part and done marker, from wherever it ran
            results[job_specs[job_number]] = result
            if tally is not None and web is not None:
                tally.add(result)
    finally:
        joining.abandon()
    mark("results")
    remove_stale_shards(output, {result.shard.name for result in results.values()})
    ordered = [results[index] for index in range(planned.shards)]
    inputs = planned.images + len(found.skipped)
    stand_ins = {key: packed for result in ordered for key, packed in result.stand_ins.items()}
    if stand_ins:
        found = replace(found, skipped=settle(found.skipped, fallbacks, stand_ins))
    return finish(config, found, ordered, inputs, settings, digest.hexdigest(), output, keep_state=remote is not None)

"""A pack, orchestrated: the output claimed, the source walked and planned, shards written in
parallel as the plan is cut, errors.jsonl and the manifest last. The modules it calls on:

- `sources/`: the walk of a source, typed items and the inputs not taken;
- `plan`: shards cut from the walk, the plan's fingerprint;
- `resume`: the settings that decide the bytes, what an earlier run left that may be kept;
- `running` and `worker`: shard jobs on local processes or Ray, one shard per job;
- `finish`: index.parquet, companions, errors.jsonl, the manifest;
- `output`: where the pack writes, a local folder or a bucket, behind one interface (`Output`),
  its local folder claimed by the folder rules (`folder_output`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.config import PackConfig
from ..core.errors import OutputError
from ..core.manifest import MANIFEST_NAME, Manifest
from ..formats import get_format
from ..runtime.lanes import Admission
from ..runtime.pools import default_workers
from ..runtime.processes import exit_if_importing_main
from ..runtime.timeline import mark
from ..storage.urls import is_remote
from .dedup import Earlier, Fallbacks, dedup_items, fallback_stamps, settle
from .estimate import calibrate
from .failed_rows import FailedRows
from .finish import PackResult, already_complete, finish
from .folder_output import claim, clear, refuse_overlap, refuse_sources_inside
from .index import load_soon
from .output import Output, open_output
from .parts import Joining, split_last
from .plan import PlanDigest, ShardSpec, fingerprint, plan_shards
from .reading import Reading
from .resume import remove_stale_shards, resumable, retried_shard, reused_shard, settings_of, write_state
from .running import Planned, ProgressCallback, Tally, ray_session, run_jobs
from .shard_writing import PartResult, ShardResult
from .sources import Item, SourceList, SourceWalk, pack_source
from .sources.labelling import labelling
from .worker import ShardJob
from .working_folder import HASHES_NAME, remove_old_temp_files, remove_state, remove_temp_shards, state_dir, writing

__all__ = ["HashProgress", "PackResult", "ProgressCallback", "Tally", "pack", "resolve_resize"]

HashProgress = Callable[[int, int], None]  # files hashed, of how many (pack --dedup's first pass)


@dataclass(frozen=True)
class Extension:
    """A pack that continues an output (`shardkit pack --append`, changes/append.py): its shards
    numbered from `first_shard`, and its walk as `walk` gives it (read whole: the inputs the output
    holds already left out, keys and labels as the output has them). The same walk every run, so
    that a resume plans the same shards."""

    first_shard: int
    walk: Callable[[SourceWalk], SourceWalk]
    earlier: Earlier | None = None  # with --dedup: the output's records, which new files are copies of too


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
    started = time.perf_counter()
    output = open_output(config)
    finished = output.open(config)
    if finished is not None:
        done = _found_finished(config, output, finished, dedup_progress, started)
        if done is not None:
            return done
    result = pack_into(output.local_config(config), output, progress, dedup_progress, tally)
    return replace(output.report(result), seconds=time.perf_counter() - started)


def pack_into(
    config: PackConfig,
    output: Output,
    progress: ProgressCallback | None,
    dedup_progress: HashProgress | None,
    tally: Tally | None,
    extension: Extension | None = None,
) -> PackResult:
    """The one pack path, into the output's local folder `config.output` (the output folder, or a
    bucket's staging folder): claimed, prepared, resumed or cleared, the shards written, then the
    output published (output.py)."""
    assert not is_remote(config.output), "pack_into writes a local folder: give it output.local_config(config)"
    started = time.perf_counter()
    mark("pack")
    if not is_remote(config.source):
        refuse_overlap(config.source, config.output)
    with ray_session(config):  # connected before anything is written or deleted
        claimed = claim(config.output, resume=config.resume, overwrite=config.overwrite)
        folder = claimed.output
        try:
            prepared = prepare(config, dedup_progress, output=folder, extension=extension)
            config, found, settings = prepared.config, prepared.found, prepared.settings
            first = 0 if extension is None else extension.first_shard
            finished = resumable(folder, settings, lambda: _dry_plan(config, found, first)) if config.resume else None
            if config.overwrite:
                clear(claimed)
            if finished is None:
                if config.resume and (folder / MANIFEST_NAME).exists():
                    # a pack finished with rows a passing fault kept out: its manifest goes first,
                    # since the shards those rows belong to are written again
                    with writing(folder, MANIFEST_NAME):
                        (folder / MANIFEST_NAME).unlink()
                write_state(folder, settings)
        except BaseException:
            claimed.release(undo=True)
            raise
        if finished is not None:
            # nothing to do but what a kill in the finished pack's cleanup left: a clean pack's folder
            remove_state(folder)
            claimed.release(undo=False)
            return already_complete(finished, config, time.perf_counter() - started, labelling(found, config.labels))
        try:
            remove_temp_shards(folder)  # half shards of workers killed in an earlier run
            remove_old_temp_files(folder)
            output.begin()
            specs = _plan(config, found.items, first)
            result = _write_all(config, found, specs, settings, output, progress, prepared.fallbacks, tally)
            output.publish(result.manifest)
        except BaseException:
            remove_temp_shards(folder)  # the workers are stopped by now; what is complete stays for --resume
            raise
        finally:
            claimed.release(undo=False)
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


def _walk(config: PackConfig) -> SourceWalk:
    return pack_source(config).walk()


def prepare(
    config: PackConfig, dedup_progress: HashProgress | None, output: Path | None = None,
    extension: Extension | None = None,
) -> Prepared:  # fmt: skip
    """The one preparation of a local and a remote pack: the flags the source cannot take refused
    before any work, the source walked (a list naming files in the local `output` is refused; an
    append's walk as its `extension` gives it), --resize auto resolved, and with --dedup every file
    hashed (kept in the output's state folder for a resume) and the copies left out."""
    source = pack_source(config)
    source.refuse(config)
    found = source.walk()
    if found.listed is not None and output is not None:
        refuse_sources_inside([item.path for item in found.listed.items], config.output)
    if extension is not None:
        found = extension.walk(found)
    config = resolve_resize(config)
    fallbacks: dict[str, Fallbacks] = {}
    if config.dedup != "none":
        cache = None if output is None else state_dir(output) / HASHES_NAME
        earlier = None if extension is None else extension.earlier
        found, fallbacks = _deduplicated(found, config, dedup_progress, cache, earlier)
    return Prepared(config, found, settings_of(config, urls=found.source.downloads), fallbacks)


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


def _found_finished(
    config: PackConfig, output: Output, manifest: Manifest, dedup_progress: HashProgress | None, started: float
) -> PackResult | None:
    """--resume of an output that `Output.open` found finished (a bucket's, before any local state):
    the same plan with every shard there means nothing to do (the shards' sizes are trusted here;
    `shardkit verify` checks their bytes), another plan is refused, and the same plan with shards
    missing or rows that failed transiently (None) is packed again."""
    prepared = prepare(config, dedup_progress)
    plan = fingerprint(prepared.settings, _dry_plan(prepared.config, prepared.found))
    if manifest.settings.get("plan") != plan:
        raise OutputError(
            f"{output.url}: holds a finished pack made with other settings or inputs; use --overwrite to replace it"
        )
    if manifest.totals.get("transient") or not output.complete(manifest):
        return None
    resolved = replace(prepared.config, output=output.url)
    labels = labelling(prepared.found, config.labels)
    return already_complete(manifest, resolved, time.perf_counter() - started, labels)


def _plan(config: PackConfig, items: Iterable[Item], first: int = 0) -> Iterator[ShardSpec]:
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
        first=first,
    )


def _deduplicated(
    found: SourceWalk, config: PackConfig, progress: HashProgress | None, cache: Path | None = None,
    earlier: Earlier | None = None,
) -> tuple[SourceWalk, dict[str, Fallbacks]]:  # fmt: skip
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
        confine=found.source.confine, cache=cache,
        reuse=config.resume,  # an --overwrite starts over: nothing of an earlier run is taken
        earlier=earlier,
    )  # fmt: skip
    offset = len(found.skipped)  # the walk is read whole: its skipped rows are all in
    skipped = [*found.skipped, *dropped]
    listed = SourceList(found.root, found.layout, kept, found.classes, skipped)
    moved = {key: fallback._replace(copies=[(item, offset + place) for item, place in fallback.copies])
             for key, fallback in fallbacks.items()}  # fmt: skip
    return replace(found, items=kept, skipped=skipped, listed=listed, runs=None), moved


def _dry_plan(config: PackConfig, found: SourceWalk, first: int = 0) -> Iterator[ShardSpec]:
    """The plan again, from a walk of its own (the writing keeps `found`'s): a finished pack is
    compared with it before anything is done."""
    items = found.listed.items if found.listed is not None else _walk(config).items
    return _plan(config, items, first)


def _write_all(
    config: PackConfig,
    found: SourceWalk,
    specs: Iterator[ShardSpec],
    settings: dict[str, Any],
    output: Output,
    progress: ProgressCallback | None,
    fallbacks: dict[str, Fallbacks] | None = None,
    tally: Tally | None = None,
) -> PackResult:
    """Write the shards not done yet as the plan is cut, then finish. On --resume, a shard is
    reused when its done marker has its own hash: the same settings and the same files (names,
    sizes, mtimes; and its fallbacks'), and the output still holds it whole (`Output.intact`); a
    shard whose files changed is written again. With --dedup, errors.jsonl says what the workers
    did with the fallbacks (`settle`)."""
    fallbacks = fallbacks or {}
    digest = PlanDigest(settings)
    planned = Planned()
    reading = found.source.reading(config)
    results: dict[int, ShardResult] = {}  # by shard index: kept ones as the plan is read, the rest as they come
    failed = FailedRows(state_dir(output.folder))  # the shards' failed rows, out of `results`
    jobs = _jobs(config, found, specs, output, reading, fallbacks, digest, planned, results, failed)
    workers = config.workers or default_workers()
    # Parts are encoded by local workers and joined here, where the shards are files of the local
    # folder: not for a Ray task (its node's files) or videos (a clip is a job).
    splits = (
        workers > 1 and config.executor == "local" and output.shards_here and reading.splits
    )  # fmt: skip
    upcoming = split_last(jobs, workers) if splits else jobs
    tally = tally if found.source.downloads else None
    _run_all(config, upcoming, output, planned, results, progress, tally, failed, reading.admission())
    mark("results")
    remove_stale_shards(output.folder, {result.shard.name for result in results.values()})
    ordered = [results[number] for number in sorted(results)]  # (plan order: an append's numbers start later)
    inputs = planned.images + len(found.skipped)
    copies_used = {key: packed for result in ordered for key, packed in result.copies_used.items()}
    if copies_used:
        found = replace(found, skipped=settle(found.skipped, fallbacks, copies_used))
    return finish(config, found, ordered, inputs, settings, digest.hexdigest(), output.folder, failed)


def _jobs(
    config: PackConfig,
    found: SourceWalk,
    specs: Iterator[ShardSpec],
    output: Output,
    reading: Reading,
    fallbacks: dict[str, Fallbacks],
    digest: PlanDigest,
    planned: Planned,
    results: dict[int, ShardResult],
    failed: FailedRows,
) -> Iterator[ShardJob]:
    """A job for each planned shard, as the plan is cut; on --resume, a shard an earlier run
    finished goes into `results` instead."""
    folder = output.folder
    for spec in specs:
        copies = {item.key: tuple(c for c, _ in fallbacks[item.key].copies) for item in spec.items
                  if item.key in fallbacks}  # fmt: skip
        shard_hash = fallback_stamps(digest.add(spec), copies)
        planned.shards += 1
        planned.images += len(spec.items)
        previous = reused_shard(folder, spec, shard_hash, output.intact) if config.resume else None
        if previous is not None:
            planned.reused_images += len(spec.items)
            planned.reused_errors += len(previous.errors)
            results[spec.number] = failed.add(previous)
            continue
        # (only a shard that is a file here keeps its records: one in a bucket is written again whole)
        keeps = config.resume and found.source.downloads and output.shards_here
        retried = retried_shard(folder, spec, shard_hash, output.intact) if keeps else None
        own = reading if retried is None else reading.resumed(retried.errors, retried.counts, str(folder / spec.name))
        yield ShardJob(
            spec, str(folder), config.format, config.resize, config.encode, shard_hash, copies, found.options,
            own, destination=output.destination(spec.name), hash_kept=config.dedup == "near",
        )  # fmt: skip
    planned.walked = True


def _run_all(
    config: PackConfig,
    jobs: Iterator[ShardJob],
    output: Output,
    planned: Planned,
    results: dict[int, ShardResult],
    progress: ProgressCallback | None,
    tally: Tally | None,
    failed: FailedRows,
    admission: Admission | None = None,
) -> None:
    """The jobs run as they come (`running`; several at once in each worker with an `admission`),
    each shard's result into `results` by its index once whole (its parts joined here), its done
    marker written by the output where its worker did not (`Output.mark_done`), and counted by
    `tally`; its failed rows go to their part (`failed`), out of the driver's memory."""
    job_specs: list[int] = []  # job number -> shard index
    parts: dict[int, ShardJob] = {}  # job number -> its part job, until that part is back

    def numbered(upcoming: Iterator[ShardJob]) -> Iterator[ShardJob]:
        for job in upcoming:
            job_specs.append(job.spec.number)
            if job.part is not None:
                parts[len(job_specs) - 1] = job
            if len(job_specs) == 1:
                mark("planned")  # the first job, handed to the workers
            yield job

    joining = Joining()
    try:
        # index.parquet's writer is imported on a thread once the workers have their first jobs:
        # the import holds the GIL, and begun before the walk it would hold up the walk, the plan
        # and the pool's start.
        running = run_jobs(
            config, numbered(jobs), planned, progress, started=load_soon, admission=admission, tally=tally
        )
        for job_number, outcome in running:
            if isinstance(outcome, PartResult):
                whole = joining.add(parts.pop(job_number), outcome)
                if whole is None:
                    continue
                outcome = whole
            output.mark_done(outcome)
            if tally is not None:
                tally.add(outcome)
            results[job_specs[job_number]] = failed.add(outcome)
    finally:
        joining.abandon()

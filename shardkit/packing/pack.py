"""Orchestration of a pack: discover -> plan -> write shards in parallel -> errors.jsonl + manifest.json.

`write_shard` is the unit of work: one shard, one file, one worker, written under a temporary name
and renamed when complete. `pack` checks the output folder before any work, reuses finished shards
on `--resume`, and writes the manifest last, atomically.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..core.cluster import check_ray, connect_ray, disconnect_ray, map_ray
from ..core.config import MAX_RECORD_BYTES, RECORD_META_ALLOWANCE, EncodeConfig, PackConfig, ResizeConfig, TableConfig
from ..core.errors import Failure, ImageError, ManifestError, OutputError, ShardFormatError, describe
from ..core.headers import HEAD_BYTES, HeaderError, ImageHeader, parse_header
from ..core.manifest import (
    ERRORS_NAME,
    INDEX_NAME,
    MANIFEST_NAME,
    WIDS_NAME,
    Manifest,
    ShardInfo,
    idx_name,
    info_of,
    read_manifest,
    sha256_file,
    wids_index,
    write_json_atomic,
    write_text_atomic,
)
from ..core.pools import default_workers, map_local
from ..core.processes import mp_context, start_resource_tracker
from ..core.safeio import load_json_file, open_regular
from ..core.version import __version__
from ..formats import get_format
from ..formats.base import Backend, Record, ShardWriter
from ..storage.location import locate
from ..storage.store import Store
from .dedup import dedup_items
from .discover import Item, SourceList, SourceWalk, display, walk
from .encode import STAGES, check_pixels, process_image, record_too_big
from .index import join as join_index
from .index import part_path, write_part
from .index import row as index_row
from .output import (
    HASHES_NAME,
    STATE_NAME,
    claim,
    clear,
    refuse_overlap,
    refuse_sources_inside,
    remove_old_temp_files,
    remove_state,
    remove_temp_shards,
    state_dir,
    temp_dir,
)
from .plan import PlanDigest, ShardSpec, done_path, fingerprint, plan_shards, reusable, settings_hash
from .sidecars import Sidecars, read_sidecars


@dataclass(frozen=True)
class ShardJob:
    spec: ShardSpec
    output: str
    format: str
    resize: ResizeConfig
    encode: EncodeConfig
    plan: str  # fingerprint, stored with the result so a resume can trust it
    confine: str | None = None  # a table's rows may only name files under this (real) folder


@dataclass
class ShardResult:
    shard: ShardInfo
    errors: list[Failure]
    input_bytes: int
    timings: dict[str, float]
    plan: str = ""
    reused: bool = False
    worker: str = ""  # host:pid (local) or Ray node id that wrote the shard
    companion: ShardInfo | None = None  # the shard's index for other readers (Backend.index_file)


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

    @property
    def images_per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


# Set in each worker process by the executor; counts images as they are done, for live progress.
_progress_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _progress_counter
    _progress_counter = counter


def write_shard(job: ShardJob) -> ShardResult:
    """Write one shard from its items; a bad image is recorded, never fatal. A failure to write the
    output (disk full, read-only) raises OutputError and leaves no part of the shard behind."""
    backend = get_format(job.format)
    spec = job.spec
    if not os.path.isdir(state_dir(job.output)) or not os.access(job.output, os.W_OK):
        raise OutputError(
            f"{job.output}: not visible or not writable from worker {socket.gethostname()}:{os.getpid()}; "
            "with --executor ray the output folder must be on storage that every node shares"
        )
    temp = temp_dir(job.output) / f"{spec.name}.{os.getpid()}.tmp"
    index_temp = temp_dir(job.output) / f"{idx_name(spec.name)}.{os.getpid()}.tmp"
    timings = dict.fromkeys(STAGES, 0.0)
    errors: list[Failure] = []
    input_bytes = 0
    rows: list[tuple[Any, ...]] = []  # the shard's part of index.parquet
    with _writing(job.output, spec.name):
        temp.parent.mkdir(parents=True, exist_ok=True)
        writer: ShardWriter = backend.writer(str(temp))
    closed = False
    try:
        for item in spec.items:
            record, size = _pack_one(item, job, timings, errors)
            if record is not None:
                input_bytes += size
                written = time.perf_counter()
                with _writing(job.output, spec.name):
                    writer.add(record)
                rows.append(index_row(record, spec.name, len(rows)))
                timings["write"] += time.perf_counter() - written
            if _progress_counter is not None:
                with _progress_counter.get_lock():
                    _progress_counter.value += 1
        closing = time.perf_counter()
        with _writing(job.output, spec.name):
            count = writer.close()
            closed = True
            info = ShardInfo(spec.name, count, temp.stat().st_size, sha256_file(temp))
            companion = _write_index_file(backend, temp, index_temp, info)
            worker = f"{socket.gethostname()}:{os.getpid()}"
            result = ShardResult(info, errors, input_bytes, timings, job.plan, worker=worker, companion=companion)
            write_part(part_path(state_dir(job.output), spec.name), rows)  # before the marker that vouches for it
            # The marker goes first: no shard is ever in the output without a record of it (what
            # --overwrite may delete); a marker whose shard is missing is simply written again.
            # The index goes before its shard: a shard in the output always has its index.
            write_json_atomic(done_path(job.output, spec), asdict(result))
            if companion is not None:
                os.replace(index_temp, Path(job.output) / companion.name)
            os.replace(temp, Path(job.output) / spec.name)
        timings["write"] += time.perf_counter() - closing
    except BaseException:
        if not closed:  # the first failure is the one to report; the abort's own is not
            with contextlib.suppress(Exception):
                writer.abort()
        raise
    finally:
        temp.unlink(missing_ok=True)
        index_temp.unlink(missing_ok=True)
    return result


def _write_index_file(backend: Backend, shard: Path, path: Path, info: ShardInfo) -> ShardInfo | None:
    """The format's index of the shard just written, for other readers (a tar's DALI index)."""
    if backend.index_file is None:
        return None
    try:
        data = backend.index_file(str(shard))
    except ShardFormatError as error:  # our own writer's tar: a bug, never the input's fault
        raise OutputError(f"{shard}: cannot index the shard just written ({error}); a shardkit bug") from None
    if data is None:  # a tar DALI's index cannot describe (an extension with a space, no sample)
        return None
    path.write_bytes(data)
    return info_of(idx_name(info.name), info.count, data)


def _write_wids_index(output: Path, shards: list[ShardInfo], state: Path) -> ShardInfo:
    """wids' shardindex.json, so `wids.ShardListDataset(OUT/shardindex.json)` opens the output."""
    data = wids_index(shards)
    write_text_atomic(output / WIDS_NAME, data.decode(), temp_dir=state)
    return info_of(WIDS_NAME, sum(shard.count for shard in shards), data)


def _pack_one(item: Item, job: ShardJob, timings: dict[str, float], errors: list[Failure]) -> tuple[Record | None, int]:
    """One source file to a record, or (None, 0) with the reason appended to `errors`."""
    started = time.perf_counter()
    try:
        if job.confine is not None and not os.path.realpath(item.path).startswith(job.confine + os.sep):
            raise ImageError("read", "a link to a file outside the source folder (rows may name only files in it)")
        data, header = read_source(item.path, job.encode.max_pixels)
        timings["read"] += time.perf_counter() - started
        encoded = process_image(data, job.resize, job.encode, timings, header)
        if len(encoded.data) > MAX_RECORD_BYTES - RECORD_META_ALLOWANCE:
            raise ImageError("encode", record_too_big(len(encoded.data)))
        # the source file's hash: `shardkit duplicates OUT --against OTHER` finds copies without reading them
        meta = {**encoded.meta, "source": display(item.relpath), "source_sha256": hashlib.sha256(data).hexdigest()}
        if not item.extra:
            return Record(item.key, encoded.data, encoded.ext, item.label, meta), len(data)
        extra = json.loads(item.extra)  # from the walk: a table row's caption and columns, or sidecar names
        if "sidecars" not in extra:
            text, columns = extra.get("text"), extra.get("columns")
            return Record(item.key, encoded.data, encoded.ext, item.label, meta, text, columns), len(data)
        found = _sidecars(item, extra["sidecars"], encoded.meta, job, timings)
        if encoded.ext in found.files:
            raise ImageError("read", f"a field named .{encoded.ext} would take the image's place")
        record = Record(
            item.key, encoded.data, encoded.ext, found.label, meta, found.text, found.columns, found.files or None
        )
        return record, len(data) + sum(len(blob) for blob in found.files.values())
    except OSError as error:
        errors.append(_error(item.relpath, "read", describe(error)))
    except ImageError as error:
        errors.append(_error(item.relpath, error.stage, error.reason))
    except Exception as error:  # a codec's own exception type for a file it cannot handle, or a bug
        errors.append(_error(item.relpath, _blame(error), f"{describe(error, with_type=True)}"))
    return None, 0


def _sidecars(
    item: Item, parts: dict[str, str], meta: dict[str, Any], job: ShardJob, timings: dict[str, float]
) -> Sidecars:
    started = time.perf_counter()
    try:
        return read_sidecars(os.path.dirname(item.path), parts, meta, job.resize, job.encode.max_pixels)
    finally:
        timings["read"] += time.perf_counter() - started


def max_source_bytes(max_pixels: int) -> int:
    """The largest source file worth reading for an image of at most `max_pixels` pixels: 8 bytes a
    pixel (16-bit RGBA, uncompressed) and 16 MiB of metadata. Anything bigger is not read whole."""
    return max_pixels * 8 + (16 << 20)


def read_source(path: str, max_pixels: int) -> tuple[bytes, ImageHeader]:
    """A source file's bytes and header: the header is read and checked first, so neither a bomb
    nor a multi-GB file is read into memory; FIFOs and devices are refused, never waited on."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEAD_BYTES, 0)
        try:
            header = parse_header(head, lambda offset, n: os.pread(fd, n, offset), size, path)
        except HeaderError as error:
            raise ImageError("header", str(error)) from None
        check_pixels(header, max_pixels)
        if size > max_source_bytes(max_pixels):
            raise ImageError("read", f"{size:,} bytes is more than an image of {max_pixels:,} pixels needs; not read")
        data = head if len(head) == size else _read_all(fd)
    finally:
        os.close(fd)
    return data, header


def _read_all(fd: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    with open(fd, "rb", buffering=0, closefd=False) as source:
        return source.readall()


class _writing:
    """Turns an OSError while writing the output into an OutputError naming the output and cause."""

    def __init__(self, output: str | os.PathLike[str], what: str) -> None:
        self.output, self.what = output, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, trace: object) -> None:
        if isinstance(error, OSError):
            raise output_error(self.output, self.what, error) from None


def output_error(output: str | os.PathLike[str], what: str, error: OSError) -> OutputError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        cause = "no space left on device" if error.errno == errno.ENOSPC else "disk quota exceeded"
        return OutputError(f"{output}: {cause} (writing {what}); free some space, then run again with --resume")
    return OutputError(f"{output}: cannot write {what} ({describe(error)})")


def _error(relpath: str, stage: str, reason: str) -> Failure:
    return Failure(display(relpath), stage, reason)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # shardkit/, not packing/


def _blame(error: BaseException) -> str:
    """ "decode" when the exception came out of a codec (Pillow, libjpeg-turbo: their own types for
    a file they cannot read), "internal" when shardkit's own code raised it: a bug must not pass
    for a bad image in errors.jsonl."""
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    where = os.path.abspath(trace.tb_frame.f_code.co_filename) if trace is not None else ""
    return "internal" if where.startswith(_PACKAGE) else "decode"


def resolve_resize(config: PackConfig) -> PackConfig:
    """Resize "auto": the probe's recommendation for `config.train_size`, computed by the same
    function `probe` uses (a streamed probe of the source first: bounded memory, whatever its size)."""
    if config.resize.size != "auto":
        return config
    from .probe import probe

    recommendation = probe(config.source, train_size=config.train_size, workers=config.workers).recommendation
    size = recommendation.resize if recommendation is not None else None
    return replace(config, resize=replace(config.resize, size=size))


def settings_of(config: PackConfig) -> dict[str, Any]:
    """What decides the bytes of the output (not where it goes or how many workers write it)."""
    return {
        "format": config.format,
        "resize": asdict(config.resize),
        "encode": asdict(config.encode),
        "shard_size": config.shard_size,
        "shard_bytes": config.shard_bytes,
        "shuffle": config.shuffle,
        "seed": config.seed,
        "labels": config.labels,
        "jpeg_backend": _jpeg_backend(),
        # only when flags name a table's columns: the settings of every other pack keep their hash
        **({"table": asdict(config.table)} if config.table != TableConfig() else {}),
        **({"sidecars": True} if config.sidecars else {}),
        **({"dedup": _dedup_settings(config)} if config.dedup != "none" else {}),
    }


def _dedup_settings(config: PackConfig) -> dict[str, Any]:
    return {"mode": config.dedup, **({"threshold": config.dedup_threshold} if config.dedup == "near" else {})}


def _jpeg_backend() -> str:
    # Different codecs may encode different bytes: a resume must not mix them.
    import PIL

    from .encode import write_codec

    return f"{write_codec()} (PIL {PIL.__version__})"


ProgressCallback = Callable[[int, "int | None", int], None]  # images done, total (None while walking), errors
HashProgress = Callable[[int, int], None]  # files hashed, of how many (pack --dedup's first pass)


def pack(
    config: PackConfig, *, progress: ProgressCallback | None = None, dedup_progress: HashProgress | None = None
) -> PackResult:
    """Pack `config.source` into shards in `config.output`. Returns what was done.

    Everything that can be refused (bad output, overlap with the source, another pack running, files
    shardkit did not write) is refused before any shard is written, and leaves the folder as it was.
    Shards are planned as the walk goes and written as soon as each is planned: the driver holds
    what is in flight, not the whole list (except for --shuffle and --dedup, which need the whole
    list; --dedup hashes every file first, reported through `dedup_progress`).
    """
    location = locate(config.output, config.storage_options, manifest=False)
    if not isinstance(location, Path):
        return _pack_to_remote(config, location, progress, dedup_progress)
    started = time.perf_counter()
    backend = get_format(config.format)
    refuse_overlap(config.source, config.output)
    with _ray_session(config):  # connected before anything is written or deleted
        held = claim(config.output, resume=config.resume, overwrite=config.overwrite)
        output = held.output
        try:
            found = walk(config.source, labels=config.labels, table=config.table, sidecars=config.sidecars)
            if found.listed is not None:
                refuse_sources_inside([item.path for item in found.listed.items], config.output)
            config = resolve_resize(config)
            if config.dedup != "none":
                found = _deduplicated(found, config, dedup_progress, state_dir(output) / HASHES_NAME)
            settings = settings_of(config)
            finished = _resumable(output, settings, lambda: _dry_plan(config, found)) if config.resume else None
            if config.overwrite:
                clear(held)
            if finished is None:
                with _writing(output, "its state"):
                    state = {"settings": settings_hash(settings), "created_by": _CREATED_BY}
                    write_json_atomic(state_dir(output) / STATE_NAME, state)
        except BaseException:
            held.release(undo=True)
            raise
        if finished is not None:
            held.release(undo=True)  # as it was found: nothing to do
            return _already_complete(finished, config, started)
        try:
            remove_temp_shards(output)  # half shards of workers killed in an earlier run
            remove_old_temp_files(output)
            specs = _plan(config, found.items, backend.suffix)
            result = _write_all(config, found, specs, settings, output, progress)
        except BaseException:
            remove_temp_shards(output)  # the workers are stopped by now; what is complete stays for --resume
            raise
        finally:
            held.release(undo=False)
    result.seconds = time.perf_counter() - started
    return result


def _pack_to_remote(
    config: PackConfig, store: Store, progress: ProgressCallback | None, dedup_progress: HashProgress | None
) -> PackResult:
    """A pack into a URL: the bucket is checked first, the shards are packed into a local staging
    folder (resumable as any output), then uploaded with the manifest last (see publish)."""
    from .publish import claim_remote, clear_staging, publish, staging_folder

    started = time.perf_counter()
    get_format(config.format)
    remote = claim_remote(store, resume=config.resume, overwrite=config.overwrite)
    if config.resume and remote.manifest is not None:
        # A finished output in the bucket: the same plan means nothing to do (its objects' sizes are
        # trusted here; `shardkit verify URL` checks their bytes), another one is refused.
        resolved = resolve_resize(config)
        found = walk(config.source, labels=config.labels, table=config.table, sidecars=config.sidecars)
        if resolved.dedup != "none":
            found = _deduplicated(found, resolved, dedup_progress)
        plan = fingerprint(settings_of(resolved), _dry_plan(resolved, found))
        if remote.manifest.settings.get("plan") != plan:
            raise OutputError(
                f"{store.url}: holds a finished pack made with other settings or inputs; use --overwrite to replace it"
            )
        if all(remote.held.get(shard.name) == shard.bytes for shard in remote.manifest.shards):
            return _already_complete(remote.manifest, replace(resolved, output=store.url), started)
    staging = staging_folder(store.url, config.staging)
    begun = state_dir(staging).exists() or (staging / MANIFEST_NAME).exists()
    resume = config.resume and begun
    occupied = staging.is_dir() and any(staging.iterdir())
    try:
        staging.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OutputError(f"{staging}: cannot stage the shards here ({describe(error)})") from None
    local = replace(
        config, output=str(staging), resume=resume, overwrite=occupied and not resume, storage_options=None,
        staging=None,
    )  # fmt: skip
    result = pack(local, progress=progress, dedup_progress=dedup_progress)
    manifest, kept = publish(staging, remote)
    clear_staging(staging, manifest)
    return replace(
        result, output=store.url, already_complete=False, reused_shards=max(result.reused_shards, kept),
        seconds=time.perf_counter() - started,
    )  # fmt: skip


def _plan(config: PackConfig, items: Iterable[Item], suffix: str) -> Iterator[ShardSpec]:
    return plan_shards(
        items,
        suffix=suffix,
        shard_size=config.shard_size,
        shard_bytes=config.shard_bytes,
        shuffle=config.shuffle,
        seed=config.seed,
    )


def _deduplicated(
    found: SourceWalk, config: PackConfig, progress: HashProgress | None, cache: Path | None = None
) -> SourceWalk:
    """The walk with the copies left out (each a Failure at stage "duplicate", beside the walk's
    own skips): every file is hashed first, so the walk is read whole, as --shuffle reads it. The
    hashes are kept in `cache` as they come (the output's state folder), for a resume."""
    items = list(found.items)
    total = len(items)
    kept, dropped = dedup_items(
        items, config.dedup, config.dedup_threshold, config.encode.max_pixels, config.workers,
        None if progress is None else lambda done: progress(done, total),
        # a table's rows may only name files in its folder: one outside is never the copy kept
        confine=os.path.realpath(found.root) if found.layout == "table" else None, cache=cache,
        reuse=config.resume,  # an --overwrite starts over: nothing of an earlier run is taken
    )  # fmt: skip
    skipped = [*found.skipped, *dropped]
    listed = SourceList(found.root, found.layout, kept, found.classes, skipped)
    return replace(found, items=kept, skipped=skipped, listed=listed, runs=None)


def _dry_plan(config: PackConfig, found: SourceWalk) -> Iterator[ShardSpec]:
    """The plan again, from a walk of its own (the writing keeps `found`'s): a finished pack is
    compared with it before anything is done."""
    items = (
        found.listed.items
        if found.listed is not None
        else walk(config.source, labels=config.labels, table=config.table, sidecars=config.sidecars).items
    )
    return _plan(config, items, get_format(config.format).suffix)


@contextlib.contextmanager
def _ray_session(config: PackConfig) -> Iterator[None]:
    """With --executor ray, the connection to the cluster, made first: a cluster that cannot be
    reached must be refused before --overwrite deletes anything."""
    if config.executor != "ray":
        yield
        return
    check_ray()
    started = connect_ray(config.ray_address)
    try:
        yield
    finally:
        if started:
            disconnect_ray()


_CREATED_BY = f"shardkit {__version__}"


def _write_all(
    config: PackConfig,
    found: SourceWalk,
    specs: Iterator[ShardSpec],
    settings: dict[str, Any],
    output: Path,
    progress: ProgressCallback | None,
) -> PackResult:
    """Write the shards not done yet as the plan is cut, then errors.jsonl and the manifest (last),
    and clean up. On --resume, a shard is reused when its done marker has its own hash: the same
    settings and the same files (names, sizes, mtimes); a shard whose files changed is written again."""
    digest = PlanDigest(settings)
    results: dict[int, ShardResult] = {}
    job_specs: list[int] = []  # job number -> shard index
    planned = Planned()

    # a table's rows name files by path: a link among them must not lead outside the source
    confine = os.path.realpath(found.root) if found.layout == "table" else None

    def jobs() -> Iterator[ShardJob]:
        for spec in specs:
            shard_hash = digest.add(spec)
            planned.shards += 1
            planned.images += len(spec.items)
            previous = reusable(output, spec, shard_hash) if config.resume else None
            if previous is not None:
                results[spec.index] = _result_from_json(previous)
                planned.reused_images += len(spec.items)
                planned.reused_errors += len(previous["errors"])
                continue
            job_specs.append(spec.index)
            yield ShardJob(spec, str(output), config.format, config.resize, config.encode, shard_hash, confine)
        planned.walked = True

    for job_number, result in _run_jobs(config, jobs(), planned, progress):
        results[job_specs[job_number]] = result
    _remove_stale_shards(output, {result.shard.name for result in results.values()})

    ordered = [results[index] for index in range(planned.shards)]
    error_rows = list(found.skipped)
    error_rows += [row for result in ordered for row in result.errors]
    records = sum(r.shard.count for r in ordered)
    inputs = planned.images + len(found.skipped)
    duplicates = sum(1 for row in found.skipped if row.stage == "duplicate")
    totals = {"inputs": inputs, "records": records, "errors": len(error_rows)}
    if config.dedup != "none":  # of the errors, the copies left out: what a later run can say without reading
        totals["duplicates"] = duplicates
    manifest = Manifest(
        format=config.format,
        shards=[r.shard for r in ordered],
        classes=found.classes,
        settings={
            **settings,
            "source": {"path": os.fspath(config.source), "layout": found.layout},
            "plan": digest.hexdigest(),
        },
        totals=totals,
        created_by=_CREATED_BY,
    ).sealed()
    state = state_dir(output)
    with _writing(output, INDEX_NAME):
        index = join_index((_index_part(output, config.format, r.shard) for r in ordered), output, state)
    companions = [r.companion for r in ordered if r.companion is not None]
    if config.format == "webdataset":
        with _writing(output, WIDS_NAME):
            companions.append(_write_wids_index(output, [r.shard for r in ordered], state))
    manifest = replace(manifest, index=index, companions=companions).sealed()
    with _writing(output, ERRORS_NAME):
        lines = "".join(json.dumps(row.to_json(), sort_keys=True) + "\n" for row in error_rows)
        write_text_atomic(output / ERRORS_NAME, lines, temp_dir=state)
    with _writing(output, MANIFEST_NAME):
        write_json_atomic(output / MANIFEST_NAME, manifest.to_json(), temp_dir=state)
    remove_state(output)
    stage_seconds = dict.fromkeys(STAGES, 0.0)
    for result in ordered:
        if not result.reused:
            for stage, seconds in result.timings.items():
                stage_seconds[stage] = stage_seconds.get(stage, 0.0) + seconds
    return PackResult(
        output=str(output),
        manifest=manifest,
        inputs=inputs,
        records=records,
        errors=len(error_rows),
        shards=planned.shards,
        reused_shards=sum(1 for r in ordered if r.reused),
        input_bytes=sum(r.input_bytes for r in ordered),
        output_bytes=sum(r.shard.bytes for r in ordered),
        seconds=0.0,
        stage_seconds=stage_seconds,
        resize=config.resize.pixels,
        nodes=len({r.worker.split(":")[0] for r in ordered if not r.reused}) or 1,
        duplicates=duplicates,
    )


@dataclass
class Planned:
    """How far the plan has got while shards are being written (for progress and the totals)."""

    shards: int = 0
    images: int = 0
    reused_images: int = 0
    reused_errors: int = 0
    walked: bool = False  # the walk is over: `images` is the total


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


def _remove_stale_shards(output: Path, planned: set[str]) -> None:
    """Shards an interrupted run wrote that this plan no longer has (its inputs changed since):
    only those a done marker names, that is, only files shardkit wrote."""
    with contextlib.suppress(OSError):
        for marker in (state_dir(output) / "done").iterdir():
            name = marker.name.removesuffix(".json")
            if marker.name.endswith(".json") and name not in planned:
                with _writing(output, name):
                    (output / name).unlink(missing_ok=True)
                    (output / idx_name(name)).unlink(missing_ok=True)
                marker.unlink(missing_ok=True)


def _resumable(output: Path, settings: dict[str, Any], plan: Callable[[], Iterable[ShardSpec]]) -> Manifest | None:
    """What --resume finds: an interrupted run with the same settings (None: carry on), the same
    pack finished with every shard intact (its manifest: nothing to do), or else a refusal. A
    folder with neither state nor manifest was stopped before it began: there is nothing to reuse.
    Only a finished pack is compared with the whole plan (a walk and a stat of every file, no
    writing): an interrupted one is checked shard by shard as it is resumed."""
    state_file = state_dir(output) / STATE_NAME
    if os.path.lexists(state_file):
        try:
            state = load_json_file(state_file)
            previous = state.get("settings")
        except (OSError, ValueError, AttributeError):
            state, previous = {}, None
        if previous is None and isinstance(state, dict) and "plan" in state:
            raise OutputError(f"{output}: was started by an earlier shardkit, which cannot be resumed; use --overwrite")
        if previous != settings_hash(settings):
            raise OutputError(
                f"{output}: was started with other settings; resume with the same flags, or use --overwrite"
            )
        return None
    if not (output / MANIFEST_NAME).exists():
        return None
    try:
        manifest = read_manifest(output)
    except ManifestError as error:
        raise OutputError(f"{error}; use --overwrite to pack again") from None
    if manifest.settings.get("plan") != fingerprint(settings, plan()):
        raise OutputError(
            f"{output}: holds a finished pack made with other settings or inputs; use --overwrite to replace it"
        )
    for shard in manifest.shards:
        path = output / shard.name
        try:
            intact = path.stat().st_size == shard.bytes and sha256_file(path) == shard.sha256
        except OSError:
            intact = False
        if not intact:
            raise OutputError(f"{path}: no longer what the manifest says; use --overwrite to pack again")
    return manifest


def _already_complete(manifest: Manifest, config: PackConfig, started: float) -> PackResult:
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
        seconds=time.perf_counter() - started,
        resize=config.resize.pixels,
        already_complete=True,
        duplicates=manifest.totals.get("duplicates", 0),
    )


def _result_from_json(data: dict[str, Any]) -> ShardResult:
    companion = data.get("companion")
    return ShardResult(
        shard=ShardInfo(**data["shard"]),
        errors=[Failure(**row) for row in data["errors"]],
        input_bytes=data["input_bytes"],
        timings=data["timings"],
        plan=data["plan"],
        reused=True,
        companion=None if companion is None else ShardInfo(**companion),
    )


def _run_jobs(
    config: PackConfig,
    jobs: Iterator[ShardJob],
    planned: Planned,
    progress: ProgressCallback | None,
) -> Iterator[tuple[int, ShardResult]]:
    """Yield (job number, result) as shards finish, drawing jobs from the plan as workers free up;
    a ticker reports images done (and the total once the walk is over) while shards are in flight."""

    def total() -> int | None:
        return planned.images if planned.walked else None

    if config.executor == "ray":
        yield from _run_on_ray(jobs, planned, progress, total)
        return

    workers = config.workers or default_workers()
    start_resource_tracker()  # the counter's lock is a semaphore: its tracker started as executors says
    counter = mp_context().Value("q", 0)
    errors = [0]
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.25):
            if progress is not None:
                progress(planned.reused_images + done(), total(), planned.reused_errors + errors[0])

    def done() -> int:
        # Read without the counter's lock: a worker killed by a stop may die holding it.
        return counter.get_obj().value

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        for index, result in map_local(write_shard, jobs, workers, initializer=_init_worker, initargs=(counter,)):
            errors[0] += len(result.errors)
            yield index, result
    finally:
        stop.set()
        ticker.join()
        _init_worker(None)
        if progress is not None:
            progress(planned.reused_images + done(), total(), planned.reused_errors + errors[0])


def _run_on_ray(
    jobs: Iterable[ShardJob], planned: Planned, progress: ProgressCallback | None, total: Callable[[], int | None]
) -> Iterator[tuple[int, ShardResult]]:
    """`_run_jobs` on Ray: progress as each shard's result comes back (no shared counter across nodes)."""
    errors = 0
    done = 0
    if progress is not None:
        progress(planned.reused_images, total(), planned.reused_errors)
    nodes: dict[int, str] = {}
    # connected by pack(), whose disconnection ends the tasks of a stopped run
    for index, result in map_ray(write_shard, jobs, nodes=nodes, cancel=False):
        result.worker = nodes[index]
        done += result.shard.count + len(result.errors)
        errors += len(result.errors)
        if progress is not None:
            progress(planned.reused_images + done, total(), planned.reused_errors + errors)
        yield index, result

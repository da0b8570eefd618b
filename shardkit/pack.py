"""Orchestration of a pack: discover -> plan -> write shards in parallel -> errors.jsonl + manifest.json.

`write_shard` is the unit of work: one shard, one file, one worker, written under a temporary name
and renamed when complete. `pack` checks the output folder before any work, reuses finished shards
on `--resume`, and writes the manifest last, atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from . import __version__
from .config import EncodeConfig, PackConfig, ResizeConfig
from .discover import Source, discover, display
from .errors import ImageError, OutputError
from .executors import check_ray, default_workers, map_local, map_ray, mp_context
from .formats import Record, get_format
from .imaging import STAGES, process_image
from .manifest import (
    ERRORS_NAME,
    MANIFEST_NAME,
    STATE_DIR,
    Manifest,
    ShardInfo,
    sha256_file,
    write_json_atomic,
    write_text_atomic,
)
from .plan import SHARD_PREFIX, ShardSpec, done_path, fingerprint, plan_shards, reusable, state_dir


@dataclass(frozen=True)
class ShardJob:
    spec: ShardSpec
    output: str
    format: str
    resize: ResizeConfig
    encode: EncodeConfig
    plan: str  # fingerprint, stored with the result so a resume can trust it


@dataclass
class ShardResult:
    shard: ShardInfo
    errors: list[dict[str, str]]
    input_bytes: int
    timings: dict[str, float]
    plan: str = ""
    reused: bool = False
    worker: str = ""  # host:pid (local) or Ray node id that wrote the shard


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

    @property
    def images_per_second(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


# Set in each worker process by the executor; counts images as they are done, for live progress.
_progress_counter: Any = None


def _init_worker(counter: Any) -> None:
    global _progress_counter
    _progress_counter = counter


def write_shard(job: ShardJob) -> ShardResult:
    """Write one shard from its items; a bad image is recorded, never fatal."""
    backend = get_format(job.format)
    spec = job.spec
    if not os.path.isdir(state_dir(job.output)) or not os.access(job.output, os.W_OK):
        raise OutputError(
            f"{job.output}: not visible or not writable from worker {socket.gethostname()}:{os.getpid()}; "
            "with --executor ray the output folder must be on storage that every node shares"
        )
    temp = state_dir(job.output) / "tmp" / f"{spec.name}.{os.getpid()}.tmp"
    temp.parent.mkdir(parents=True, exist_ok=True)
    timings = dict.fromkeys(STAGES, 0.0)
    errors: list[dict[str, str]] = []
    input_bytes = 0
    writer = backend.writer(str(temp))
    try:
        for item in spec.items:
            started = time.perf_counter()
            try:
                with open(item.path, "rb", buffering=0) as source:
                    data = source.readall()
                timings["read"] += time.perf_counter() - started
                encoded = process_image(data, job.resize, job.encode, timings)
            except OSError as error:
                errors.append(_error(item.relpath, "read", error.strerror or str(error)))
            except ImageError as error:
                errors.append(_error(item.relpath, error.stage, error.reason))
            except Exception as error:
                errors.append(_error(item.relpath, "decode", f"{type(error).__name__}: {error}"))
            else:
                input_bytes += len(data)
                written = time.perf_counter()
                meta = {
                    **encoded.meta,
                    "source": display(item.relpath),
                }
                writer.add(Record(item.key, encoded.data, encoded.ext, item.label, meta))
                timings["write"] += time.perf_counter() - written
            if _progress_counter is not None:
                with _progress_counter.get_lock():
                    _progress_counter.value += 1
        closing = time.perf_counter()
        finishing, writer = writer, None  # a failing close must not be retried by the finally below
        count = finishing.close()
        info = ShardInfo(spec.name, count, temp.stat().st_size, sha256_file(temp))
        os.replace(temp, Path(job.output) / spec.name)
        timings["write"] += time.perf_counter() - closing
    finally:
        if writer is not None:
            writer.close()
        temp.unlink(missing_ok=True)
    worker = f"{socket.gethostname()}:{os.getpid()}"
    result = ShardResult(info, errors, input_bytes, timings, job.plan, worker=worker)
    # The marker goes last: a shard without it is simply written again on resume.
    write_json_atomic(done_path(job.output, spec), asdict(result))
    return result


def _error(relpath: str, stage: str, reason: str) -> dict[str, str]:
    return {
        "path": display(relpath),
        "stage": stage,
        "reason": reason,
    }


def prepare_output(config: PackConfig) -> Path:
    """Refuse a bad output folder before any work: not a folder, unwritable, or not empty."""
    output = Path(config.output)
    if output.exists() and not output.is_dir():
        raise OutputError(f"{output}: exists and is not a folder")
    if output.is_dir():
        entries = [entry.name for entry in os.scandir(output)]
        if entries and not (config.resume or config.overwrite):
            raise OutputError(f"{output}: not empty; use --resume to finish an interrupted pack or --overwrite")
        if config.overwrite:
            foreign = [name for name in entries if not _ours(name)]
            if foreign:
                raise OutputError(f"{output}: holds files shardkit did not write ({foreign[0]}); use an empty folder")
            for name in entries:
                path = output / name
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    try:
        (output / STATE_DIR / "done").mkdir(parents=True, exist_ok=True)
        probe_file = output / STATE_DIR / ".write-test"
        probe_file.write_bytes(b"")
        probe_file.unlink()
    except OSError as error:
        raise OutputError(f"{output}: cannot write here ({error.strerror or error})") from None
    return output


def _ours(name: str) -> bool:
    return name in (MANIFEST_NAME, ERRORS_NAME, STATE_DIR) or name.startswith((SHARD_PREFIX, f".{MANIFEST_NAME}."))


def resolve_resize(config: PackConfig, source: Source, auto: bool, train_size: int) -> PackConfig:
    """`--resize auto`: the probe's recommendation, computed by the same function `probe` uses."""
    if not auto:
        return config
    from .probe import probe_records, summarize

    records = probe_records([item.path for item in source.items], [item.relpath for item in source.items])
    recommendation = summarize(records, train_size=train_size).recommendation
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
    }


def _jpeg_backend() -> str:
    # Different codecs may encode different bytes: a resume must not mix them.
    import PIL

    from .imaging import write_codec

    return f"{write_codec()} (PIL {PIL.__version__})"


ProgressCallback = Callable[[int, int, int], None]  # images done, images total, errors so far


def pack(
    config: PackConfig,
    *,
    resize_auto: bool = False,
    train_size: int = 224,
    progress: ProgressCallback | None = None,
) -> PackResult:
    """Pack `config.source` into shards in `config.output`. Returns what was done."""
    started = time.perf_counter()
    backend = get_format(config.format)
    if config.executor == "ray":
        check_ray()
    source = discover(config.source, labels=config.labels)
    output = prepare_output(config)
    config = resolve_resize(config, source, resize_auto, train_size)
    specs = plan_shards(
        source.items,
        suffix=backend.suffix,
        shard_size=config.shard_size,
        shard_bytes=config.shard_bytes,
        shuffle=config.shuffle,
        seed=config.seed,
    )
    settings = settings_of(config)
    plan_hash = fingerprint(settings, specs)
    _check_resume(output, config, plan_hash)

    results: dict[int, ShardResult] = {}
    for spec in specs:
        previous = reusable(output, spec, plan_hash) if config.resume else None
        if previous is not None:
            results[spec.index] = _result_from_json(previous)
    todo = [
        ShardJob(spec, str(output), config.format, config.resize, config.encode, plan_hash)
        for spec in specs
        if spec.index not in results
    ]
    reused = len(results)
    total_items = len(source.items)
    done_before = sum(len(specs[i].items) for i in results)
    errors_before = sum(len(r.errors) for r in results.values())
    for index, result in _run_jobs(config, todo, total_items, done_before, errors_before, progress):
        results[todo[index].spec.index] = result

    ordered = [results[spec.index] for spec in specs]
    error_rows = [_error(s.relpath, "discover", s.reason) for s in source.skipped]
    error_rows += [row for result in ordered for row in result.errors]
    write_text_atomic(output / ERRORS_NAME, "".join(json.dumps(row, sort_keys=True) + "\n" for row in error_rows))
    records = sum(r.shard.count for r in ordered)
    inputs = len(source.items) + len(source.skipped)
    manifest = Manifest(
        format=config.format,
        shards=[r.shard for r in ordered],
        classes=source.classes,
        settings={**settings, "source": {"path": os.fspath(config.source), "layout": source.layout}},
        totals={"inputs": inputs, "records": records, "errors": len(error_rows)},
        created_by=f"shardkit {__version__}",
    ).sealed()
    write_json_atomic(output / MANIFEST_NAME, manifest.to_json())
    shutil.rmtree(output / STATE_DIR, ignore_errors=True)
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
        shards=len(specs),
        reused_shards=reused,
        input_bytes=sum(r.input_bytes for r in ordered),
        output_bytes=sum(r.shard.bytes for r in ordered),
        seconds=time.perf_counter() - started,
        stage_seconds=stage_seconds,
        resize=config.resize.size,
        nodes=len({r.worker.split(":")[0] for r in ordered if not r.reused}) or 1,
    )


def _check_resume(output: Path, config: PackConfig, plan_hash: str) -> None:
    state_file = state_dir(output) / "state.json"
    if config.resume and state_file.exists():
        try:
            previous = json.loads(state_file.read_text(encoding="utf-8")).get("plan")
        except (OSError, ValueError):
            previous = None
        if previous != plan_hash:
            raise OutputError(
                f"{output}: was started with other settings or inputs; resume with the same flags, or use --overwrite"
            )
    write_json_atomic(state_file, {"plan": plan_hash, "created_by": f"shardkit {__version__}"})


def _result_from_json(data: dict[str, Any]) -> ShardResult:
    return ShardResult(
        shard=ShardInfo(**data["shard"]),
        errors=data["errors"],
        input_bytes=data["input_bytes"],
        timings=data["timings"],
        plan=data["plan"],
        reused=True,
    )


def _run_jobs(
    config: PackConfig,
    jobs: list[ShardJob],
    total: int,
    done_before: int,
    errors_before: int,
    progress: ProgressCallback | None,
):
    """Yield (job index, result); a ticker reports images done while shards are in flight."""
    if config.executor == "ray":
        errors = errors_before
        done = done_before
        if progress is not None:
            progress(done, total, errors)
        nodes: dict[int, str] = {}
        for index, result in map_ray(write_shard, jobs, address=config.ray_address, nodes=nodes):
            result.worker = nodes[index]
            done += len(jobs[index].spec.items)
            errors += len(result.errors)
            if progress is not None:
                progress(done, total, errors)
            yield index, result
        return

    counter = mp_context().Value("q", 0)
    errors = [errors_before]
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(0.25):
            if progress is not None:
                progress(done_before + counter.value, total, errors[0])

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    workers = config.workers or default_workers()
    try:
        for index, result in map_local(write_shard, jobs, workers, initializer=_init_worker, initargs=(counter,)):
            errors[0] += len(result.errors)
            yield index, result
    finally:
        stop.set()
        ticker.join()
        _init_worker(None)
        if progress is not None:
            progress(done_before + counter.value, total, errors[0])

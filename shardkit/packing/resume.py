"""What a pack may reuse: the settings that decide an output's bytes (and their hash in the state
file), the verdict on an output found begun or finished, the shards an interrupted run finished
(done markers whose shard is intact and whose plan hash is this plan's), and the stale shards of
an earlier plan. Nothing here writes shards; `claim` (folder_output.py) has already refused what is not
shardkit's, and whether a kept shard is still whole is the output's to say (`Output.intact`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core.config import PackConfig, TableConfig
from ..core.errors import Failure, ManifestError, OutputError
from ..core.manifest import MANIFEST_NAME, Manifest, ShardInfo, idx_name, read_manifest, sha256_file, write_json_atomic
from ..core.safeio import load_json_file
from ..core.version import __version__
from .plan import ShardSpec, fingerprint, settings_hash
from .shard_writing import ShardResult
from .working_folder import STATE_NAME, done_path, state_dir, writing

CREATED_BY = f"shardkit {__version__}"


def settings_of(config: PackConfig, *, urls: bool = False) -> dict[str, Any]:
    """What decides the bytes of the output (not where it goes or how many workers write it). For
    a table of URLs (`urls`), the download settings that decide which images get in."""
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
        # shards cut by estimated output bytes, not by source bytes as older shardkits cut them: another plan
        **({"shard_bytes_of": "output"} if config.shard_bytes is not None else {}),
        **({"dedup": _dedup_settings(config)} if config.dedup != "none" else {}),
        **({"web": _web_settings(config)} if urls else {}),
        # videos cut into clips: the clip settings and the encoder, which decide every clip's bytes
        **(
            {"clips": asdict(config.clips), "video_backend": _video_backend()}
            if config.clips.seconds is not None
            else {}
        ),
    }


def _video_backend() -> str:
    import av

    from .clips import ENCODER_OPTIONS

    options = ",".join(f"{key}={value}" for key, value in sorted(ENCODER_OPTIONS.items()))
    return f"PyAV {av.__version__} (FFmpeg {av.ffmpeg_version_info}), libx264 {options}"


def _web_settings(config: PackConfig) -> dict[str, Any]:
    web = config.web
    return {"url_column": web.url_column, "max_bytes": web.max_bytes, "respect_noai": web.respect_noai}


def _dedup_settings(config: PackConfig) -> dict[str, Any]:
    return {"mode": config.dedup, **({"threshold": config.dedup_threshold} if config.dedup == "near" else {})}


def _jpeg_backend() -> str:
    # Different codecs may encode different bytes: a resume must not mix them.
    import PIL

    from ..core.codecs import write_codec

    return f"{write_codec()} (PIL {PIL.__version__})"


def write_state(output: Path, settings: dict[str, Any]) -> None:
    """The state file a resume must match: the settings' hash."""
    with writing(output, "its state"):
        state = {"settings": settings_hash(settings), "created_by": CREATED_BY}
        write_json_atomic(state_dir(output) / STATE_NAME, state)


def resumable(output: Path, settings: dict[str, Any], plan: Callable[[], Iterable[ShardSpec]]) -> Manifest | None:
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
        if (output / MANIFEST_NAME).exists():  # finished, its state kept for rows that failed transiently
            _same_plan(output, _finished(output), settings, plan)
        return None
    if not (output / MANIFEST_NAME).exists():
        return None
    manifest = _finished(output)
    _same_plan(output, manifest, settings, plan)
    for shard in manifest.shards:
        path = output / shard.name
        try:
            intact = path.stat().st_size == shard.bytes and sha256_file(path) == shard.sha256
        except OSError:
            intact = False
        if not intact:
            raise OutputError(f"{path}: no longer what the manifest says; use --overwrite to pack again")
    return manifest


def _finished(output: Path) -> Manifest:
    try:
        return read_manifest(output)
    except ManifestError as error:
        raise OutputError(f"{error}; use --overwrite to pack again") from None


def _same_plan(
    output: Path, manifest: Manifest, settings: dict[str, Any], plan: Callable[[], Iterable[ShardSpec]]
) -> None:
    """A finished pack is resumed only with the plan it was made with: its inputs as they were."""
    if manifest.settings.get("plan") != fingerprint(settings, plan()):
        raise OutputError(
            f"{output}: holds a finished pack made with other settings or inputs; use --overwrite to replace it"
        )


def reused_shard(
    output: str | Path, spec: ShardSpec, plan_hash: str, intact: Callable[[ShardResult], bool]
) -> ShardResult | None:
    """The finished result of this shard from an earlier run: its done marker in the local folder
    `output` is well-formed and has this plan's hash, the shard is still exactly it (`intact`: the
    output's check), and none of its rows failed for a passing cause (see `retried_shard`)."""
    result = _earlier(output, spec, plan_hash, intact)
    return None if result is None or any(row.transient for row in result.errors) else result


def retried_shard(
    output: str | Path, spec: ShardSpec, plan_hash: str, intact: Callable[[ShardResult], bool]
) -> ShardResult | None:
    """The earlier result of a shard of a table of URLs whose file is intact but some of whose
    rows failed transiently: the worker keeps its records and its final failures, and downloads
    only those rows again."""
    result = _earlier(output, spec, plan_hash, intact)
    return result if result is not None and any(row.transient for row in result.errors) else None


def _earlier(
    output: str | Path, spec: ShardSpec, plan_hash: str, intact: Callable[[ShardResult], bool]
) -> ShardResult | None:
    marker = done_path(output, spec.name)
    try:
        result = load_json_file(marker)
        ShardInfo(**result["shard"])
        for row in result["errors"]:  # well-formed, or the marker is not trusted
            Failure(**row)
        copies_used = _copies_used(result)
        if not isinstance(copies_used, dict) or not all(isinstance(v, str) for v in copies_used.values()):
            return None
        counts = result.get("counts")  # (absent from an earlier shardkit's marker: not counted)
        if counts is not None and not (
            isinstance(counts, dict) and all(type(v) is int and v >= 0 for v in counts.values())
        ):
            return None
        if result["plan"] != plan_hash:
            return None
        found = _result_from_json(result)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return found if intact(found) else None


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
        copies_used=_copies_used(data),
        counts=data.get("counts"),
    )


def remove_stale_shards(output: Path, planned: set[str]) -> None:
    """Shards an interrupted run wrote that this plan no longer has (its inputs changed since):
    only those a done marker names, that is, only files shardkit wrote."""
    with contextlib.suppress(OSError):
        for marker in (state_dir(output) / "done").iterdir():
            name = marker.name.removesuffix(".json")
            if marker.name.endswith(".json") and name not in planned:
                with writing(output, name):
                    (output / name).unlink(missing_ok=True)
                    (output / idx_name(name)).unlink(missing_ok=True)
                marker.unlink(missing_ok=True)


def _copies_used(marker: dict[str, Any]) -> Any:
    """A marker's copies packed in place of failed files: "copies_used", or "stand_ins" in a marker
    written before the name changed, which a resume still reuses."""
    return marker.get("copies_used", marker.get("stand_ins", {}))

"""Settings: one source of defaults, the flat options the CLI and presets use, named presets."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from shardkit.core.config import DEFAULT_SHARD_SIZE, ClipConfig, EncodeConfig, PackConfig, ResizeConfig, WebConfig
from shardkit.core.errors import ConfigError
from shardkit.core.pack_options import (
    PACK_OPTION_TABLE,
    PACK_OPTIONS,
    PRESET_KEYS,
    load_preset,
    pack_config,
    preset_names,
)


def test_the_cli_shows_the_dataclasses_defaults(shardkit) -> None:
    """Change a default in config.py and the CLI, presets and library all follow: nothing repeats it."""
    text = shardkit("pack", "--help", env={"COLUMNS": "400"}).stdout  # rich wraps help text in a box otherwise
    flat = " ".join(text.split())
    for option, owner, field_name in (("quality", EncodeConfig, "quality"), ("resample", ResizeConfig, "resample"),
                                      ("seed", PackConfig, "seed"), ("labels", PackConfig, "labels")):  # fmt: skip
        default = next(f.default for f in fields(owner) if f.name == field_name)
        assert PACK_OPTIONS[option] == default
        assert f"[default: {default}]" in flat, option


def test_flat_options_make_the_same_config_as_the_dataclasses() -> None:
    built = pack_config("src", "out", resize="256", shard_bytes="1MB", quality=80, workers=2)
    assert built == PackConfig(
        "src", "out", resize=ResizeConfig(256), encode=EncodeConfig(quality=80), shard_bytes=10**6, workers=2
    )
    assert built.shard_size is None  # shard bytes alone: no record count limit
    assert pack_config("src", "out", shard_bytes="1KB").shard_bytes == 1000  # the least the refusal names
    assert PackConfig("src", "out").shard_size == DEFAULT_SHARD_SIZE
    assert pack_config("src", "out", resize="none").resize.size is None
    assert pack_config("src", "out", resize="auto", train_size=160).resize.size == "auto"


def test_bad_options_are_refused_before_any_work() -> None:
    for given, message in (
        ({"resize": "big"}, "number of pixels"),
        ({"resize": "auto", "resize_mode": "long"}, "short side"),
        ({"ray_address": "auto"}, "only used with --executor ray"),
        ({"train_size": 4}, "train size"),
        ({"colour": "red"}, "unknown option 'colour'"),
        ({"shard_bytes": "lots"}, "not a size"),
    ):
        with pytest.raises(ConfigError, match=message):
            pack_config("src", "out", **given)


def test_named_presets_ship_in_the_package(tmp_path: Path) -> None:
    assert "imagenet-256" in preset_names()
    assert load_preset("imagenet-256")["resize"] == 256
    built = pack_config("src", "out", "imagenet-256", quality=75)
    assert (built.resize.size, built.encode.quality, built.shard_size) == (256, 75, 1000)  # the flag wins
    with pytest.raises(ConfigError, match="named: imagenet-256"):
        load_preset("imagenet-999")
    own = tmp_path / "mine.toml"
    own.write_text('format = "lmdb"\nresize = "auto"\n')
    assert pack_config("src", "out", own).format == "lmdb"
    own.write_text("quality = true\n")
    with pytest.raises(ConfigError, match="quality has the wrong type"):
        load_preset(own)


def test_a_library_user_with_a_preset_gets_auto_resize_resolved(sample_dataset: Path, tmp_path: Path) -> None:
    from shardkit.packing.pack import pack

    result = pack(pack_config(sample_dataset, tmp_path / "out", "imagenet-256", resize="auto", shard_size=100))
    assert result.resize == 256 and result.records == 60


def test_each_pack_option_is_one_row_that_the_cli_presets_and_config_follow(tmp_path) -> None:
    """A pack option is written once (PACK_OPTION_TABLE): its flag, its preset key and the field
    it sets all come from that row, so none can be forgotten."""
    import inspect

    from shardkit.cli.pack import pack as command

    flags = inspect.signature(command).parameters
    for option in PACK_OPTION_TABLE:
        assert option.name in flags and option.name in PRESET_KEYS, option.name
        assert option.field in {f.name for f in fields(option.owner)}, option.name
    given = {"format": "lmdb", "resize": "96", "resize_mode": "long", "upscale": True, "max_aspect": 3,
             "resample": "lanczos", "quality": 70, "encode": "raw", "background": "0,0,0", "shard_size": 7,
             "shard_bytes": "2KB",
             "workers": 3, "shuffle": True, "seed": 9, "labels": "none", "train_size": 160, "max_pixels": 1000,
             "executor": "ray", "ray_address": "auto", "dedup": "near", "dedup_threshold": 4,
             "url_column": "link", "retries": 2, "backoff": 0.75, "timeout": 9.5, "max_download": "2MB",
             "download_threads": 4, "per_host": 2, "respect_noai": False, "clip_seconds": 2, "clip_stride": 1.5,
             "clip_fps": 8}  # fmt: skip
    assert set(given) == {option.name for option in PACK_OPTION_TABLE}
    built = pack_config("src", "out", **given)
    owners = {PackConfig: built, ResizeConfig: built.resize, EncodeConfig: built.encode, WebConfig: built.web,
              ClipConfig: built.clips}  # fmt: skip
    for option in PACK_OPTION_TABLE:
        value = getattr(owners[option.owner], option.field)
        assert value != option.default, option.name  # the flat option reached its field
    preset = tmp_path / "all.toml"
    preset.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in given.items()))
    assert pack_config("src", "out", preset) == built

"""The read side's keywords are written once (readers/options.py): the public signatures of
open_shards (its overloads too) and loader() list exactly the options' fields, with the same
defaults and types, so a keyword added in one place and not the other fails here; the options check
their values when they are made."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc
import typing
from pathlib import Path
from typing import Any

import pytest

from shardkit.core.errors import ConfigError
from shardkit.readers.dataset import ShardDataset, open_shards
from shardkit.readers.iteration import EpochIteration
from shardkit.readers.options import LoaderOptions, OpenOptions, ReadOptions, given

from .stage_outputs import photos

NO_DEFAULT = object()


def keywords(function: Any) -> dict[str, tuple[Any, str]]:
    """A signature's keywords (every parameter but `self` and `path`): name -> (default, type)."""
    found = {}
    for name, parameter in inspect.signature(function).parameters.items():
        if name in ("self", "path"):
            continue
        default = NO_DEFAULT if parameter.default is inspect.Parameter.empty else parameter.default
        found[name] = (default, str(parameter.annotation))
    return found


def fields(*kinds: type) -> dict[str, tuple[Any, str]]:
    """The options' keyword fields: name -> (default, type)."""
    found = {}
    for kind in kinds:
        for item in dataclasses.fields(kind):
            if item.init:
                default = NO_DEFAULT if item.default is dataclasses.MISSING else item.default
                found[item.name] = (default, str(item.type))
    return found


def test_open_shards_and_each_overload_list_the_options_fields() -> None:
    overloads = typing.get_overloads(open_shards)
    assert len(overloads) == 2
    for function in (open_shards, *overloads):
        assert keywords(function) == fields(ReadOptions, OpenOptions), function


def test_loader_lists_the_options_fields() -> None:
    assert keywords(EpochIteration.loader) == fields(LoaderOptions)
    text = pydoc.render_doc(ShardDataset.loader)  # help(ds.loader) shows every keyword
    assert all(f"{name}:" in text for name in fields(LoaderOptions))


def test_given_takes_each_field_from_the_keyword_of_its_name() -> None:
    defaults = {name: default for name, (default, _) in fields(LoaderOptions).items() if default is not NO_DEFAULT}
    options = given(LoaderOptions, {"self": None, "batch_size": 8, "size": 32, **defaults})
    assert options == LoaderOptions(8, 32)
    with pytest.raises(KeyError, match="crop"):  # a keyword the signature lacks is no silent default
        given(LoaderOptions, {"batch_size": 8, "size": 32})


def test_loader_options_resolve_what_the_stages_take() -> None:
    options = LoaderOptions(16, 224, workers=3, output="numpy")
    assert (options.out_size, options.resize_to, options.threads, options.ahead) == ((224, 224), 256, 3, 6)
    assert options.torch_device is None and options.normalize == (None, None, None)
    assert options.decoder == "cpu" and LoaderOptions(4, 16, frames=2, output="numpy").decoder == "clips"
    calling = LoaderOptions(4, (48, 80), workers=0, prefetch=9, resize=100, crop="center", output="numpy")
    assert (calling.out_size, calling.resize_to, calling.threads, calling.ahead) == ((48, 80), 100, 0, 0)


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"batch_size": True}, "batch_size must be a positive integer"),
        ({"size": (8, 16385)}, "at most 16384"),
        ({"crop": "middle"}, "crop must be"),
        ({"workers": 2, "prefetch": 0}, "prefetch must be a positive integer"),
        ({"output": "numpy", "dtype": "float16"}, "dtype, mean and std are the device path's"),
        ({"output": "numpy", "device": "cpu"}, "leave output='torch'"),
        ({"output": "numpy", "box_format": "cxcywh"}, "box_format"),
        ({"output": "numpy", "box_labels": "objects.category"}, "give boxes= too"),
        ({"output": "numpy", "frames": 0}, "frames must be a positive integer"),
        ({"output": "numpy", "frames": 4, "boxes": "bbox"}, "takes no device=, mask= or boxes="),
    ],
)
def test_loader_options_refuse_a_bad_value_when_made(options: dict[str, Any], words: str) -> None:
    arguments = {"batch_size": 8, "size": 32, **options}
    with pytest.raises(ConfigError, match=words):
        LoaderOptions(**arguments)


@pytest.mark.parametrize(
    ("options", "words"),
    [({"decode": "jpeg"}, "decode must be"), ({"scale": 0.3}, "scale must be"), ({"on_error": "warn"}, "on_error"),
     ({"seed": -1}, "seed"), ({"max_pixels": 0}, "max_pixels")],
)  # fmt: skip
def test_read_options_refuse_a_bad_value_when_made(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        ReadOptions(**options)


def test_one_output_ignores_a_mix_keyword_left_at_its_default(tmp_path_factory: pytest.TempPathFactory) -> None:
    output: Path = photos(tmp_path_factory)
    assert len(open_shards(output, exhausted="stop")) == len(open_shards(output))  # (as it always has)
    with pytest.raises(ConfigError, match="weights and length are for a mix"):
        open_shards(output, length=3)
    assert OpenOptions().exhausted == "resample"

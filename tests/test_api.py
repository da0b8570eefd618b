"""The public API: every name in shardkit.__all__ resolves, and `import shardkit` stays cheap."""

from __future__ import annotations

import subprocess
import sys

import shardkit


def test_every_public_name_resolves_to_what_its_module_defines() -> None:
    import importlib

    for name in shardkit.__all__:
        value = getattr(shardkit, name)
        if name != "__version__":
            module = importlib.import_module(f"shardkit.{shardkit._EXPORTS[name]}")
            assert value is getattr(module, name), name
    assert sorted(dir(shardkit)) == sorted(shardkit.__all__)
    assert set(shardkit.__all__) == {"__version__", *shardkit._EXPORTS}


def test_an_unknown_name_is_an_attribute_error() -> None:
    try:
        shardkit.no_such_thing  # noqa: B018
    except AttributeError as error:
        assert "no_such_thing" in str(error)
    else:
        raise AssertionError("no AttributeError")


def test_importing_shardkit_imports_nothing_heavy() -> None:
    code = (
        "import sys, shardkit; heavy = [m for m in ('numpy', 'PIL', 'h5py', 'lmdb', 'torch', 'shardkit.readers') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout


def test_the_pack_driver_imports_no_numpy_before_its_workers_start() -> None:
    """A pack's driver imports the CLI, the pack and its plan while the forkserver imports numpy,
    PIL and the codecs for the workers: numpy (~50 ms) in the driver too made it the last to be
    ready. (The index's pyarrow brings numpy later, on a thread, while the workers work.)"""
    code = (
        "import sys, shardkit.cli, shardkit.cli.pack, shardkit.packing.pack, shardkit.packing.running, "
        "shardkit.packing.finish; from shardkit.formats import get_format; [get_format(n) for n in "
        "('webdataset', 'lmdb', 'hdf5')]; heavy = [m for m in ('numpy', 'PIL.Image', 'pyarrow', 'h5py') "
        "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]


def test_reading_without_torch_never_imports_it(packed_sample) -> None:
    """open_shards gives a torch Dataset only where torch is imported already: reading, iterating
    and the numpy loader cost a script without torch no torch import."""
    output = packed_sample("webdataset", 32, 30)
    code = (
        "import sys; from shardkit import open_shards; ds = open_shards(sys.argv[1]); ds[0]; list(ds[:3]); "
        "next(iter(ds.loader(4, 16, output='numpy', workers=0))); print(type(ds).__name__); "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code, str(output)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ShardDataset", run.stdout + run.stderr


def test_pack_probe_and_verify_stay_functions_after_their_modules_are_imported() -> None:
    code = (
        "import shardkit.packing.pack, shardkit.packing.probe, shardkit.checks.verify, shardkit, pickle; "
        "from shardkit.packing.worker import write_shard; "
        "assert callable(shardkit.pack) and callable(shardkit.probe) and callable(shardkit.verify); "
        "from shardkit import pack; assert pack is shardkit.pack and pack.__module__ == 'shardkit.packing.pack'; "
        "assert pickle.loads(pickle.dumps(write_shard)) is write_shard"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_every_entry_refuses_a_bad_worker_count_the_same_way(tmp_path) -> None:
    """One workers check: the library entries, not only the CLI, refuse 0 before any work."""
    import pytest

    from shardkit import PackConfig
    from shardkit.checks.bench import bench
    from shardkit.core.errors import ConfigError

    entries = {
        "pack": lambda: PackConfig(source=tmp_path, output=tmp_path / "out", workers=0),
        "probe": lambda: shardkit.probe(tmp_path, workers=0),
        "verify": lambda: shardkit.verify(tmp_path, workers=0),
        "bench": lambda: bench(tmp_path, workers=0),
    }
    for name, call in entries.items():
        with pytest.raises(ConfigError, match=r"^workers must be at least 1, not 0$"):
            call()
        assert not (tmp_path / "out").exists(), name

"""Subsets and extra columns from index.parquet, no shard rewritten (readers/subset, readers/joined):
`open_shards(OUT, select=...)` and `open_shards(OUT, join=TABLE)` on real packs of every format."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from shardkit.core.errors import ConfigError
from shardkit.formats import available_formats
from shardkit.readers import open_shards
from shardkit.readers.subset import runs

from .helpers import run_killing

SHUFFLED: dict[str, Any] = dict(shuffle=True, seed=7, shuffle_buffer=8)


@pytest.fixture(scope="module", params=available_formats())
def packed(request: pytest.FixtureRequest, packed_sample: Any) -> Path:
    path: Path = packed_sample(request.param, 32, 7)  # shared with other modules: read only
    return path


@pytest.fixture(scope="module")
def tar(packed_sample: Any) -> Path:
    path: Path = packed_sample("webdataset", 32, 7)
    return path


def index_keys(out: Path) -> list[str]:
    keys: list[str] = pq.read_table(out / "index.parquet", columns=["key"]).column("key").to_pylist()
    return keys


def picked(out: Path) -> list[str]:
    """A scattered subset: every third key, and a run of four (kept in no particular order)."""
    keys = index_keys(out)
    return sorted(set(keys[::3] + keys[10:14]), reverse=True)


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(json.dumps(state))
    return loaded


# --- select -------------------------------------------------------------------------------------


def test_select_by_keys_gives_exactly_those_records(packed: Path) -> None:
    whole = open_shards(packed, decode="bytes")
    wanted = picked(packed)
    ds = open_shards(packed, decode="bytes", select=wanted)
    assert len(ds) == len(wanted)
    got = list(ds)
    assert sorted(s.key for s in got) == sorted(wanted)
    stored_order = [k for k in index_keys(packed) if k in set(wanted)]
    assert [s.key for s in got] == stored_order  # the subset in stored order, unshuffled
    for sample in got:
        assert sample.image == whole.get(sample.key).image
    assert [ds[i].key for i in range(len(ds))] == stored_order
    assert ds[-1].key == stored_order[-1]
    assert ds.get(wanted[0]).image == whole.get(wanted[0]).image
    assert len(open_shards(packed, select=set(wanted))) == len(wanted)  # a set of keys too
    with pytest.raises(KeyError):
        ds.get(next(k for k in index_keys(packed) if k not in set(wanted)))


def test_select_by_expression_and_callable(packed: Path) -> None:
    whole = {s.key: s for s in open_shards(packed)}
    small = {k for k, s in whole.items() if s.label is not None and s.label < 2}
    by_expression = list(open_shards(packed, select=pc.field("label") < 2))
    assert {s.key for s in by_expression} == small and len(by_expression) == len(small)
    for sample in by_expression:
        assert np.array_equal(sample.image, whole[sample.key].image)
    by_mask = open_shards(packed, select=lambda t: pc.less(t.column("label"), 2))
    assert {s.key for s in by_mask} == small
    by_table = open_shards(packed, select=lambda t: t.filter(pc.field("label") < 2))
    assert {s.key for s in by_table} == small
    by_list = open_shards(packed, select=lambda t: [label < 2 for label in t.column("label").to_pylist()])
    assert len(by_list) == len(small)


def test_shuffle_ranks_and_epochs_cover_exactly_the_subset(packed: Path) -> None:
    wanted = picked(packed)
    for epoch in (0, 1):
        ds = open_shards(packed, decode="bytes", select=wanted, **SHUFFLED)
        ds.set_epoch(epoch)
        keys = [s.key for s in ds]
        assert Counter(keys) == Counter(wanted)
    per_rank = []
    for rank in (0, 1):
        ds = open_shards(packed, decode="bytes", select=wanted, rank=rank, world_size=2, drop_last=True, **SHUFFLED)
        per_rank.append([s.key for s in ds])
    assert len(per_rank[0]) == len(per_rank[1]) == len(wanted) // 2
    assert not set(per_rank[0]) & set(per_rank[1])
    assert set(per_rank[0]) | set(per_rank[1]) <= set(wanted)


def test_torch_workers_split_the_subset(tar: Path) -> None:
    torch = pytest.importorskip("torch")
    wanted = picked(tar)
    iterable = open_shards(tar, decode="bytes", select=wanted, **SHUFFLED).iterable()
    loader = torch.utils.data.DataLoader(iterable, batch_size=None, num_workers=2, collate_fn=lambda s: s.key)
    assert Counter(loader) == Counter(wanted)


def test_loader_resumes_mid_epoch_exactly(packed: Path) -> None:
    wanted = picked(packed)

    def loader() -> Any:
        return open_shards(packed, select=wanted, **SHUFFLED).loader(4, 16, output="numpy", workers=2)

    whole = [k for batch in loader() for k in batch.keys]
    assert Counter(whole) == Counter(wanted)
    first = loader()
    seen: list[str] = []
    for step, batch in enumerate(first):
        seen += batch.keys
        if step == 2:
            state = roundtrip(first.state_dict())
            break
    assert state["selection"]
    again = loader()
    again.load_state_dict(state)
    seen += [k for batch in again for k in batch.keys]
    assert seen == whole


def test_a_state_resumes_only_its_own_selection(tar: Path) -> None:
    keys = index_keys(tar)
    one, other = keys[:20], keys[20:40]  # same size, other records
    state = roundtrip(open_shards(tar, select=one).loader(4, 16, output="numpy").state_dict())
    for select in (other, None):
        loader = open_shards(tar, select=select).loader(4, 16, output="numpy")
        with pytest.raises(ConfigError, match="a state resumes its own subset") as caught:
            loader.load_state_dict(state)
        assert "\n" not in str(caught.value)
    whole_state = roundtrip(open_shards(tar).loader(4, 16, output="numpy").state_dict())
    assert "selection" not in whole_state  # states of whole outputs are as they were


def test_select_refusals_are_one_line(tar: Path) -> None:
    keys = index_keys(tar)
    cases: list[tuple[Any, str]] = [
        ([*keys[:2], "nope-1", "nope-2", "nope-3", "nope-4"], "4 keys not in the output: 'nope-1', 'nope-2', 'nope-3'"),
        ([], "select keeps no record"),
        ([keys[0], keys[1], keys[0], keys[0]], f"select: 1 key named more than once: {keys[0]!r} 3 times;"),
        (lambda t: t.select(["key"]).take([0, 0]), f"select: 1 key named more than once: {keys[0]!r} 2 times;"),
        (pc.field("label") > 10**6, "select keeps no record"),
        (pc.field("no_such_column") > 1, "select: the index has no column 'no_such_column' (it has key, shard, "),
        (pc.field("label") == pc.field("key"), "select: "),  # another of pyarrow's refusals (types), its first line
        ("one-key", "select must be a list of keys"),
        ([keys[0], 7], "select: keys are text; 7 is a int"),
        (lambda t: [True], "the callable must return"),
    ]  # fmt: skip
    for select, message in cases:
        with pytest.raises(ConfigError) as caught:
            open_shards(tar, select=select)
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)


def test_a_changed_index_is_not_trusted(tar: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "out"
    shutil.copytree(tar, copy)
    table = pq.read_table(copy / "index.parquet")
    pq.write_table(table.slice(1), copy / "index.parquet")
    with pytest.raises(Exception, match="differs from the manifest") as caught:
        open_shards(copy, select=index_keys(tar)[:3])
    assert "\n" not in str(caught.value)


def test_scattered_positions_are_read_as_several_ranges(packed: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shardkit.readers.subset as subset

    monkeypatch.setattr(subset, "GAP", 0)  # every gap starts a new range: reads skip between ranges
    whole = open_shards(packed, decode="bytes")
    wanted = picked(packed)
    got = {s.key: s.image for s in open_shards(packed, decode="bytes", select=wanted, **SHUFFLED)}
    assert set(got) == set(wanted)
    assert all(image == whole.get(key).image for key, image in got.items())


def test_runs_read_nearby_positions_as_one_range() -> None:
    kept = np.array([0, 1, 2, 5, 40, 41, 100])
    assert list(runs(kept, gap=4)) == [(0, 6, 0, 4), (40, 42, 4, 6), (100, 101, 6, 7)]
    assert list(runs(np.array([], np.int64))) == []


def test_a_mix_filters_each_output_and_refuses_keys(tar: Path, packed_sample: Any) -> None:
    other = packed_sample("lmdb", 32, 7)
    mix = open_shards([tar, other], select=pc.field("label") == 1, length=40, seed=3)
    labels = {s.label for s in mix}
    assert labels == {1}
    for kwargs in ({"select": index_keys(tar)[:3]}, {"join": pa.table({"key": ["a"], "x": [1]})}):
        with pytest.raises(ConfigError, match="a mix takes select as a filter"):
            open_shards([tar, other], **kwargs)


# --- join ---------------------------------------------------------------------------------------


def scores(out: Path, every: int = 2) -> pa.Table:
    keys = index_keys(out)[::every]
    return pa.table(
        {"key": keys, "score": [float(i) for i in range(len(keys))], "tag": [f"t{i}" for i in range(len(keys))]}
    )


def test_join_adds_columns_everywhere(packed: Path) -> None:
    table = scores(packed)
    expected = {
        k: (s, t) for k, s, t in zip(*(table.column(n).to_pylist() for n in ("key", "score", "tag")), strict=True)
    }
    ds = open_shards(packed, decode="bytes", join=table)
    for sample in ds:
        assert sample.fields == (
            {"score": expected[sample.key][0], "tag": expected[sample.key][1]}
            if sample.key in expected
            else {"score": None, "tag": None}
        )
    key = table.column("key")[3].as_py()
    assert ds.get(key).fields["score"] == 3.0
    assert ds[0].fields["score"] == 0.0
    for batch in ds.loader(8, 16, output="numpy", workers=2):
        for key, fields in zip(batch.keys, batch.fields, strict=True):
            assert fields["score"] == (expected[key][0] if key in expected else None)


def test_join_reads_parquet_csv_and_jsonl_and_works_with_select(tar: Path, tmp_path: Path) -> None:
    table = scores(tar, every=3)
    keys = table.column("key").to_pylist()
    pq.write_table(table, tmp_path / "t.parquet")
    (tmp_path / "t.csv").write_text("key,score,tag\n" + "".join(f"{k},{i}.5,0{i}\n" for i, k in enumerate(keys)))
    (tmp_path / "t.jsonl").write_text(
        "".join(json.dumps({"key": k, "score": i + 0.5, "tag": f"0{i}"}) + "\n" for i, k in enumerate(keys))
    )
    for name in ("t.parquet", "t.csv", "t.jsonl"):
        ds = open_shards(tar, decode="bytes", select=keys[1:5], join=tmp_path / name)
        got = {s.key: s.fields for s in ds}
        assert set(got) == set(keys[1:5])
        assert got[keys[2]]["score"] in (2.0, 2.5)
        # a JSON string stays text; CSV's types are pyarrow's inference (only the key is always text)
        assert got[keys[2]]["tag"] == {"t.parquet": "t2", "t.csv": 2, "t.jsonl": "02"}[name]


def test_join_refusals_are_one_line(tar: Path, tmp_path: Path) -> None:
    keys = index_keys(tar)
    (tmp_path / "t.txt").write_text("key\n")
    cases: list[tuple[Any, str]] = [
        (pa.table({"key": [keys[0], keys[1], keys[0]], "x": [1, 2, 3]}), "1 keys appear more than once in the table: "),
        (pa.table({"key": [keys[0], "ghost", "ghost2"], "x": [1, 2, 3]}), "2 keys of the table are not in"),
        (pa.table({"key": keys[:2], "label": [1, 2]}), "the table's column 'label' is a stored column"),
        (pa.table({"key": keys[:2], "width": [1, 2]}), "'width' is a stored column"),
        (pa.table({"name": keys[:2], "x": [1, 2]}), "no 'key' column"),
        (pa.table({"key": keys[:2]}), "no column besides 'key'"),
        (tmp_path / "t.txt", "a table must be parquet, CSV or JSONL"),
        (tmp_path / "missing.parquet", "missing.parquet: no such file or folder"),
        (42, "join must be a table's path or a pyarrow Table"),
    ]  # fmt: skip
    for join, message in cases:
        with pytest.raises(ConfigError) as caught:
            open_shards(tar, join=join)
        assert message in str(caught.value)
        assert "\n" not in str(caught.value)


# --- a remote output ----------------------------------------------------------------------------


def _served(folder: Path) -> Iterator[str]:
    from http.server import SimpleHTTPRequestHandler

    from tests.servers import serving

    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, directory=str(folder), **kwargs)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as url:
        yield url


def test_a_remote_output_selects_and_joins_through_its_fetched_index(tar: Path, tmp_path: Path) -> None:
    wanted = picked(tar)
    table = scores(tar)
    local = {s.key: s for s in open_shards(tar, decode="bytes", select=wanted, join=table)}
    for url in _served(tar):
        remote = open_shards(url, decode="bytes", select=wanted, join=table, cache_dir=tmp_path / "cache", **SHUFFLED)
        got = list(remote)
        assert Counter(s.key for s in got) == Counter(wanted)
        for sample in got:
            assert sample.image == local[sample.key].image and sample.fields == local[sample.key].fields


# --- kill -9 anywhere ---------------------------------------------------------------------------

TRAIN = """
import json, os, sys, time
import pyarrow as pa
from shardkit.readers import open_shards
out, checkpoint, keys_file = sys.argv[1:]
wanted = json.load(open(keys_file))
join = pa.table({"key": wanted, "rank": list(range(len(wanted)))})
ds = open_shards(out, shuffle=True, seed=7, shuffle_buffer=8, select=wanted, join=join)
loader = ds.loader(4, 16, output="numpy", workers=2)
seen = []
if os.path.exists(checkpoint):
    with open(checkpoint) as file:
        saved = json.load(file)
    loader.load_state_dict(saved["state"])
    seen = saved["seen"]
for batch in loader:
    assert all(f["rank"] == wanted.index(k) for k, f in zip(batch.keys, batch.fields))
    seen += batch.keys
    with open(checkpoint + ".tmp", "w") as file:
        json.dump({"state": loader.state_dict(), "seen": seen}, file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(checkpoint + ".tmp", checkpoint)
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_a_loop_over_a_subset_killed_anywhere_resumes_exactly(tar: Path, tmp_path: Path) -> None:
    wanted = picked(tar)
    script, checkpoint, keys_file = tmp_path / "train.py", tmp_path / "checkpoint.json", tmp_path / "keys.json"
    script.write_text(TRAIN)
    keys_file.write_text(json.dumps(wanted))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    run_killing([sys.executable, str(script), str(tar), str(checkpoint), str(keys_file)], checkpoint, 2, 34, 0.08, env)
    seen = json.loads(checkpoint.read_text())["seen"]
    assert Counter(seen) == Counter(wanted)  # the subset, each record exactly once

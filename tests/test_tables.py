"""Samples from a metadata table (captions, labels, any columns): packed into every format, read
back by open_shards, the loader and stock readers, with every bad row accounted for."""

from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

import pytest

from shardkit import PackConfig, ResizeConfig, pack
from shardkit.core.config import TableConfig
from shardkit.core.errors import SourceError
from shardkit.core.manifest import read_manifest
from shardkit.readers import open_shards
from shardkit.synthetic import write_image
from tests.conftest import IMAGENET_SAMPLE
from tests.helpers import read_errors

FORMATS = ("webdataset", "lmdb", "hdf5")

# Captions as people write them: scripts, right-to-left, emoji, empty, several lines, several captions.
ROWS = [
    {"file_name": "a/0.jpg", "caption": "一只猫坐在窗台上", "label": "cat", "boxes": [[10.5, 20, 30, 40]]},
    {"file_name": "a/1.jpg", "caption": "قطة تجلس على النافذة", "label": "cat", "width": 7, "source": "web"},
    {"file_name": "b/2.jpg", "caption": "🐈‍⬛ on a 🪟", "label": "dog", "tags": ["x", "y"], "extra": None},
    {"file_name": "b/3.jpg", "caption": "", "label": "dog", "iscrowd": 0},
    {"file_name": "4.jpg", "caption": "line one\nline two\r\n\ttabbed", "label": "cat"},
    {"file_name": "5.jpg", "caption": ["first of five", "второй", "", "4", "five"], "label": "dog", "n": 5},
    {"file_name": "c/6.jpg", "caption": "x" * 20000, "label": "cat", "nested": {"a": {"b": [1, 2.5, True]}}},
    {"file_name": "c/7.jpg", "label": "dog"},  # no caption at all: text None
]


def _images(root: Path, names: list[str]) -> None:
    """Real photos when ../shared is here, generated ones otherwise."""
    photos = sorted(IMAGENET_SAMPLE.rglob("*.JPEG"))[: len(names)] if IMAGENET_SAMPLE.is_dir() else []
    for i, name in enumerate(names):
        target = root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if i < len(photos):
            shutil.copyfile(photos[i], target)
        else:
            write_image(target, 160 + i, 120 + i, seed=i)  # larger than the 64 the tests resize to


def write_table(path: Path, rows: list[dict]) -> None:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        names = list(dict.fromkeys(name for row in rows for name in row))  # from_pylist reads the first row's
        pq.write_table(pa.Table.from_pylist([{name: row.get(name) for name in names} for row in rows]), path)
    else:
        names = list(dict.fromkeys(name for row in rows for name in row))
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, names, delimiter="\t" if path.suffix == ".tsv" else ",")
            writer.writeheader()
            writer.writerows({name: row.get(name, "") for name in names} for row in rows)


@pytest.fixture(scope="module")
def captioned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("captioned") / "src"
    _images(root, [row["file_name"] for row in ROWS])
    write_table(root / "metadata.jsonl", ROWS)
    return root


def _pack(source: Path, output: Path, **options) -> None:
    table = options.pop("table", TableConfig(label_column="label"))
    pack(PackConfig(str(source), str(output), resize=ResizeConfig(size=64), shard_size=3, table=table, **options))


def _expected(row: dict) -> tuple[object, dict]:
    return row.get("caption"), {k: v for k, v in row.items() if k not in ("file_name", "caption", "label")}


@pytest.mark.parametrize("format", FORMATS)
def test_captions_and_columns_round_trip_in_every_format(captioned: Path, tmp_path: Path, format: str) -> None:
    _pack(captioned, tmp_path / "out", format=format)
    assert read_errors(tmp_path / "out") == []
    dataset = open_shards(tmp_path / "out")
    assert dataset.classes == ["cat", "dog"]
    by_source = {sample.meta["source"]: sample for sample in dataset}
    assert sorted(by_source) == sorted(row["file_name"] for row in ROWS)
    for row in ROWS:
        sample = by_source[row["file_name"]]
        text, fields = _expected(row)
        assert sample.text == text and type(sample.text) is type(text)
        assert sample.fields == fields
        assert sample.label == dataset.classes.index(row["label"])
        assert sample.image.shape[2] == 3 and min(sample.image.shape[:2]) == 64
        # shardkit's own metadata stays its own: the user's `width` and `source` live in fields
        assert sample.meta["stored_width"] == sample.image.shape[1] and sample.meta["source"] == row["file_name"]
    assert dataset.get(dataset[0].key).text == dataset[0].text  # random access too


def test_a_parquet_table_gives_the_samples_a_jsonl_table_gives(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    rows = [row for row in ROWS if not isinstance(row.get("caption"), list)]  # parquet: one type a column
    samples = {}
    for suffix in (".jsonl", ".parquet"):
        source = tmp_path / suffix[1:]
        _images(source, [row["file_name"] for row in rows])
        write_table(source / f"metadata{suffix}", rows)
        _pack(source, tmp_path / f"out{suffix}")
        samples[suffix] = {s.meta["source"]: s for s in open_shards(tmp_path / f"out{suffix}", decode="bytes")}
    assert sorted(samples[".jsonl"]) == sorted(samples[".parquet"]) == sorted(row["file_name"] for row in rows)
    for source, sample in samples[".jsonl"].items():
        twin = samples[".parquet"][source]
        assert (twin.text, twin.label) == (sample.text, sample.label)
        # parquet has one schema: a column a row lacks is null there (JSONL leaves it out)
        assert {k: v for k, v in twin.fields.items() if v is not None} == {
            k: v for k, v in sample.fields.items() if v is not None
        }


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_csv_and_tsv_tables_keep_text_exactly(tmp_path: Path, suffix: str) -> None:
    rows = [{k: v for k, v in row.items() if isinstance(v, str)} for row in ROWS]
    source = tmp_path / "src"
    _images(source, [row["file_name"] for row in rows])
    write_table(source / f"metadata{suffix}", rows)
    _pack(source, tmp_path / "out", table=TableConfig(path=str(source / f"metadata{suffix}"), label_column="label"))
    got = {s.meta["source"]: (s.text, s.fields) for s in open_shards(tmp_path / "out", decode="bytes")}
    for row in rows:
        assert got[row["file_name"]] == (row.get("caption", ""), {"source": row.get("source", "")})


def test_any_table_with_named_columns(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _images(source, ["p/0.jpg", "p/1.jpg", "p/2.jpg"])
    table = tmp_path / "elsewhere.jsonl"
    write_table(
        table, [{"img": f"p/{i}.jpg", "alt": f"text {i}", "cls": i, "a": i, "b": -i, "c": "x"} for i in range(3)]
    )
    config = TableConfig(path=str(table), path_column="img", caption_column="alt", label_column="cls", columns=("b",))
    _pack(source, tmp_path / "out", table=config)
    samples = sorted(open_shards(tmp_path / "out", decode="bytes"), key=lambda s: s.meta["source"])
    assert [(s.text, s.label, s.fields) for s in samples] == [(f"text {i}", i, {"b": -i}) for i in range(3)]


def test_the_same_bytes_whatever_the_workers(captioned: Path, tmp_path: Path) -> None:
    _pack(captioned, tmp_path / "one", workers=1)
    _pack(captioned, tmp_path / "two", workers=2)
    one, two = read_manifest(tmp_path / "one"), read_manifest(tmp_path / "two")
    assert [(s.name, s.sha256) for s in one.shards] == [(s.name, s.sha256) for s in two.shards]


def test_a_changed_caption_is_packed_again_on_resume_and_overwrite(captioned: Path, tmp_path: Path) -> None:
    source = tmp_path / "src"
    shutil.copytree(captioned, source)
    _pack(source, tmp_path / "out")
    before = read_manifest(tmp_path / "out")
    write_table(
        source / "metadata.jsonl", [{**row, "caption": "changed"} if i == 0 else row for i, row in enumerate(ROWS)]
    )
    _pack(source, tmp_path / "out", overwrite=True)
    after = read_manifest(tmp_path / "out")
    assert before.shards[0].sha256 != after.shards[0].sha256
    assert [s.sha256 for s in before.shards[1:]] == [s.sha256 for s in after.shards[1:]]
    assert "changed" in [s.text for s in open_shards(tmp_path / "out", decode="bytes")]


def test_the_loader_batches_carry_texts_and_fields(captioned: Path, tmp_path: Path) -> None:
    _pack(captioned, tmp_path / "out")
    dataset = open_shards(tmp_path / "out")
    texts, fields, keys = [], [], []
    for batch in dataset.loader(batch_size=3, size=32, output="numpy"):
        assert len(batch.texts) == len(batch.fields) == len(batch.keys) == len(batch.images)
        texts += batch.texts
        fields += batch.fields
        keys += batch.keys
    by_key = {sample.key: sample for sample in dataset}
    assert texts == [by_key[key].text for key in keys] and fields == [by_key[key].fields for key in keys]


def test_stock_webdataset_reads_captions_and_columns(captioned: Path, tmp_path: Path) -> None:
    webdataset = pytest.importorskip("webdataset")
    _pack(captioned, tmp_path / "out")
    shards = [str(tmp_path / "out" / s.name) for s in read_manifest(tmp_path / "out").shards]
    ours = {s.key: s for s in open_shards(tmp_path / "out", decode="bytes")}
    seen = []
    for stock in webdataset.WebDataset(shards, shardshuffle=False):  # plain dicts of member bytes
        sample = ours[stock["__key__"]]
        assert json.loads(stock["json"])["source"] == sample.meta["source"]
        if sample.text is None:
            assert "txt" not in stock
        else:
            assert stock["txt"].decode() == (sample.text if isinstance(sample.text, str) else "\n".join(sample.text))
        assert json.loads(stock.get("columns.json", b"{}")) == sample.fields
        seen.append(stock["__key__"])
    assert sorted(seen) == sorted(ours)
    texts = webdataset.WebDataset(shards, shardshuffle=False).select(lambda s: "txt" in s).to_tuple("jpg", "txt")
    assert len(list(texts)) == sum(1 for s in ours.values() if s.text is not None)


def test_hugging_face_datasets_reads_our_tars(captioned: Path, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    _pack(captioned, tmp_path / "out")
    shards = [str(tmp_path / "out" / s.name) for s in read_manifest(tmp_path / "out").shards]
    loaded = datasets.load_dataset("webdataset", data_files={"train": shards}, split="train", cache_dir=str(tmp_path))
    ours = {s.key: s for s in open_shards(tmp_path / "out", decode="bytes")}
    assert sorted(loaded["__key__"]) == sorted(ours)
    for row in loaded:
        sample = ours[row["__key__"]]
        if sample.text is not None:
            assert row["txt"] == (sample.text if isinstance(sample.text, str) else "\n".join(sample.text))
        # datasets infers one schema from the first rows: a column only later rows have is left out
        for name, value in (row.get("columns.json") or {}).items():
            assert value is None or value == sample.fields[name]


def test_verify_checks_a_table_output_against_its_source(captioned: Path, tmp_path: Path) -> None:
    from shardkit.checks.verify import verify

    _pack(captioned, tmp_path / "out")
    report = verify(tmp_path / "out", deep=True, source=captioned)
    assert report.ok, report.problems
    assert report.records == len(ROWS)


def test_every_bad_row_is_an_error_with_its_line_and_nothing_outside_is_read(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _images(source, ["ok.jpg", "dup.jpg", "norow.jpg", "sub/big.jpg", "list.jpg", "neg.jpg"])
    outside = tmp_path / "secret.jpg"
    write_image(outside, 30, 30)
    os.symlink(outside, source / "link.jpg")
    lines = [
        json.dumps({"file_name": "ok.jpg", "caption": "fine", "label": 1}),
        json.dumps({"file_name": "../secret.jpg", "caption": "climbs out", "label": 1}),
        json.dumps({"file_name": str(outside), "caption": "absolute", "label": 1}),
        json.dumps({"file_name": "link.jpg", "caption": "links out", "label": 1}),
        json.dumps({"file_name": "missing.jpg", "caption": "no file", "label": 1}),
        json.dumps({"file_name": "dup.jpg", "caption": "first", "label": 1}),
        json.dumps({"file_name": "dup.jpg", "caption": "second", "label": 1}),
        '{"file_name": "x.jpg", "caption": broken',
        json.dumps({"file_name": "sub/big.jpg", "caption": "y" * (1 << 20), "label": 1}),
        json.dumps({"file_name": "list.jpg", "caption": {"not": "text"}, "label": 1}),
        json.dumps({"file_name": "neg.jpg", "caption": "negative", "label": -1}),
        json.dumps({"caption": "no path", "label": 1}),
        json.dumps(["not", "an", "object"]),
    ]
    table = source / "metadata.jsonl"
    table.write_bytes("\n".join(lines).encode() + b"\n" + b'{"file_name": "ok.jpg", "caption": "\xff"}\n')
    result = pack(
        PackConfig(
            str(source), str(tmp_path / "out"), resize=ResizeConfig(size=None), table=TableConfig(label_column="label")
        )
    )
    errors = read_errors(tmp_path / "out")
    reasons = {row["path"]: row["reason"] for row in errors}
    assert result.records == 2 and result.inputs == result.records + len(errors) == len(lines) + 1 + 1  # + norow.jpg
    assert "not a path inside the source folder" in reasons["../secret.jpg"]
    assert "not a path inside the source folder" in reasons[str(outside)]
    assert "outside the source folder" in reasons["link.jpg"]
    assert reasons["missing.jpg"] == "metadata.jsonl line 5: missing.jpg: no such file"  # its line, as the others
    assert reasons["metadata.jsonl line 7"] == "dup.jpg is named by an earlier row too"  # the path is its line
    assert reasons["metadata.jsonl line 8"].startswith("not valid JSON")
    assert "over the 1 MiB limit" in reasons["sub/big.jpg"]
    assert "not text or a list of texts" in reasons["list.jpg"]
    assert "negative" in reasons["neg.jpg"]
    assert reasons["metadata.jsonl line 12"] == "no path in column 'file_name'"
    assert reasons["metadata.jsonl line 13"] == "not a JSON object"
    assert reasons["metadata.jsonl line 14"] == "not UTF-8"
    assert reasons["norow.jpg"] == "no row in metadata.jsonl"
    assert {s.text for s in open_shards(tmp_path / "out", decode="bytes")} == {"fine", "first"}


def test_a_malformed_csv_line_is_an_error_row(tmp_path: Path) -> None:
    source = tmp_path / "src"
    _images(source, ["0.jpg", "1.jpg", "2.jpg"])
    (source / "metadata.csv").write_bytes(
        b'file_name,caption\n0.jpg,"fine, with a comma"\n1.jpg,too,many\n2.jpg,"\xff\xfe"\n'
    )
    result = pack(PackConfig(str(source), str(tmp_path / "out"), resize=ResizeConfig(size=None)))
    reasons = {row["path"]: row["reason"] for row in read_errors(tmp_path / "out")}
    assert result.records == 1 and [s.text for s in open_shards(tmp_path / "out", decode="bytes")] == [
        "fine, with a comma"
    ]
    assert reasons["metadata.csv line 3"] == "3 fields, the header has 2"  # the path names the line: said once
    assert reasons["metadata.csv line 4"] == "not UTF-8"
    assert reasons["1.jpg"] == reasons["2.jpg"] == "no row in metadata.csv"


def test_a_row_that_is_not_utf8_is_said_with_its_line_once(tmp_path: Path, shardkit) -> None:
    source = tmp_path / "src"
    _images(source, ["a.jpg"])
    (source / "metadata.csv").write_bytes(b"file_name,text\na.jpg,caf\xe9\n")
    done = shardkit("pack", source, tmp_path / "out")  # nothing packed: the first error row is said
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "none of the 2 inputs was packed; the first: metadata.csv line 2: not UTF-8 (each is in errors.jsonl)"
    ), done.stderr


@pytest.mark.parametrize(
    ("files", "config", "message"),
    [
        (
            {"metadata.jsonl": '{"path": "a.jpg"}\n'},
            TableConfig(),
            "no 'file_name' column (path); name it with --path-column",
        ),
        (
            {"metadata.jsonl": '{"file_name": "a.jpg"}\n', "metadata.csv": "file_name\na.jpg\n"},
            TableConfig(),
            "both present",
        ),
        ({"metadata.jsonl": '{"file_name": "a.jpg"}\n'}, TableConfig(caption_column="alt"), "no caption column 'alt'"),
        ({"metadata.jsonl": '{"file_name": "a.jpg"}\n'}, TableConfig(columns=("nope",)), "no column 'nope'"),
        ({"metadata.jsonl": "\n"}, TableConfig(), "the table has no rows"),
        ({"metadata.csv": ""}, TableConfig(), "empty table"),
        (
            {"metadata.jsonl": '{"file_name": "a.jpg", "label": "cat"}\n{"file_name": "a.jpg", "label": 3}\n'},
            TableConfig(label_column="label"),
            "mixes class names and numbers",
        ),
    ],
)
def test_a_table_that_cannot_be_used_is_refused_in_one_line(tmp_path: Path, files, config, message) -> None:
    source = tmp_path / "src"
    _images(source, ["a.jpg"])
    for name, text in files.items():
        (source / name).write_text(text)
    with pytest.raises(SourceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _pack(source, tmp_path / "out", table=config)
    assert not (tmp_path / "out").exists()


def test_a_parquet_column_of_an_unsupported_type_is_refused(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    source = tmp_path / "src"
    _images(source, ["a.jpg"])
    pq.write_table(
        pa.table({"file_name": ["a.jpg"], "blob": pa.array([b"\x00\x01"], pa.binary())}), source / "metadata.parquet"
    )
    with pytest.raises(SourceError, match="column 'blob' has type binary, which shardkit cannot store"):
        _pack(source, tmp_path / "out", table=TableConfig())


def test_the_cli_takes_the_table_flags_and_refuses_in_one_line(shardkit, captioned: Path, tmp_path: Path) -> None:
    command = ["pack", str(captioned), str(tmp_path / "out"), "--resize", "none"]
    done = shardkit(*command, "--label-column", "label", "--columns", "boxes,n")
    assert done.returncode == 0, done.stderr
    assert {tuple(s.fields) for s in open_shards(tmp_path / "out", decode="bytes")} == {(), ("boxes",), ("n",)}
    command[2] = str(tmp_path / "out2")
    bad = shardkit(*command, "--path-column", "img")
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "no 'img' column" in bad.stderr


@pytest.mark.parametrize("format", FORMATS)
def test_index_parquet_lists_every_record_and_verify_checks_it(captioned: Path, tmp_path: Path, format: str) -> None:
    import pyarrow.parquet as pq

    from shardkit.checks.verify import verify

    out = tmp_path / "out"
    _pack(captioned, out, format=format)
    manifest = read_manifest(out)
    assert manifest.index is not None and manifest.index.count == manifest.records == len(ROWS)
    table = pq.read_table(out / "index.parquet").to_pylist()
    samples = {s.key: s for s in open_shards(out, decode="bytes")}
    assert sorted(row["key"] for row in table) == sorted(samples)
    for row in table:
        sample = samples[row["key"]]
        assert (row["text"], row["texts"]) == (
            (sample.text, None) if not isinstance(sample.text, list) else (None, sample.text)
        )
        assert (json.loads(row["columns"]) if row["columns"] else {}) == sample.fields
        assert (row["label"], row["source"], row["stored_width"]) == (
            sample.label,
            sample.meta["source"],
            sample.meta["stored_width"],
        )
        reader_shard = [s.name for s in manifest.shards].index(row["shard"])
        assert (
            open_shards(out, decode="bytes")
            .shard_samples(reader_shard, row["position"], row["position"] + 1)
            .__next__()
            .key
            == row["key"]
        )
    assert verify(out).ok
    data = bytearray((out / "index.parquet").read_bytes())
    data[len(data) // 2] ^= 1
    (out / "index.parquet").write_bytes(bytes(data))
    assert {problem.kind for problem in verify(out).problems} == {"index"}


def test_an_output_from_before_the_index_still_verifies(captioned: Path, tmp_path: Path) -> None:
    from shardkit.checks.verify import verify
    from shardkit.core.manifest import write_json_atomic

    out = tmp_path / "out"
    _pack(captioned, out)
    old = read_manifest(out).__class__(**{**read_manifest(out).__dict__, "index": None, "checksum": ""}).sealed()
    assert "index" not in old.to_json()
    write_json_atomic(out / "manifest.json", old.to_json())
    (out / "index.parquet").unlink()
    assert verify(out).ok


def test_probe_reports_the_table(captioned: Path, tmp_path: Path) -> None:
    from shardkit.packing.probe import probe

    source = tmp_path / "src"
    shutil.copytree(captioned, source)
    write_image(source / "norow.jpg", 40, 30)
    rows = [*ROWS, {"file_name": "gone.jpg", "caption": "no file"}, {"file_name": "/abs.jpg"}]
    write_table(source / "metadata.jsonl", rows)
    report = probe(source)
    table = report.table
    assert table is not None and table["name"] == "metadata.jsonl"
    assert (table["rows"], table["rows_without_file"], table["images_without_row"], table["bad_rows"]) == (10, 1, 1, 1)
    assert table["columns"][:3] == ["file_name", "caption", "label"] and "nested" in table["columns"]
    lengths = sorted(
        len(c) for row in rows
        if "caption" in row and "/" not in row["file_name"][:1] and row["file_name"] != "gone.jpg"
        for c in ([row["caption"]] if isinstance(row["caption"], str) else row["caption"])
    )  # fmt: skip
    assert table["captions"] == len(lengths) and table["caption_chars"]["max"] == lengths[-1] == 20000
    assert table["caption_chars"]["min"] == 0 and report.images == len(ROWS)


def test_a_dataloader_batches_samples_with_and_without_captions(captioned: Path, tmp_path: Path) -> None:
    """torch's default_collate refuses None: samples collate with their texts and fields as lists."""
    torch = pytest.importorskip("torch")
    resize = ResizeConfig(size=32, mode="center-crop")
    pack(PackConfig(str(captioned), str(tmp_path / "out"), resize=resize, table=TableConfig(label_column="label")))
    dataset = open_shards(tmp_path / "out")
    batches = list(torch.utils.data.DataLoader(dataset, batch_size=3, num_workers=2))
    assert [len(batch.text) for batch in batches] == [3, 3, 2]
    assert [text for batch in batches for text in batch.text] == [sample.text for sample in dataset]
    assert [fields for batch in batches for fields in batch.fields] == [sample.fields for sample in dataset]
    assert batches[0].image.shape == (3, 32, 32, 3) and batches[0].label.dtype == torch.int64


def test_the_probe_cli_takes_a_table_from_elsewhere(shardkit, tmp_path: Path) -> None:
    source = tmp_path / "src"
    _images(source, ["a.jpg", "b.jpg"])
    table = tmp_path / "rows.csv"
    write_table(table, [{"img": "a.jpg", "alt": "first"}, {"img": "gone.jpg", "alt": "second one"}])
    done = shardkit("probe", source, "--metadata", table, "--path-column", "img", "--caption-column", "alt",
                    "--json", tmp_path / "report.json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    census = json.loads((tmp_path / "report.json").read_text())["table"]
    assert (census["name"], census["rows"], census["rows_without_file"], census["images_without_row"]) == (
        "rows.csv", 2, 1, 1,
    )  # fmt: skip
    # the captions of the rows that name a file (a row naming none is said at its line, not counted)
    assert census["columns"] == ["img", "alt"] and census["caption_chars"]["max"] == len("first")
    assert "rows.csv: 2 rows, 1 without a file" in done.stdout


@pytest.mark.parametrize("format", ["webdataset", "hdf5"])
@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_label_past_int64_is_an_error_row_and_the_pack_finishes(tmp_path: Path, format: str, suffix: str) -> None:
    """Labels are int64 in every format and in index.parquet: one past it failed the pack after its
    shards were written (no manifest, and --resume ended the same way). It is an error row, by the
    label rule every source shares (a whole number from 0 to 2**63-1)."""
    source = tmp_path / "src"
    _images(source, ["0.jpg", "1.jpg", "2.jpg", "3.jpg"])
    big = 99999999999999999999
    labels = [1, big, 2**63 - 1, "9" * 5000] if suffix == ".csv" else [1, big, 2**63 - 1, 2**63]
    write_table(source / f"metadata{suffix}", [{"file_name": f"{i}.jpg", "y": y} for i, y in enumerate(labels)])
    result = pack(
        PackConfig(str(source), str(tmp_path / "out"), format=format, resize=ResizeConfig(size=None),
                   table=TableConfig(label_column="y"))
    )  # fmt: skip
    reasons = {row["path"]: row["reason"] for row in read_errors(tmp_path / "out")}
    assert (result.records, result.inputs) == (2, 4)
    first = 2 if suffix == ".csv" else 1  # the line of the first row (a CSV's header is line 1)
    assert reasons["1.jpg"] == f"metadata{suffix} line {first + 1}: label {big} is over 2**63-1, the largest (int64)"
    assert f"metadata{suffix} line {first + 3}: label " in reasons["3.jpg"] and "over 2**63-1" in reasons["3.jpg"]
    assert sorted(s.label for s in open_shards(tmp_path / "out", decode="bytes")) == [1, 2**63 - 1]


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_a_byte_order_mark_is_read_as_pyarrow_pandas_and_hugging_face_read_it(tmp_path: Path, suffix: str) -> None:
    """Excel's "CSV UTF-8" starts with a byte-order mark: the CSV's first column was '\\ufefffile_name'
    (the table refused), a JSONL's first row was lost. A mark at the start is not part of the text."""
    source = tmp_path / "src"
    _images(source, ["0.jpg", "1.jpg"])
    table = source / f"metadata{suffix}"
    write_table(table, [{"file_name": "0.jpg", "caption": "zero"}, {"file_name": "1.jpg", "caption": "one"}])
    table.write_bytes(b"\xef\xbb\xbf" + table.read_bytes())
    config = TableConfig(path=str(table))  # (a .tsv is not picked up by name)
    result = pack(PackConfig(str(source), str(tmp_path / "out"), resize=ResizeConfig(size=None), table=config))
    assert (result.records, result.errors) == (2, 0), read_errors(tmp_path / "out")
    assert [s.text for s in open_shards(tmp_path / "out", decode="bytes")] == ["zero", "one"]


def test_a_parquet_s_left_out_columns_are_not_checked_and_categoricals_are_text(tmp_path: Path) -> None:
    """pandas writes a categorical as a dictionary column and a datetime as a timestamp: `--columns
    score` refused the pack, naming a column it was told to leave out. Only the columns kept are
    checked (and read); a categorical of strings is text, as its values read."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    source = tmp_path / "src"
    _images(source, ["0.jpg", "1.jpg"])
    table = pa.table(
        {
            "file_name": ["0.jpg", "1.jpg"],
            "score": [0.5, 0.25],
            "kind": pa.array(["cat", "dog"]).dictionary_encode(),
            "when": pa.array([0, 253402300800 * 10**6], pa.timestamp("us")),  # the year 10000: no datetime holds it
        }
    )
    pq.write_table(table, source / "metadata.parquet")
    configs = {"score": TableConfig(columns=("score",)), "kind": TableConfig(label_column="kind", columns=("score",))}
    for name, config in configs.items():
        out = tmp_path / name
        _pack(source, out, table=config)
        samples = list(open_shards(out, decode="bytes"))
        assert len(samples) == 2 and not read_errors(out)
        if name == "score":
            assert [s.fields for s in samples] == [{"score": 0.5}, {"score": 0.25}]
        else:
            assert read_manifest(out).classes == ["cat", "dog"] and [s.label for s in samples] == [0, 1]
    with pytest.raises(SourceError, match="column 'when' has type timestamp"):
        _pack(source, tmp_path / "all", table=TableConfig(columns=("score", "when")))
    out = tmp_path / "kinds"
    _pack(source, out, table=TableConfig(columns=("kind",)))
    assert [s.fields for s in open_shards(out, decode="bytes")] == [{"kind": "cat"}, {"kind": "dog"}]


def test_a_file_named_twice_through_a_linked_folder_is_one_file(tmp_path: Path) -> None:
    """`a/self` links to `../a`: `a/in.jpg`, `a/self/in.jpg` and `a/self/self/in.jpg` are one file,
    packed three times with no error row. The later rows are left out as for two spellings of one
    path; and a file a row names only through the link has its row (it was also "no row")."""
    source = tmp_path / "src"
    _images(source, ["a/in.jpg", "a/other.jpg", "b/x.jpg"])
    os.symlink("../a", source / "a" / "self")
    os.symlink("b", source / "z")  # a link sorted after its folder: the walk lists b/x.jpg
    rows = ["a/in.jpg", "a/self/in.jpg", "a/self/self/in.jpg", "a/self/other.jpg", "z/x.jpg"]
    write_table(source / "metadata.jsonl", [{"file_name": name, "caption": name} for name in rows])
    result = pack(PackConfig(str(source), str(tmp_path / "out"), resize=ResizeConfig(size=None)))
    reasons = {row["path"]: row["reason"] for row in read_errors(tmp_path / "out")}
    assert sorted(s.text for s in open_shards(tmp_path / "out", decode="bytes")) == [
        "a/in.jpg", "a/self/other.jpg", "z/x.jpg"
    ]  # fmt: skip
    assert reasons == {
        "metadata.jsonl line 2": "a/self/in.jpg is named by an earlier row too",
        "metadata.jsonl line 3": "a/self/self/in.jpg is named by an earlier row too",
    }
    assert result.inputs == result.records + result.errors == 5

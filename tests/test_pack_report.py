"""Nothing silent: what probe and pack say they chose. How the samples are labelled (every source
convention) and the folder layouts that label otherwise than meant (files at two depths, class
folders holding sub-folders); transparency flattened onto --background and pictures that came out
a single colour, counted in the summary, the manifest's totals and --json; the videos' plot; a
Hugging Face `captions` list column taken as the captions."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shardkit.checks.verify import verify
from shardkit.core.config import EncodeConfig, PackConfig, TableConfig
from shardkit.core.manifest import read_manifest, write_json_atomic
from shardkit.core.pack_options import pack_config
from shardkit.packing.pack import pack
from shardkit.packing.sources import walk
from shardkit.readers import open_shards
from shardkit.synthetic import write_image

TWO_DEPTHS = "image files sit at two depths: large/0.jpg in a class folder, imagenet/n01/0.jpg in a sub-folder of one"


def _nested(root: Path) -> Path:
    """imagenet/<3 class folders>/ beside large/*.jpg: packed as 2 classes, imagenet and large."""
    for number, name in enumerate(("n01", "n02", "n03")):
        for index in range(2):
            write_image(root / "imagenet" / name / f"{index}.jpg", 24, 16, seed=10 * number + index)
    for index in range(2):
        write_image(root / "large" / f"{index}.jpg", 24, 16, seed=100 + index)
    return root


def test_probe_and_pack_say_the_classes_and_warn_of_files_at_two_depths(shardkit, tmp_path: Path) -> None:
    source = _nested(tmp_path / "src")
    result = shardkit("probe", source, "--json", tmp_path / "probe.json", "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "labels: 2 classes from folder names: imagenet, large\n" in result.stdout
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {TWO_DEPTHS}")
    assert "everything below imagenet/ is class 'imagenet'" in warned[0]
    probed = json.loads((tmp_path / "probe.json").read_text())
    assert probed["labels"] == {
        "origin": "folders", "classes": 2, "said": "2 classes from folder names: imagenet, large",
        "warnings": [warned[0].removeprefix("warning: ")],
    }  # fmt: skip
    assert probed["warnings"] == probed["labels"]["warnings"]

    result = shardkit("pack", source, tmp_path / "out", "--workers", "1", "--json", tmp_path / "pack.json")
    assert result.returncode == 0, result.stderr
    assert "2 classes from folder names: imagenet, large" in result.stdout
    assert [line for line in result.stdout.splitlines() if line.startswith("warning: ")] == warned
    packed = json.loads((tmp_path / "pack.json").read_text())
    assert packed["labels"] == probed["labels"] and packed["warnings"] == probed["warnings"]


def test_class_folders_holding_sub_folders_and_a_flat_folder_with_sub_folders_warn(tmp_path: Path) -> None:
    for split in ("train", "val"):  # a folder of splits given as a folder of classes
        for name in ("cat", "dog"):
            write_image(tmp_path / "splits" / split / name / "0.jpg", 16, 16)
    said = labelling(_walked(tmp_path / "splits"))
    assert said.said == "2 classes from folder names: train, val"
    assert said.warnings == [
        "class folders hold sub-folders (e.g. train/cat/0.jpg); a class is a top-level folder, so everything "
        "below train/ is class 'train'"
    ]
    write_image(tmp_path / "flat" / "a.jpg", 16, 16)
    write_image(tmp_path / "flat" / "cats" / "b.jpg", 16, 16)
    flat = labelling(_walked(tmp_path / "flat"))
    assert flat.said == "unlabelled (image files at the top level: no class folders)"
    assert flat.warnings == [
        "image files sit at two depths: a.jpg at the top level, cats/b.jpg in a sub-folder; with files at the top "
        "level no sub-folder is a class, so none is labelled"
    ]
    assert labelling(_walked(tmp_path / "flat", "none"), "none").warnings == []  # (asked for: nothing to warn of)


def test_loose_files_and_an_empty_class_folder_are_unlabelled_without_a_warning(shardkit, tmp_path: Path) -> None:
    source = tmp_path / "src"
    write_image(source / "a.jpg", 16, 16)
    write_image(source / "b.png", 16, 16)
    (source / "empty").mkdir()
    result = shardkit("probe", source, "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert "labels: unlabelled (image files at the top level: no class folders)" in result.stdout
    assert "warning" not in result.stdout
    packed = pack(PackConfig(str(source), str(tmp_path / "out"), workers=1))
    assert packed.labels is not None and (packed.labels.origin, packed.labels.warnings) == ("none", [])
    assert packed.warnings == []


def _walked(source: Path, labels: str = "auto", **options: object):  # type: ignore[no-untyped-def]
    found = walk(source, labels, **options)  # type: ignore[arg-type]
    for _ in found.items:  # (what it says is complete once the walk is taken)
        pass
    return found


def labelling(found, labels: str = "auto"):  # type: ignore[no-untyped-def]
    from shardkit.packing.sources.labelling import labelling as said

    return said(found, labels)


def test_each_source_convention_says_how_it_labels(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write_image(tmp_path / "pics" / f"{name}.jpg", 16, 16)
    lists = {"names.txt": "pics/a.jpg,cat\npics/b.jpg,dog\n", "numbers.txt": "pics/a.jpg,3\npics/b.jpg,7\n",
             "bare.txt": "pics/a.jpg\npics/b.jpg\n"}  # fmt: skip
    for name, text in lists.items():
        (tmp_path / name).write_text(text)
    assert labelling(_walked(tmp_path / "names.txt")).said == "2 classes from the list's labels: cat, dog"
    assert labelling(_walked(tmp_path / "numbers.txt")).said == "labels from the list file (whole numbers)"
    assert labelling(_walked(tmp_path / "bare.txt")).said == "unlabelled (the list's lines have no label)"

    table = tmp_path / "table"
    for index in range(7):
        write_image(table / f"{index}.jpg", 16, 16)
    rows = [{"file_name": f"{index}.jpg", "species": f"s{index}"} for index in range(7)]
    (table / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    named = labelling(_walked(table, table=TableConfig(label_column="species")))
    assert (named.origin, named.classes) == ("column", 7)
    assert named.said == "7 classes from column 'species': s0, s1, s2, ..., s6"
    assert labelling(_walked(table)).said == "unlabelled (no label column: name one with --label-column)"
    off = labelling(_walked(table, "none", table=TableConfig(label_column="species")), "none")
    assert off.said == "unlabelled (--labels none: column 'species' not read)"

    scans = tmp_path / "scans"
    for index in range(3):
        write_image(scans / f"{index}.jpg", 16, 16)
    (scans / "0.cls").write_text("4")
    assert labelling(_walked(scans, sidecars=True)).said == "labels from x.cls sidecars (1 of 3 samples have one)"
    (scans / "0.cls").unlink()
    assert labelling(_walked(scans, sidecars=True)).said == "unlabelled (no sample has an x.cls sidecar)"


def test_a_table_packs_with_its_label_column_said(tmp_path: Path) -> None:
    source = tmp_path / "src"
    for index in range(4):
        write_image(source / f"{index}.jpg", 16, 16, seed=index)
    rows = [{"file_name": f"{index}.jpg", "kind": "odd" if index % 2 else "even"} for index in range(4)]
    (source / "metadata.csv").write_text("file_name,kind\n" + "".join(f"{r['file_name']},{r['kind']}\n" for r in rows))
    config = pack_config(source, tmp_path / "out", workers=1, table=TableConfig(label_column="kind"))
    result = pack(config)
    assert result.labels is not None and result.labels.said == "2 classes from column 'kind': even, odd"
    assert result.to_json()["labels"]["origin"] == "column"


# --- transparency and single-coloured pictures ------------------------------------------------


def _alpha_folder(root: Path) -> Path:
    """Pictures with and without transparency, named by what they are."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    white_on_clear = np.zeros((32, 32, 4), np.uint8)
    white_on_clear[..., :3] = 255
    white_on_clear[8:24, 8:24, 3] = 255  # white artwork, transparent around it
    Image.fromarray(white_on_clear, "RGBA").save(root / "white_on_clear.png")
    half = rng.integers(0, 256, (32, 32, 4), dtype=np.uint8)
    half[:16, :, 3], half[16:, :, 3] = 0, 255
    Image.fromarray(half, "RGBA").save(root / "half_clear.png")
    opaque = rng.integers(0, 256, (32, 32, 4), dtype=np.uint8)
    opaque[..., 3] = 255  # an alpha channel with no transparency in it: not flattened
    Image.fromarray(opaque, "RGBA").save(root / "opaque_rgba.png")
    grey = np.zeros((20, 20, 2), np.uint8)
    grey[..., 0] = 255
    grey[5:15, 5:15, 1] = 200  # grey + alpha (LA): white, partly opaque in the middle
    Image.fromarray(grey, "LA").save(root / "grey_alpha.png")
    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([255, 255, 255, 0, 0, 0] + [0] * 762)
    palette.paste(1, (4, 4, 12, 12))  # black square; index 0 (white) transparent through tRNS
    palette.save(root / "palette_trns.png", transparency=0)
    Image.new("RGB", (1, 1), (10, 20, 30)).save(root / "one_pixel.png")  # one colour by nature: never counted
    write_image(root / "photo.jpg", 24, 16)
    return root


def test_flattened_and_single_coloured_pictures_are_counted_and_warned(shardkit, tmp_path: Path) -> None:
    source = _alpha_folder(tmp_path / "src")
    out = tmp_path / "out"
    result = shardkit("pack", source, out, "--workers", "1", "--json", tmp_path / "pack.json")
    assert result.returncode == 0, result.stderr
    # flattened: white_on_clear, half_clear, grey_alpha, palette_trns; on white, white_on_clear and
    # grey_alpha are white all over
    counts = {"alpha_flattened": 4, "single_colour": 2, "single_colour_flattened": 2}
    totals = read_manifest(out).totals
    assert {name: totals[name] for name in counts} == counts
    packed = json.loads((tmp_path / "pack.json").read_text())
    assert {name: packed["totals"][name] for name in counts} == counts
    assert "4 images flattened onto 255,255,255" in result.stdout
    assert "2 images (every pixel alike)" in result.stdout
    warned = [line for line in result.stdout.splitlines() if line.startswith("warning: ")]
    assert warned == [
        "warning: 2 images came out a single colour (every pixel alike); each had transparency, flattened onto "
        "255,255,255: pack again with --background 0,0,0 (or another colour the pictures lack)"
    ]
    assert packed["warnings"] == [warned[0].removeprefix("warning: ")]
    assert verify(str(out)).ok

    black = tmp_path / "black"
    result = shardkit("pack", source, black, "--workers", "1", "--background", "0,0,0")
    assert result.returncode == 0, result.stderr
    totals = read_manifest(black).totals  # on black, only the palette picture (black on clear) is one colour
    assert (totals["alpha_flattened"], totals["single_colour"], totals["single_colour_flattened"]) == (4, 1, 1)
    assert "flattened onto 0,0,0: pack again with --background 255,255,255" in result.stdout
    assert read_manifest(black).settings["encode"]["background"] == [0, 0, 0]


def test_the_background_changes_the_pixels_of_transparent_pictures_only(tmp_path: Path) -> None:
    source = _alpha_folder(tmp_path / "src")
    pixels = {}
    for name, colour in (("white", "255,255,255"), ("black", "0,0,0"), ("teal", "0,128,128")):
        pack(pack_config(source, tmp_path / name, workers=1, encode="raw", background=colour))
        pixels[name] = {s.meta["source"]: s.image for s in open_shards(tmp_path / name)}
    corner = (0, 0)  # transparent in white_on_clear: the background itself
    assert pixels["white"]["white_on_clear.png"][corner].tolist() == [255, 255, 255]
    assert pixels["black"]["white_on_clear.png"][corner].tolist() == [0, 0, 0]
    assert pixels["teal"]["white_on_clear.png"][corner].tolist() == [0, 128, 128]
    assert pixels["black"]["white_on_clear.png"][16, 16].tolist() == [255, 255, 255]  # the artwork stays
    for opaque in ("opaque_rgba.png", "photo.jpg", "one_pixel.png"):
        assert np.array_equal(pixels["white"][opaque], pixels["black"][opaque]), opaque
    assert not np.array_equal(pixels["white"]["palette_trns.png"], pixels["black"]["palette_trns.png"])


def test_the_single_colour_warning_names_a_background_only_where_transparency_was_flattened() -> None:
    from shardkit.packing.finish import single_colour_warning

    assert single_colour_warning({"single_colour": 0}, (255, 255, 255)) == ""
    blank = {"single_colour": 1, "single_colour_flattened": 0}  # a blank picture in the source: nothing to change
    assert single_colour_warning(blank, (255, 255, 255)) == (
        "1 image came out a single colour (every pixel alike); none had transparency"
    )
    some = {"single_colour": 3, "single_colour_flattened": 2}
    assert single_colour_warning(some, [20, 20, 20]) == (
        "3 images came out a single colour (every pixel alike); 2 of them had transparency, flattened onto "
        "20,20,20: pack again with --background 255,255,255 (or another colour the pictures lack)"
    )
    assert "; it had transparency" in single_colour_warning({"single_colour": 1, "single_colour_flattened": 1}, None)


@pytest.mark.parametrize("format", ["webdataset", "lmdb"])
def test_the_counts_of_a_shard_split_into_parts_are_a_whole_ones(tmp_path: Path, format: str) -> None:
    """The last shards are encoded in parts on every worker (a tar's appended, LMDB's records
    handed back): their counts come back with them and add up to what one worker counts."""
    source = _alpha_folder(tmp_path / "src")
    for copy in range(6):  # 42 pictures: one shard, split in parts of at least 16 by two workers
        for picture in list((tmp_path / "src").glob("[a-z]*.*")):
            (source / f"{copy}_{picture.name}").write_bytes(picture.read_bytes())
    one = pack(pack_config(source, tmp_path / "one", workers=1, format=format))
    two = pack(pack_config(source, tmp_path / "two", workers=2, format=format))
    assert one.manifest.totals == two.manifest.totals
    assert (one.manifest.totals["alpha_flattened"], one.manifest.totals["single_colour"]) == (28, 14)
    assert read_manifest(tmp_path / "one").shards == read_manifest(tmp_path / "two").shards


@pytest.mark.parametrize("given", ["300,0,0", "red", "1,2", "-1,0,0", "0,0,0,0", "1.5,2,3"])
def test_a_bad_background_is_refused_before_any_work(shardkit, tmp_path: Path, given: str) -> None:
    write_image(tmp_path / "src" / "a.jpg", 16, 16)
    result = shardkit("pack", tmp_path / "src", tmp_path / "out", "--background", given)
    assert result.returncode == 1, result.stdout
    said = f"error: --background takes R,G,B: three whole numbers 0-255 (0,0,0 is black), not {given!r}"
    assert result.stderr.strip() == said
    assert not (tmp_path / "out").exists()


def test_a_preset_may_give_the_background_as_an_array(tmp_path: Path) -> None:
    preset = tmp_path / "dark.toml"
    preset.write_text("background = [0, 0, 0]\n")
    assert pack_config("src", "out", preset).encode.background == (0, 0, 0)
    assert pack_config("src", "out", preset, background="1,2,3").encode.background == (1, 2, 3)  # the flag wins
    assert EncodeConfig(background=[4, 5, 6]).background == (4, 5, 6)  # type: ignore[arg-type]


def test_resume_keeps_the_counts_of_reused_shards_and_refuses_another_background(tmp_path: Path) -> None:
    """The background decides the bytes, so it is in the settings a resume must match; shards a
    stopped run finished keep their counts in their done markers, and a marker without them (an
    earlier shardkit's) leaves the totals unsaid rather than short."""
    from shardkit.core.errors import OutputError

    source = _alpha_folder(tmp_path / "src")
    clean = pack(pack_config(source, tmp_path / "clean", workers=1, shard_size=2))

    class Stop(Exception):
        pass

    def stop_after_two(done: int, total: int | None, errors: int) -> None:
        if done >= 4:
            raise Stop

    out = tmp_path / "out"
    with pytest.raises(Stop):
        pack(pack_config(source, out, workers=1, shard_size=2), progress=stop_after_two)
    markers = sorted((out / ".shardkit" / "done").glob("*.json"))
    assert markers and all("counts" in json.loads(marker.read_text()) for marker in markers)
    with pytest.raises(OutputError, match="other settings"):
        pack(pack_config(source, out, workers=1, shard_size=2, resume=True, background="0,0,0"))
    resumed = pack(pack_config(source, out, workers=1, shard_size=2, resume=True))
    assert resumed.reused_shards >= 1
    assert resumed.manifest.totals == clean.manifest.totals

    earlier = tmp_path / "earlier"  # stopped by an earlier shardkit: its markers do not count
    with pytest.raises(Stop):
        pack(pack_config(source, earlier, workers=1, shard_size=2), progress=stop_after_two)
    for marker in (earlier / ".shardkit" / "done").glob("*.json"):
        data = json.loads(marker.read_text())
        del data["counts"]
        write_json_atomic(marker, data)
    resumed = pack(pack_config(source, earlier, workers=1, shard_size=2, resume=True))
    assert resumed.reused_shards >= 1 and "alpha_flattened" not in resumed.manifest.totals
    assert verify(str(earlier)).ok  # an output without the counts verifies as before

    again = pack(pack_config(source, tmp_path / "clean", workers=1, shard_size=2, resume=True))
    assert again.already_complete and again.warnings == clean.warnings  # (said again from the totals)


def test_a_url_table_resumed_counts_the_records_it_kept_and_those_it_downloads(tmp_path: Path) -> None:
    """A shard some of whose rows failed transiently is written again by --resume from its earlier
    records and only those rows downloaded: its counts are the earlier records' and the new ones'."""
    from http.server import BaseHTTPRequestHandler

    from tests.servers import serving

    pictures = {path.name: path.read_bytes() for path in _alpha_folder(tmp_path / "src").iterdir()}
    down = {"white_on_clear.png"}  # 503 while listed

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            name = self.path.strip("/")
            status, body = (503, b"busy") if name in down else (200, pictures[name])
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as base:
        table = tmp_path / "urls.csv"
        table.write_text("url\n" + "".join(f"{base}/{name}\n" for name in sorted(pictures)))
        fast = {"workers": 1, "retries": 0, "timeout": 5.0, "shard_size": 100}
        first = pack(pack_config(table, tmp_path / "out", **fast))
        assert first.manifest.totals["transient"] == 1 and first.manifest.totals["alpha_flattened"] == 3
        down.clear()
        resumed = pack(pack_config(table, tmp_path / "out", resume=True, **fast))
        clean = pack(pack_config(table, tmp_path / "clean", **fast))
    assert resumed.records == clean.records == len(pictures)
    assert {name: resumed.manifest.totals[name] for name in ("alpha_flattened", "single_colour")} == {
        "alpha_flattened": 4, "single_colour": 2,
    }  # fmt: skip
    assert resumed.manifest.totals == clean.manifest.totals


# --- the videos' plot -----------------------------------------------------------------------------


def test_probe_plots_a_folder_of_videos(shardkit, tmp_path: Path) -> None:
    pytest.importorskip("av")
    pytest.importorskip("matplotlib")
    from shardkit.synthetic import write_video

    write_video(tmp_path / "src" / "walk" / "a.mp4", 64, 48, seconds=0.5, fps=12)
    write_video(tmp_path / "src" / "run" / "b.mp4", 48, 32, seconds=0.25, fps=8)
    plot = tmp_path / "videos.png"
    result = shardkit("probe", tmp_path / "src", "--plot", plot, "--workers", "1", "--json", tmp_path / "p.json")
    assert result.returncode == 0, result.stderr
    assert f"plot of the videos written to {plot}" in result.stdout
    with Image.open(plot) as drawn:
        assert drawn.format == "PNG" and drawn.width > 1000
    assert "labels: 2 classes from folder names: run, walk" in result.stdout
    assert json.loads((tmp_path / "p.json").read_text())["videos"]["labels"]["classes"] == 2

    write_image(tmp_path / "src" / "still.jpg", 16, 16)  # images too: the videos' plot goes beside theirs
    result = shardkit("probe", tmp_path / "src", "--plot", plot, "--workers", "1")
    assert result.returncode == 0, result.stderr
    assert plot.exists() and (tmp_path / "videos.videos.png").exists()


# --- a Hugging Face `captions` list column -------------------------------------------------------


def test_a_captions_list_column_is_taken_as_the_captions(shardkit, tmp_path: Path) -> None:
    source = tmp_path / "src"
    write_image(source / "a.jpg", 24, 16, seed=1)
    write_image(source / "b.jpg", 24, 16, seed=2)
    rows = [{"file_name": "a.jpg", "captions": ["a dog", "a brown dog"]}, {"file_name": "b.jpg", "captions": ["one"]}]
    (source / "metadata.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = shardkit("pack", source, tmp_path / "out", "--workers", "1")
    assert result.returncode == 0, result.stderr
    texts = {s.meta["source"]: (s.text, s.fields) for s in open_shards(tmp_path / "out", decode="bytes")}
    assert texts == {"a.jpg": (["a dog", "a brown dog"], {}), "b.jpg": (["one"], {})}
    with tarfile.open(tmp_path / "out" / "shard-000000.tar") as tar:
        names = tar.getnames()
        assert json.loads(tar.extractfile("a.captions.json").read()) == ["a dog", "a brown dog"]  # type: ignore[union-attr]
        assert tar.extractfile("a.txt").read().decode() == "a dog\na brown dog"  # type: ignore[union-attr]
    assert "a.columns.json" not in names
    probed = shardkit("probe", source, "--workers", "1")
    assert "captions: 3," in probed.stdout

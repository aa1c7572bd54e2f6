"""Stores of pixel records (``ingest build --encoding raw|mixed:SHARE``): what they hold,
and the loader reading them as it reads a store of JPEGs.

Tolerances: a pixel record is OpenCV's decode of the JPEG (or PNG) the build stores
otherwise, so it equals that decode exactly; the loader's output from it equals the
output from the JPEG store exactly, except where the JPEG path reduces in the DCT domain
(an image at least twice the crop's output: here only ``big.JPEG``), there within a
mean of 0.05 in normalised units (about 3 uint8 levels).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from fixtures import assert_same_store
from hostile_data import rewrite_index, rewrite_record
from loader_data import NUM_SAMPLES, corrupt, make_store

import loader
from ingest import cli
from ingest import format as fmt
from ingest.build import BuildOptions, build
from ingest.build.encoding import parse_encoding, stored_as_pixels
from ingest.format.codec import image_bytes
from ingest.images.probe import header_problem
from ingest.verify import verify_store
from loader.cpu.decode import CpuDecoder
from loader.decode import DecodeError
from loader.store import Store


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    root = tmp_path_factory.mktemp("pixels")
    jpeg = make_store(root)
    out = {"jpeg": jpeg}
    for encoding in ("raw", "mixed:0.4"):
        out[encoding] = root / encoding.replace(":", "")
        build(root / "src", out[encoding], BuildOptions(encoding=encoding), workers=2,
              progress=False)  # fmt: skip
    return out


def _pixels(store: Store, i: int) -> np.ndarray:
    data, kind = store.image(i)
    h, w = int(store.index["height"][i]), int(store.index["width"][i])
    if kind == "raw":
        return np.frombuffer(data, np.uint8).reshape(h, w, -1)
    if kind == "png":
        return cv2.cvtColor(cv2.imdecode(np.frombuffer(data, np.uint8), 1), cv2.COLOR_BGR2RGB)
    gray = int(store.index["channels"][i]) == 1
    flags = cv2.IMREAD_GRAYSCALE if gray else cv2.IMREAD_COLOR_RGB
    img = cv2.imdecode(np.frombuffer(data, np.uint8), flags)
    return img[..., None] if gray else img


def test_a_raw_store_holds_the_decoded_pixels_of_the_jpeg_store(stores) -> None:
    jpeg, raw = Store(stores["jpeg"]), Store(stores["raw"])
    manifest = fmt.read_manifest(stores["raw"])
    assert (manifest["version"], manifest["options"]["encoding"]) == (3, "raw")
    assert fmt.read_manifest(stores["jpeg"])["version"] == 2  # unchanged without pixels
    assert "encoding" not in fmt.read_manifest(stores["jpeg"])["options"]
    assert len(raw) == len(jpeg) == NUM_SAMPLES
    assert raw.paths == jpeg.paths and np.array_equal(raw.labels, jpeg.labels)
    assert set(raw.index["format"].tolist()) == {fmt.FORMAT_CODES["raw"]}
    for i in range(len(raw)):
        want = _pixels(jpeg, i)
        got = _pixels(raw, i)
        assert got.shape == want.shape and np.array_equal(got, want), raw.paths[i]
        assert raw.record(i)["fixes"][-1] == "raw-pixels"
    gray = raw.paths.index("class_00/gray.JPEG")
    assert int(raw.index["channels"][gray]) == 1  # a gray image stays one channel
    assert manifest["stats"]["raw pixels"] == NUM_SAMPLES


def test_a_mixed_store_holds_the_share_its_paths_draw_whatever_the_workers(
    stores, tmp_path
) -> None:
    mixed = Store(stores["mixed:0.4"])
    raw = mixed.index["format"] == fmt.FORMAT_CODES["raw"]
    drawn = [stored_as_pixels(p, 0.4) for p in mixed.paths]
    assert raw.tolist() == drawn and 0 < sum(drawn) < NUM_SAMPLES
    one = tmp_path / "one"
    build(stores["jpeg"].parent / "src", one, BuildOptions(encoding="mixed:0.4"), workers=1,
          progress=False)  # fmt: skip
    assert_same_store(one, stores["mixed:0.4"])


def _epoch(store, transform: str) -> list[tuple]:
    dl = loader.DataLoader(store, batch_size=8, transform=transform, device="cpu", seed=0,
                           num_workers=2, with_indices=True)  # fmt: skip
    return [tuple(t.clone() for t in batch) for batch in dl]


@pytest.mark.parametrize("transform", ["train", "eval"])
@pytest.mark.parametrize("encoding", ["raw", "mixed:0.4"])
def test_the_loader_gives_the_jpeg_stores_samples_and_pixels(stores, encoding, transform):
    want, got = _epoch(stores["jpeg"], transform), _epoch(stores[encoding], transform)
    assert [b[2].tolist() for b in got] == [b[2].tolist() for b in want]  # order, crops
    assert [b[1].tolist() for b in got] == [b[1].tolist() for b in want]  # labels
    big = Store(stores["jpeg"]).paths.index("class_01/big.JPEG")
    for (x, _, idx), (y, _, _) in zip(got, want, strict=True):
        for k, i in enumerate(idx.tolist()):
            diff = (x[k] - y[k]).abs().mean().item()
            assert diff == 0.0 if i != big else diff < 0.05, (i, diff)


def test_a_damaged_pixel_record_is_replaced_and_counted(stores, tmp_path, caplog) -> None:
    path, damaged = corrupt(stores["raw"], tmp_path, 17)
    with caplog.at_level(logging.WARNING, logger="loader"):
        batches = _epoch(damaged, "train")
    got = torch.cat([b[2] for b in batches]).tolist()
    assert len(got) == NUM_SAMPLES and 17 not in got
    assert any("sample 17" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    problems = verify_store(damaged, decode=True)
    assert any("key 17" in p and "CRC-32 mismatch" in p for p in problems), problems


def test_pixels_of_another_size_than_the_index_are_refused_undecoded() -> None:
    out = np.zeros((4, 4, 3), np.uint8)
    crop = np.array([0, 0, 2, 3, 4, 4, 0, 0, 0], np.int32)
    assert header_problem(bytes(2 * 3 * 3), "raw", 2, 3) is None  # RGB
    assert header_problem(bytes(2 * 3), "raw", 2, 3) is None  # gray
    for nbytes in (0, 5, 2 * 3 * 2, 2 * 3 * 3 + 1, 2 * 3 * 4):
        assert header_problem(bytes(nbytes), "raw", 2, 3).startswith(f"the pixels are {nbytes}")
        with pytest.raises(DecodeError, match=f"the pixels are {nbytes} bytes"):
            CpuDecoder().decode_into(bytes(nbytes), "raw", (2, 3), crop, out)


def test_ingest_verify_and_info_take_pixel_records(stores, capsys) -> None:
    assert cli.main(["verify", str(stores["mixed:0.4"])]) == 0
    assert cli.main(["info", str(stores["mixed:0.4"])]) == 0
    shown = capsys.readouterr().out
    assert "(format v3)" in shown and "raw pixels" in shown
    per = fmt.read_manifest(stores["mixed:0.4"])["record_bytes"] / NUM_SAMPLES / 1000
    assert f"encoding   mixed:0.4, {per:.1f} KB of record a sample\n" in shown
    for i in range(NUM_SAMPLES):
        record = Store(stores["raw"]).record(i)
        h, w, c = record["height"], record["width"], record["channels"]
        assert (record["format"], len(image_bytes(record))) == ("raw", c * h * w)


@pytest.mark.parametrize(
    "text, want", [("jpeg", "jpeg"), ("RAW", "raw"), ("mixed:0.25", "mixed:0.25")]
)
def test_encodings_are_spelled_one_way(text, want) -> None:
    assert parse_encoding(text) == want


@pytest.mark.parametrize("text", ["png", "mixed", "mixed:0", "mixed:1", "mixed:1.5", "raw:zstd"])
def test_an_unknown_encoding_is_one_line_that_lists_them(text, capsys, tmp_path) -> None:
    with pytest.raises(SystemExit):
        cli.main(["build", str(tmp_path), str(tmp_path / "out"), "--encoding", text])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("pass jpeg, raw or mixed:SHARE (SHARE between 0 and 1: the part "
                        "stored as pixels)")  # fmt: skip
    assert not (tmp_path / "out").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_the_torch_dataset_reads_pixel_records_as_pil_images(stores) -> None:
    # PIL's decode of the JPEG against OpenCV's made at build time: both libjpeg-turbo.
    jpeg, raw = loader.LMDBDataset(stores["jpeg"]), loader.LMDBDataset(stores["raw"])
    for i in range(NUM_SAMPLES):
        (a, label_a), (b, label_b) = raw[i], jpeg[i]
        assert (a.mode, a.size, label_a) == (b.mode, b.size, label_b)
        diff = np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).mean()
        assert diff <= 0.5, (i, diff)


def test_a_checkpoint_resumes_on_the_pixel_store_as_on_the_jpeg_store(stores) -> None:
    # Two batches in, saved, resumed by another loader: the rest of the epoch, the same
    # samples as on the JPEG store (exactly once over the two).
    def make(store):
        return loader.DataLoader(store, batch_size=8, transform="train", device="cpu",
                                 seed=3, num_workers=2, with_indices=True)  # fmt: skip

    dl = make(stores["raw"])
    it = iter(dl)
    head = [next(it)[2] for _ in range(2)]
    state = dl.state_dict()
    del it
    resumed = make(stores["raw"])
    resumed.load_state_dict(state)
    rest = [b[2] for b in resumed]
    got = torch.cat(head + rest).tolist()
    want = torch.cat([b[2] for b in make(stores["jpeg"])]).tolist()
    assert got == want and sorted(got) == list(range(NUM_SAMPLES))


def test_an_interrupted_pixel_build_resumes_to_the_clean_store(stores, tmp_path, monkeypatch):
    from ingest.build import tasks

    src, out = stores["jpeg"].parent / "src", tmp_path / "out"
    options = BuildOptions(shard_size=2 << 20, encoding="mixed:0.4")
    real = tasks.write_shard

    def stop_at_the_second(src, out, k, *args):
        if k >= 1:
            raise KeyboardInterrupt
        return real(src, out, k, *args)

    monkeypatch.setattr(tasks, "write_shard", stop_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        build(src, out, options, workers=1, progress=False)
    monkeypatch.setattr(tasks, "write_shard", real)
    assert not (out / fmt.MANIFEST).exists()
    manifest = build(src, out, options, workers=1, progress=False)
    build(src, tmp_path / "clean", options, workers=1, progress=False)
    assert len(manifest["shards"]) > 1
    assert_same_store(out, tmp_path / "clean")


def _forged(stores, tmp_path, base: str, name: str, forge) -> Path:
    """A copy of store ``base`` forged by ``forge(copy)``, its checksums made to agree (a
    deliberate forger's: index CRC-32s and sizes, the index's SHA-256, shard digests)."""
    copy = tmp_path / name
    shutil.copytree(stores[base], copy)
    forge(copy)
    manifest = json.loads((copy / fmt.MANIFEST).read_text())
    index = np.load(copy / fmt.INDEX, allow_pickle=False)  # as forged: unchecked
    for shard in manifest["shards"]:
        a, n = shard["first"], shard["count"]
        crcs, sizes = (index[k][a : a + n].astype(np.int64) for k in ("crc32", "nbytes"))
        shard["digest"] = fmt.records_digest(a, crcs, sizes)
    (copy / fmt.MANIFEST).write_text(json.dumps(manifest))
    return copy


def test_pixels_that_disagree_with_their_index_row_are_refused(stores, tmp_path) -> None:
    # Each as a reader refuses it (the record, unread or undecoded) and `ingest verify`
    # names it: pixels in a JPEG row of a version-2 store, an index row whose channels
    # the pixels' length contradicts, a record whose own size is another than its row's.
    row = Store(stores["jpeg"]).index[1]
    h, w = int(row["height"]), int(row["width"])

    def pixels_in_a_jpeg_row(record):
        record.update(image=bytes(h * w * 3), format="raw", channels=3)

    def one_channel(index):
        index["channels"][1] = 1

    def tiny(record):
        record.update(height=1, width=1, channels=1)

    def gray_said_everywhere(store):  # the record and its row say gray; RGB is stored
        rewrite_index(store, one_channel)
        rewrite_record(store, 1, lambda record: record.update(channels=1))

    cases = [
        ("jpeg", lambda s: rewrite_record(s, 1, pixels_in_a_jpeg_row), "format 'raw' differs"),
        ("raw", lambda s: rewrite_index(s, one_channel), "its channels 3 differ"),
        ("raw", lambda s: rewrite_record(s, 1, tiny), "its size 1x1 differs"),
        ("raw", gray_said_everywhere, f"where {w}x{h} pixels take {h * w}"),
    ]
    for k, (base, forge, says) in enumerate(cases):
        forged = _forged(stores, tmp_path, base, f"forged{k}", forge)
        with pytest.raises(fmt.RecordError, match=says):
            Store(forged).image(1)
        problems = verify_store(forged, decode=True)
        assert len(problems) == 1 and "key 1" in problems[0] and says in problems[0], problems


def test_an_index_of_version_2_holds_no_pixels(stores, tmp_path) -> None:
    def pixel_code(index):
        index["format"][1] = fmt.FORMAT_CODES["raw"]

    forged = _forged(stores, tmp_path, "jpeg", "v2-raw", lambda s: rewrite_index(s, pixel_code))
    with pytest.raises(fmt.StoreError, match=r"row 1 has an invalid format \(3"):
        Store(forged)


def test_encodings_are_checked_where_the_build_is_asked_from_python() -> None:
    assert BuildOptions(encoding="MIXED:0.50").encoding == "mixed:0.5"
    assert BuildOptions(encoding="mixed:0.1234567").encoding == "mixed:0.1234567"
    for bad in ("RAW:", "png", "mixed:0.9999999999999999999", "mixed:1.5"):
        with pytest.raises(ValueError, match="pass jpeg, raw or mixed:SHARE"):
            BuildOptions(encoding=bad)


def test_a_build_resumed_under_another_encoding_says_which(stores) -> None:
    from ingest.build.resume import difference, fingerprint
    from ingest.build.scan import scan

    tree = scan(stores["jpeg"].parent / "src")
    mixed = fingerprint(tree, BuildOptions(encoding="mixed:0.5").output_affecting())
    jpeg = fingerprint(tree, BuildOptions().output_affecting())
    assert (mixed["version"], jpeg["version"]) == (3, 2)
    said = "with other options (--encoding mixed:0.5 then, --encoding jpeg now)"
    assert difference(mixed, jpeg) == said
    back = "with other options (--encoding jpeg then, --encoding mixed:0.5 now)"
    assert difference(jpeg, mixed) == back

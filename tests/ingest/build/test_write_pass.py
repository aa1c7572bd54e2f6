"""The write pass makes a record stored as it is from the file's first bytes and the plan
(``process.stored_again``), parsing only the records a conversion made: the same store."""

from __future__ import annotations

import io
from pathlib import Path

import msgpack
import pytest
from fixtures import assert_same_store, make_image_folder
from PIL import Image, PngImagePlugin

from ingest import format as fmt
from ingest.build import BuildOptions, build, tasks, twopass
from ingest.build.scan import SourceError
from ingest.format.codec import parse_compression


def _tree(root: Path) -> Path:
    """JPEGs as they are, and beside them what the quick way may get wrong: bytes after a
    JPEG's and a PNG's end (dropped: a prefix), a PNG's text chunk (dropped from inside:
    made again the long way), a progressive JPEG, a CMYK JPEG (converted)."""
    make_image_folder(root, 2, 6, seed=11, short_side=(48, 64))
    jpeg = (root / "class_00" / "img_00000.JPEG").read_bytes()
    img = Image.open(io.BytesIO(jpeg)).convert("RGB")
    png, text, progressive, cmyk = io.BytesIO(), io.BytesIO(), io.BytesIO(), io.BytesIO()
    img.save(png, "PNG")
    info = PngImagePlugin.PngInfo()
    info.add_text("comment", "made by a camera")
    img.save(text, "PNG", pnginfo=info)
    img.save(progressive, "JPEG", quality=90, progressive=True)
    img.convert("CMYK").save(cmyk, "JPEG", quality=90)
    extra = root / "class_01"
    (extra / "trailing.jpg").write_bytes(jpeg + b"motion-photo video" * 40)
    (extra / "trailing.png").write_bytes(png.getvalue() + b"\0" * 300)
    (extra / "text.png").write_bytes(text.getvalue())
    (extra / "progressive.jpg").write_bytes(progressive.getvalue())
    (extra / "cmyk.jpg").write_bytes(cmyk.getvalue())
    return root


class _WritePassParses:
    """Counts process_file's calls while a write task runs (workers=1: all in this process),
    and those of them without verification."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.light, self.writing = 0, 0, False
        real_process, real_write = tasks.process_file, tasks.write_shard

        def process(job, options):
            self.calls += self.writing
            self.light += self.writing and not options.verify
            return real_process(job, options)

        def write(*args):
            self.writing = True
            try:
                return real_write(*args)
            finally:
                self.writing = False

        monkeypatch.setattr(tasks, "process_file", process)
        monkeypatch.setattr(tasks, "write_shard", write)


@pytest.mark.parametrize(
    "options",
    [
        BuildOptions(shard_size=16 << 10),
        BuildOptions(shard_size=16 << 10, verify=False),
        BuildOptions(shard_size=16 << 10, compression=parse_compression("zstd")),
    ],
    ids=["verified", "no-verify", "zstd"],
)
def test_records_stored_as_they_are_are_made_again_without_parsing(
    tmp_path: Path, monkeypatch, options: BuildOptions
) -> None:
    src = _tree(tmp_path / "src")
    with monkeypatch.context() as m:
        parses = _WritePassParses(m)
        quick = build(src, tmp_path / "quick", options, workers=1, progress=False)
    with monkeypatch.context() as m:
        m.setattr(tasks, "stored_again", lambda *args: None)  # every record the long way
        build(src, tmp_path / "long", options, workers=1, progress=False)
    assert_same_store(tmp_path / "quick", tmp_path / "long")
    index = fmt.load_index(tmp_path / "quick")
    made = int(((index["flags"] & fmt.FLAG_REENCODED) != 0).sum())
    assert (quick["num_samples"], len(quick["shards"]), made) == (17, 4, 2)  # text.png, cmyk
    assert parses.calls == made
    fixes = quick["stats"]
    assert (fixes["fix trailing-bytes-dropped"], fixes["fix png-ancillary-chunks-dropped"]) == (
        2,
        1,
    )


_stored_again = tasks.stored_again


def _changed_first(job: tuple, *args):
    """stored_again, after the first pass: the victim's image is then one byte other."""
    victim = Path(job[0])
    if victim.name == "img_00003.JPEG":
        changed = bytearray(victim.read_bytes())
        changed[len(changed) // 2] ^= 0xFF  # the same size: only its CRC-32 tells
        victim.write_bytes(changed)
    return _stored_again(job, *args)


@pytest.mark.parametrize("workers", [1, 2], ids=["in-process", "streamed"])
def test_a_file_changed_between_the_passes_stops_a_local_build(
    tmp_path: Path, monkeypatch, workers: int
) -> None:
    src = _tree(tmp_path / "src")
    victim = src / "class_00" / "img_00003.JPEG"
    monkeypatch.setattr(tasks, "stored_again", _changed_first)
    opts = BuildOptions(shard_size=512 << 20)  # one shard, streamed with workers=2
    with pytest.raises(SourceError, match=f"^{victim} changed while the build ran"):
        build(src, tmp_path / "out", opts, workers=workers, progress=False)
    assert not (tmp_path / "out" / fmt.MANIFEST).exists()


def test_plans_of_an_older_ingest_are_made_again(tmp_path: Path, monkeypatch) -> None:
    # Its plans held sizes and CRC-32s only (no rows, no stored sizes): a resumed build
    # checks those ranges again rather than fail on a missing key.
    src = _tree(tmp_path / "src")
    out, opts = tmp_path / "out", BuildOptions(shard_size=16 << 10)
    real = tasks.write_shard

    def stop(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks, "write_shard", stop)
    with pytest.raises(KeyboardInterrupt):
        build(src, out, opts, workers=1, progress=False)
    monkeypatch.setattr(tasks, "write_shard", real)
    plans = sorted((out / fmt.PARTIAL_DIR).glob("plan2-*.msgpack"))
    assert plans
    for path in plans:
        plan = msgpack.unpackb(path.read_bytes(), raw=False)
        a, b = plan["first"], plan["end"]
        assert twopass.load_plan(path, a, b) is not None
        old = {key: plan[key] for key in ("first", "end", "kept", "rejects", "stats")}
        path.write_bytes(msgpack.packb({**old, "nbytes": b"", "crc32": b""}, use_bin_type=True))
        assert twopass.load_plan(path, a, b) is None
    build(src, out, opts, workers=1, progress=False)
    build(src, tmp_path / "clean", opts, workers=1, progress=False)
    assert_same_store(out, tmp_path / "clean")


def test_a_plan_cut_short_is_checked_again(tmp_path: Path) -> None:
    # It decodes, but its columns are not of the same records: as no plan at all.
    path = tmp_path / "plan2-000000000000-000000000002.msgpack"
    row = bytes(fmt.INDEX_DTYPE.itemsize)
    good = {"first": 0, "end": 2, "kept": bytes(16), "rows": row * 2, "stored": bytes(8),
            "rejects": [], "stats": {}}  # fmt: skip
    short = [{**good, "rows": row}, {**good, "stored": bytes(4)}, {**good, "kept": bytes(12)},
             {**good, "kept": "no"}]  # fmt: skip
    for plan, usable in [(good, True)] + [(p, False) for p in short]:
        path.write_bytes(msgpack.packb(plan, use_bin_type=True))
        assert (twopass.load_plan(path, 0, 2) is not None) == usable, plan


def test_pixel_records_are_made_again_the_light_way_once_each(tmp_path: Path, monkeypatch):
    # Checked once by the first pass, decoded again to be made: without that check, and
    # the CRC-32 tells it made the first pass's record (a fall back would parse twice).
    src = _tree(tmp_path / "src")
    options = BuildOptions(shard_size=16 << 10, encoding="raw")
    with monkeypatch.context() as m:
        parses = _WritePassParses(m)
        manifest = build(src, tmp_path / "raw", options, workers=1, progress=False)
    assert manifest["num_samples"] == parses.calls == parses.light == 17
    assert manifest["stats"]["raw pixels"] == 17

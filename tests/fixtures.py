"""Source trees of the ingest and dataset tests, cut from the bundled photographs.

``make_awkward_tree`` writes every awkward-but-valid, invalid and ignored kind of file
the converter must handle, and returns what each one should become; ``make_clean_tree``
writes a small tree that torchvision's ImageFolder reads; ``make_big_tree`` one large
enough for many small shards. Helpers read stores back without the loader.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageOps

from ingest import cli
from ingest import format as fmt
from ingest.build import BuildOptions
from ingest.format.pages import open_lmdb
from ingest.images.probe import parse_jpeg
from loader.bench.synth import make_image_folder, random_view, sample_photos

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"  # the shared helper modules and scripts, above the tests by package
KiB = 1 << 10

# Small shards, so that the test stores have several and keys cross shard bounds.
AWKWARD_OPTIONS = BuildOptions(shard_size=48 * KiB)
CLEAN_OPTIONS = BuildOptions(shard_size=32 * KiB)

# Tolerances, as the mean absolute difference per channel value (0..255) from the reference.
JPEG_REENCODE_TOL = 3.0  # re-encoded at quality 95 with 4:2:0 chroma
DECODER_TOL = 1.0  # the same JPEG bytes decoded by OpenCV instead of PIL (IDCT, upsampling)
EXACT = 0.0  # lossless conversions and byte-for-byte payloads


@dataclass(frozen=True)
class Expect:
    """What an awkward-but-valid source file must become in the store."""

    fixes: tuple[str, ...]  # the record's "fixes", exactly
    format: str  # payload format
    source_format: str
    tolerance: float  # mean abs diff of the decoded payload from the reference
    channels: int = 3
    subsampling: str | None = None
    progressive: bool = False
    same_bytes: bool = False  # payload is the source file, byte for byte
    reference: str = "pil"  # "pil": exif_transpose + convert("RGB"); "gray16": value / 257


@dataclass
class Tree:
    root: Path
    expect: dict[str, Expect] = field(default_factory=dict)  # stored files by relative path
    invalid: dict[str, str] = field(default_factory=dict)  # path -> reason substring
    ignored: dict[str, str] = field(default_factory=dict)  # path -> scan's ignore reason


JPEG_FIX = "reencoded-jpeg:q95"
PNG_FIX = "reencoded-png"
PLAIN = Expect((), "jpeg", "jpeg", EXACT, subsampling="4:2:0", same_bytes=True)


def _photo(rng: np.random.Generator, short: tuple[int, int] = (128, 160)) -> Image.Image:
    """A small RGB crop of one of the bundled photographs (large enough that a quality-95
    4:2:0 re-encode stays within JPEG_REENCODE_TOL)."""
    photos = sample_photos()
    bgr = cv2.imread(str(photos[int(rng.integers(len(photos)))]), cv2.IMREAD_COLOR)
    return Image.fromarray(random_view(bgr, rng, short)[:, :, ::-1].copy())


def _save(img: Image.Image, fmt_name: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt_name, **kw)
    return buf.getvalue()


def _exif_jpeg(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _save(img, "JPEG", quality=92, exif=exif)


def _ycck(img: Image.Image) -> bytes:
    """A YCCK JPEG of ``img``: the YCbCr transform of its CMY, and K, in an Adobe JPEG.

    Pillow writes CMYK JPEGs inverted (Adobe convention) with APP14 transform 0; storing
    the inverted YCC of CMY and setting the transform to 2 makes decoders read YCCK.
    """
    c, m, y, k = img.convert("CMYK").split()
    ycc = Image.merge("RGB", (c, m, y)).convert("YCbCr").split()
    inverted = [Image.fromarray(255 - np.asarray(channel)) for channel in ycc]
    data = bytearray(_save(Image.merge("CMYK", (*inverted, k)), "JPEG", quality=95))
    adobe = data.find(b"Adobe")
    assert adobe > 0 and data[adobe + 11] == 0, "Pillow wrote no Adobe marker"
    data[adobe + 11] = 2
    return bytes(data)


def _gray16(img: Image.Image, rng: np.random.Generator) -> bytes:
    gray = np.asarray(img.convert("L")).astype(np.int32) * 257
    wide = np.clip(gray + rng.integers(-128, 129, gray.shape), 0, 65535).astype(np.uint16)
    out = Image.fromarray(wide)
    assert out.mode == "I;16"
    return _save(out, "PNG")


def _rgb16(img: Image.Image, rng: np.random.Generator) -> bytes:
    bgr = np.asarray(img)[:, :, ::-1].astype(np.int32) * 257
    wide = np.clip(bgr + rng.integers(-128, 129, bgr.shape), 0, 65535).astype(np.uint16)
    ok, buf = cv2.imencode(".png", wide)
    assert ok
    return buf.tobytes()


def _corrupt_jpeg(jpeg: bytes, rng: np.random.Generator) -> bytes:
    """The header of ``jpeg`` and its end-of-image marker, random bytes in between."""
    start = parse_jpeg(jpeg).scan
    start += 2 + int.from_bytes(jpeg[start + 2 : start + 4], "big")
    noise = rng.integers(0, 256, len(jpeg) - start - 2, dtype=np.uint8).tobytes()
    return jpeg[:start] + noise + b"\xff\xd9"


def _awkward(img: Image.Image, rng: np.random.Generator) -> dict[str, tuple[bytes, Expect]]:
    """Every awkward-but-valid kind: file name -> (bytes, expectation)."""
    rgba = img.convert("RGBA")
    rgba.putalpha(Image.fromarray(rng.integers(0, 256, img.size[::-1], dtype=np.uint8)))
    pal = img.convert("P", palette=Image.Palette.ADAPTIVE, colors=64)
    reenc = Expect((JPEG_FIX,), "jpeg", "jpeg", JPEG_REENCODE_TOL, subsampling="4:2:0")
    lossless = Expect((), "png", "png", EXACT, same_bytes=True)

    def png(*fixes: str, src: str = "png", channels: int = 3) -> Expect:
        return Expect((*fixes, PNG_FIX), "png", src, EXACT, channels=channels)

    return {
        "cmyk.jpg": (_save(img.convert("CMYK"), "JPEG", quality=95), _with(reenc, "cmyk-to-rgb")),
        "ycck.jpg": (_ycck(img), _with(reenc, "cmyk-to-rgb")),
        "gray.jpg": (
            _save(img.convert("L"), "JPEG", quality=90),
            Expect((), "jpeg", "jpeg", EXACT, 1, "gray", same_bytes=True),
        ),
        "progressive.jpg": (
            _save(img, "JPEG", quality=90, progressive=True),
            Expect((), "jpeg", "jpeg", EXACT, 3, "4:2:0", progressive=True, same_bytes=True),
        ),
        "exif3.jpg": (_exif_jpeg(img, 3), _with(reenc, "exif-orientation:3")),
        "exif6.jpg": (_exif_jpeg(img, 6), _with(reenc, "exif-orientation:6")),
        "exif8.jpg": (_exif_jpeg(img, 8), _with(reenc, "exif-orientation:8")),
        "png_named.JPEG": (_save(img, "PNG"), lossless),
        "plain.png": (_save(img, "PNG"), lossless),
        "rgba.png": (_save(rgba, "PNG"), png("alpha-dropped")),
        "la.png": (_save(rgba.convert("LA"), "PNG"), png("alpha-dropped", channels=1)),
        "gray16.png": (
            _gray16(img, rng),
            Expect(("16bit-to-8bit", PNG_FIX), "png", "png", EXACT, 1, reference="gray16"),
        ),
        "rgb16.png": (_rgb16(img, rng), png("16bit-to-8bit")),
        "palette.png": (_save(pal, "PNG"), png("palette-to-rgb")),
        "palette_alpha.png": (
            _save(pal, "PNG", transparency=0),
            png("palette-to-rgb", "alpha-dropped"),
        ),
        "image.webp": (_save(img, "WEBP", quality=90), png("webp-to-png", src="webp")),
        "image.bmp": (_save(img, "BMP"), png("bmp-to-png", src="bmp")),
        "image.tiff": (_save(img, "TIFF"), png("tiff-to-png", src="tiff")),
        "image.gif": (_save(img, "GIF"), png("palette-to-rgb", "gif-to-png", src="gif")),
    }


def _with(base: Expect, fix: str) -> Expect:
    return Expect((fix, *base.fixes), base.format, base.source_format, base.tolerance,
                  base.channels, base.subsampling)  # fmt: skip


def _invalid(jpeg: bytes, rng: np.random.Generator) -> dict[str, tuple[bytes, str]]:
    """Every invalid kind: file name -> (bytes, substring of the reject reason)."""
    return {
        "bad_empty.jpg": (b"", "empty file"),
        "bad_truncated.jpg": (jpeg[: int(len(jpeg) * 0.6)], "truncated"),
        "bad_corrupt.jpg": (_corrupt_jpeg(jpeg, rng), "corrupt JPEG data"),
        "bad_gzip.jpg": (gzip.compress(jpeg), "gzip-compressed"),
        "bad_html.jpg": (b"<!DOCTYPE html>\n<html><body>404 Not Found</body></html>\n", "HTML"),
        "bad_random.jpg": (rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(), "unrecognised"),
    }


def make_awkward_tree(root: Path, seed: int = 1) -> Tree:
    """Two classes of plain JPEGs plus every awkward, invalid and ignored kind of file."""
    tree = Tree(root)
    for path in make_image_folder(root, 2, 3, seed=seed, short_side=(48, 72)):
        tree.expect[path.relative_to(root).as_posix()] = PLAIN
    rng = np.random.default_rng(seed)
    for i, (name, (data, expect)) in enumerate(_awkward(_photo(rng), rng).items()):
        rel = f"class_{i % 2:02d}/{name}"
        (root / rel).write_bytes(data)
        tree.expect[rel] = expect
    nested = root / "class_01" / "sub" / "deeper"
    nested.mkdir(parents=True)
    (nested / "nested.jpg").write_bytes((root / "class_01" / "img_00000.JPEG").read_bytes())
    tree.expect["class_01/sub/deeper/nested.jpg"] = PLAIN
    jpeg = (root / "class_00" / "img_00001.JPEG").read_bytes()
    for i, (name, (data, reason)) in enumerate(_invalid(jpeg, rng).items()):
        rel = f"class_{i % 2:02d}/{name}"
        (root / rel).write_bytes(data)
        tree.invalid[rel] = reason
    for rel, reason, data in (
        ("README.txt", "file outside class folders", b"top-level notes\n"),
        ("class_00/.DS_Store", "hidden or system file", b"\x00\x00\x00\x01Bud1"),
        ("class_00/._img_00000.JPEG", "hidden or system file", b"\x00\x05\x16\x07" + bytes(60)),
        ("class_01/Thumbs.db", "hidden or system file", bytes(512)),
        ("class_01/notes.txt", "not an image file (extension)", b"labels are folders\n"),
    ):
        (root / rel).write_bytes(data)
        tree.ignored[rel] = reason
    return tree


def make_clean_tree(root: Path, seed: int = 3) -> Path:
    """3 classes x 8 real-photo images, two of them in a nested folder, one of them a PNG."""
    make_image_folder(root, 3, 8, seed=seed, short_side=(56, 96))
    nested = root / "class_01" / "nested"
    nested.mkdir()
    for name in ("img_00006.JPEG", "img_00007.JPEG"):
        os.replace(root / "class_01" / name, nested / name)
    jpeg = root / "class_02" / "img_00007.JPEG"
    cv2.imwrite(str(root / "class_02" / "img_00007.png"), cv2.imread(str(jpeg)))
    jpeg.unlink()
    return root


def make_big_tree(root: Path, seed: int = 5) -> Path:
    """120 ImageNet-sized JPEGs (about 4 MB) in 3 classes, and two empty files (rejects)."""
    make_image_folder(root, 3, 40, seed=seed)
    (root / "class_00" / "img_00011_empty.JPEG").write_bytes(b"")
    (root / "class_02" / "img_00030_empty.JPEG").write_bytes(b"")
    return root


def reference_rgb(path: Path, expect: Expect) -> np.ndarray:
    """The pixels ``path`` should have in the store, as HxWx3 uint8 RGB."""
    with Image.open(path) as img:
        if expect.reference == "gray16":
            wide = np.asarray(img, dtype=np.uint16).astype(np.float64)
            gray = np.clip((wide / 257.0).round(), 0, 255).astype(np.uint8)
            return np.stack([gray] * 3, axis=-1)
        return np.asarray(ImageOps.exif_transpose(img).convert("RGB"))


def decode_pil(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def decode_cv2(data: bytes) -> np.ndarray:
    bgr = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    assert bgr is not None, "OpenCV could not decode the payload"
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


def mean_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, f"shapes differ: {a.shape} vs {b.shape}"
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


def read_shards(store: Path) -> list[tuple[str, bytes, bytes]]:
    """Every (shard name, key, value) record of ``store``, straight from LMDB, in shard and key
    order (the build identity, the one key that is not 8 bytes long, left out)."""
    out = []
    for entry in fmt.read_manifest(store)["shards"]:
        env = open_lmdb(store / entry["name"], readonly=True, lock=False, subdir=True)
        with env.begin() as txn:
            out.extend((entry["name"], bytes(k), bytes(v)) for k, v in txn.cursor() if len(k) == 8)
        env.close()
    return out


def build_killed_in_a_worker(args: list[str], capsys) -> Path:
    """Run ``ingest ARGS`` (a build whose worker a test kills): one line says so and how to
    resume, and no manifest makes OUT look complete; return OUT."""
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"ingest build: error: ingest worker \d \(pid \d+\) died: killed by signal SIGKILL; "
        r"run the same command again: it resumes from the shards already written\n",
        err,
    ), err
    out = Path(args[2])
    assert not (out / fmt.MANIFEST).exists()
    return out


def rerun_gives_the_clean_build(args: list[str], clean: Path) -> None:
    """``ingest ARGS`` again completes OUT, the same store as a build into ``clean``."""
    assert cli.main(args) == 0
    assert cli.main([*args[:2], str(clean), *args[3:]]) == 0
    assert_same_store(Path(args[2]), clean)


def assert_same_store(a: Path, b: Path) -> None:
    """Two stores hold the same manifest, index, paths, rejects and LMDB files, byte for byte."""
    manifest = fmt.read_manifest(a)
    assert manifest == fmt.read_manifest(b)
    for name in (fmt.INDEX, fmt.PATHS, fmt.REJECTS):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    np.testing.assert_array_equal(fmt.load_index(a), fmt.load_index(b))
    assert read_shards(a) == read_shards(b)
    for entry in manifest["shards"]:
        data = [(root / entry["name"] / "data.mdb").read_bytes() for root in (a, b)]
        assert data[0] == data[1], f"{entry['name']}/data.mdb differs"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())


def run_ingest(*args: str | os.PathLike, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python3 -m ingest ARGS`` from the repository; capture its output as text."""
    return run_python("-m", "ingest", *args, timeout=timeout)


def _path() -> str:
    """PYTHONPATH with the repository first and what was there kept (installed extras)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def run_python(
    *args: str | os.PathLike, timeout: float = 120, **env: str
) -> subprocess.CompletedProcess:
    """Run ``python3 ARGS`` from the repository, which it imports, with ``env`` added to
    the environment; capture its output as text."""
    return subprocess.run(
        [sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, check=False, env={**os.environ, "PYTHONPATH": _path(), **env},
    )  # fmt: skip


def sealed_shards(out: Path) -> list[str]:
    """The shards the build state of ``out`` records as sealed (none while there is none)."""
    try:
        state = json.loads((out / fmt.BUILD_STATE).read_text())
    except (OSError, ValueError):  # not written yet (it is replaced atomically)
        return []
    return [s["name"] for s in state.get("shards", [])]  # none in a failed build's


def kill_9_after_a_shard(args: list, out: Path, within: float) -> list[str]:
    """Run ``python3 -m ingest ARGS``, ``kill -9`` it and its workers as soon as it has
    sealed a shard of ``out`` (failing if it ends first or takes over ``within`` seconds);
    the shards sealed by then."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ingest", *map(str, args)], cwd=REPO, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + within
        while not sealed_shards(out):
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, f"no shard was sealed within {within:.0f} s"
            time.sleep(0.001)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the pool workers too
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (out / fmt.MANIFEST).exists()
    return sealed_shards(out)


def count_files(root: Path) -> int:
    return sum(len(files) for _, _, files in os.walk(root))


@contextlib.contextmanager
def collector_off():
    """Inside, only reference counting frees anything: what is held in a reference cycle
    stays (what earlier code left to the cyclic collector is collected first)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def held_resources() -> tuple[int, int, int]:
    """This process's open file descriptors, threads and child processes (Linux /proc),
    once what earlier tests left for the garbage collector is gone. The CUDA driver's
    descriptors of its device nodes (``/dev/nvidia*``) are not counted: it opens one as a
    memory pool maps more memory (DALI's grow for their first epochs, then stay: measured
    on the H200, where some were opened at the 7th epoch and none after; the DALI memory
    test bounds the pools)."""
    gc.collect()
    me = str(os.getpid())
    children = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                children += f.read().rsplit(")", 1)[1].split()[1] == me  # the parent's pid
        except OSError:  # gone meanwhile
            pass
    return len(_our_descriptors()), threading.active_count(), children


def _our_descriptors() -> list[str]:
    """What this process's descriptors open, but the CUDA driver's device nodes and the
    stderr that a C call in flight in another thread has saved aside (``ingest.cstderr``:
    a decode thread of the next epoch may be inside one)."""
    from ingest import cstderr

    targets = []
    with cstderr.still() as saved:
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # closed meanwhile (the listing's own among them)
                if int(fd) not in saved:
                    targets.append(os.readlink(f"/proc/self/fd/{fd}"))
    return [t for t in targets if not t.startswith("/dev/nvidia")]


def held_over_epochs(dl, epochs: int, abandon: bool, settle=lambda: None) -> list:
    """``held_resources`` after each of ``epochs`` epochs of ``dl``, read whole or left
    after 2 batches (as a bounded loop leaves them); ``settle`` runs before each count."""
    held = []
    for _ in range(epochs):
        for k, _batch in enumerate(dl):
            if abandon and k == 1:
                break
        settle()
        held.append(held_resources())
    return held


class ParentOnly:
    """Held in a reference cycle, so only the garbage collector frees it; freed in another
    process it aborts that process, as a CUDA tensor or a DALI pipeline inherited by a
    forked worker does."""

    def __init__(self) -> None:
        self.pid, self.me = os.getpid(), self

    def __del__(self) -> None:
        if os.getpid() != self.pid:
            os.abort()

"""Test data of the loader tests: a small store of real-photo JPEGs plus the odd cases."""

from __future__ import annotations

import shutil
from pathlib import Path

import cv2
import numpy as np

from ingest import format as fmt
from ingest.build import build
from loader.bench.synth import make_image_folder, random_view, sample_photos
from loader.store import Store

CLASSES, PER_CLASS = 3, 20
EXTRA = 3  # a grayscale JPEG, a large JPEG (DCT-domain reduction) and a PNG
NUM_SAMPLES = CLASSES * PER_CLASS + EXTRA


def make_store(root: Path) -> Path:
    """Build ``root/store`` from ``root/src`` (63 images in 3 classes); return the store."""
    src = root / "src"
    make_image_folder(src, CLASSES, PER_CLASS, seed=7)
    rng = np.random.default_rng(7)
    photo = cv2.imread(str(sample_photos()[0]), cv2.IMREAD_COLOR)
    gray = cv2.cvtColor(random_view(photo, rng, (300, 340)), cv2.COLOR_BGR2GRAY)
    cv2.imwrite(str(src / "class_00" / "gray.JPEG"), gray, [cv2.IMWRITE_JPEG_QUALITY, 92])
    big = random_view(photo, rng, (1100, 1200))
    cv2.imwrite(str(src / "class_01" / "big.JPEG"), big, [cv2.IMWRITE_JPEG_QUALITY, 92])
    cv2.imwrite(str(src / "class_02" / "plain.png"), random_view(photo, rng, (240, 260)))
    store = root / "store"
    build(src, store, workers=2, progress=False)
    return store


def corrupt(store, tmp_path, index: int) -> tuple[str, object]:
    """Copy the store, overwrite the middle of record ``index``'s image with junk, in place in
    its shard file (same size); return (its path, the copy)."""
    copy = tmp_path / "damaged"
    shutil.copytree(store, copy)
    record = Store(copy).record(index)
    shard = copy / fmt.shard_name(Store(copy).shard_of(index)) / "data.mdb"
    data = bytearray(shard.read_bytes())
    at = data.find(record["image"])
    assert at > 0 and data.find(record["image"], at + 1) < 0
    data[at + 100 : at + 356] = b" this is not a JPEG " * 12 + bytes(16)
    shard.write_bytes(bytes(data))
    return record["path"], copy


def photo_batch(n: int, size: int, seed: int = 0):
    """``n`` uint8 views [n, 3, size, size] of the bundled photographs (a torch tensor),
    with one flat gray image among them (hue and saturation's edge case)."""
    import torch

    rng = np.random.default_rng(seed)
    photos = [cv2.imread(str(p), cv2.IMREAD_COLOR_RGB) for p in sample_photos()]
    out = np.empty((n, size, size, 3), np.uint8)
    for k in range(n):
        view = random_view(photos[k % len(photos)], rng, (size, size + 8))
        out[k] = view[:size, :size]
    out[-1] = 128
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()


def assert_within_rounding(got, want, share: float = 1e-3) -> None:
    """uint8 batches ``got`` and ``want`` alike but for float rounding: at most 1 level
    apart, on at most ``share`` of the pixels (the figures printed, for the logs)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = (got.cpu().int() - want.cpu().int()).abs()
    off = float((diff > 0).float().mean())
    print(f"max {int(diff.max())}, share {off:.2e}")
    assert diff.max() <= 1 and off <= share, f"{int(diff.max())} levels off on {off:.2e}"

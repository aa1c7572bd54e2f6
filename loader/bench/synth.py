"""Realistic ImageFolder trees made from real photographs, for the demo, tests and benchmarks."""

from __future__ import annotations

import os
from pathlib import Path

import cv2
import numpy as np

SAMPLES = Path(__file__).parent / "samples"


def sample_photos(photos: str | os.PathLike | None = None) -> list[Path]:
    """The photographs to cut images from: ``photos`` (a folder of JPEGs) or the bundled ones."""
    folder = Path(photos) if photos else SAMPLES
    found = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))
    if not found:
        raise FileNotFoundError(f"no .jpg photographs in {folder}")
    return found


def make_image_folder(
    dst: str | os.PathLike,
    num_classes: int = 4,
    per_class: int = 10,
    *,
    seed: int = 0,
    short_side: tuple[int, int] = (300, 450),
    quality: tuple[int, int] = (85, 95),
    photos: str | os.PathLike | None = None,
) -> list[Path]:
    """Write ``num_classes x per_class`` ImageNet-shaped JPEGs under ``dst/class_XX/``.

    Each image is a random crop of a real photograph (aspect 3:4..4:3), scaled so its
    short side falls in ``short_side``, saved as baseline 4:2:0 JPEG at a random quality.
    The same arguments give the same files.
    """
    rng = np.random.default_rng(seed)
    sources = [cv2.imread(str(p), cv2.IMREAD_COLOR) for p in sample_photos(photos)]
    written = []
    for c in range(num_classes):
        folder = Path(dst) / f"class_{c:02d}"
        written += write_images(folder, range(per_class), sources, rng, short_side, quality)
    return written


def write_images(
    folder: Path,
    numbers: range,
    sources: list[np.ndarray],
    rng: np.random.Generator,
    short_side: tuple[int, int],
    quality: tuple[int, int],
) -> list[Path]:
    """Write ``folder/img_NNNNN.JPEG`` for each number: random views of ``sources``."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i in numbers:
        img = random_view(sources[int(rng.integers(len(sources)))], rng, short_side)
        q = int(rng.integers(quality[0], quality[1] + 1))
        path = folder / f"img_{i:05d}.JPEG"
        ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, q])
        assert ok, "OpenCV failed to encode a JPEG"
        path.write_bytes(buf.tobytes())
        written.append(path)
    return written


def random_view(photo: np.ndarray, rng: np.random.Generator, short_side: tuple[int, int]):
    """A random crop of ``photo`` resized so that its short side is in ``short_side``."""
    h, w = photo.shape[:2]
    aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    area = rng.uniform(0.3, 1.0) * h * w
    cw = int(min(w, round(np.sqrt(area * aspect))))
    ch = int(min(h, round(np.sqrt(area / aspect))))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    crop = photo[y : y + ch, x : x + cw]
    target = int(rng.integers(short_side[0], short_side[1] + 1))
    scale = target / min(ch, cw)
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_CUBIC
    return cv2.resize(crop, size, interpolation=interp)

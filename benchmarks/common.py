"""Shared pieces of the benchmarks: the dataset they run on and the machine they ran on."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_PHOTOS = REPO.parent / "shared" / "photos"


def photos_dir() -> Path | None:
    """The project's 33 photographs when checked out beside shared/, else the bundled ten."""
    return SHARED_PHOTOS if SHARED_PHOTOS.is_dir() else None


def make_dataset(root: Path, num_classes: int, per_class: int, seed: int = 0) -> Path:
    """ImageNet-shaped JPEGs (short side 300-450 px) under root/src, made once and reused."""
    from ingest.synth import make_image_folder

    src = root / "src"
    stamp = src / f".made-{num_classes}x{per_class}-{seed}"
    if not stamp.exists():
        make_image_folder(src, num_classes, per_class, seed=seed, photos=photos_dir(),
                          quality=(90, 97))  # fmt: skip
        stamp.touch()
    return src


def image_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))


def warm(paths: list[Path]) -> int:
    """Read every file once so that all timed runs start from a warm page cache."""
    return sum(len(p.read_bytes()) for p in paths)


def machine() -> dict:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import cv2
    import numpy

    info = {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "opencv": cv2.__version__,
        "numpy": numpy.__version__,
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info

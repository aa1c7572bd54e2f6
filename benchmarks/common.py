"""Shared pieces of the benchmarks: the dataset they run on and the machine they ran on."""

from __future__ import annotations

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
    """The hardware and software fingerprint, as imfeed-bench writes it."""
    from loader.bench.machine import fingerprint

    return fingerprint()

"""The images a run reads: the user's folder or store, or ImageNet-shaped JPEGs made from
the bundled photographs; the store built once and reused, the page cache warmed."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ingest.format import MANIFEST

CLASSES = 10


@dataclass(frozen=True)
class Data:
    """What the pipelines read: an image folder (None when only a store was given) and a
    store (None when it could not be built), with the number of images and their size."""

    folder: Path | None
    store: Path | None
    images: int
    mean_kib: float
    origin: str


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def prepare(data: Path | None, images: int, workdir: Path, photos: Path | None, say=print) -> Data:
    """Resolve ``--data`` (or make ``images`` JPEGs), build the store if needed, warm both.

    Raises:
        ValueError: ``data`` is neither an image folder nor a store.
    """
    if data is None:
        folder = make_folder(workdir, images, photos, say)
        store, origin = workdir / f"store-{folder.name.removeprefix('images-')}", "generated"
    elif is_store(data):
        folder, store, origin = None, data, "store given"
    elif data.is_dir():
        key = hashlib.sha1(str(data.resolve()).encode()).hexdigest()[:8]
        folder, store, origin = data, workdir / "stores" / f"{data.name}-{key}", "folder given"
    else:
        raise ValueError(
            f"--data {data}: neither an image folder (class sub-folders of images) nor a "
            "store (no manifest.json); give one, or leave --data out to generate images"
        )
    if folder is not None:
        build_store(folder, store, say)
    files = _files(folder) if folder is not None else []
    sizes = sum(len(p.read_bytes()) for p in files)  # reading them warms the page cache
    _warm(store)
    if not files:  # a store alone: its records' sizes stand in for the files'
        count, sizes = _store_sizes(store)
    else:
        count = len(files)
    return Data(folder, store, count, round(sizes / max(count, 1) / 1024, 1), origin)


def make_folder(workdir: Path, images: int, photos: Path | None, say) -> Path:
    """``images`` ImageNet-shaped JPEGs (short side 300-450 px) in 10 classes, made once,
    a class per process."""
    per_class = -(-images // CLASSES)
    folder = workdir / f"images-{CLASSES}x{per_class}"
    stamp = folder / f".made-{photos.name if photos else 'bundled'}"
    if stamp.exists():
        say(f"reusing {CLASSES * per_class} images in {folder}")
        return folder
    say(f"making {CLASSES * per_class} ImageNet-shaped JPEGs in {folder} ...")
    parts = workdir / f".making-{CLASSES}x{per_class}"
    shutil.rmtree(parts, ignore_errors=True)
    jobs = [(parts / str(c), per_class, c, photos) for c in range(CLASSES)]
    workers = min(CLASSES, os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        list(pool.map(_make_class, jobs))
    folder.mkdir(parents=True, exist_ok=True)
    for c in range(CLASSES):  # each part made one class_00: the class it stands for
        os.replace(parts / str(c) / "class_00", folder / f"class_{c:02d}")
    shutil.rmtree(parts)
    stamp.touch()
    return folder


def _make_class(job: tuple) -> None:
    from ingest.synth import make_image_folder

    dst, per_class, seed, photos = job
    make_image_folder(dst, 1, per_class, seed=seed, photos=photos, quality=(90, 97))


def build_store(folder: Path, store: Path, say) -> None:
    """Build ``store`` from ``folder`` unless a complete one is there already."""
    from ingest.build import build

    if is_store(store):
        say(f"reusing the store {store} (delete it to rebuild)")
        return
    say(f"building the store {store} (once; later runs reuse it) ...")
    build(folder, store, workers=os.cpu_count(), progress=False)


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))


def _warm(store: Path) -> None:
    for p in store.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                while f.read(1 << 24):
                    pass


def _store_sizes(store: Path) -> tuple[int, int]:
    from ingest.format import load_index

    index = load_index(store)
    return len(index), int(index["nbytes"].sum())

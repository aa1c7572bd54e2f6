"""The images a run reads: the user's folder or store, or ImageNet-shaped JPEGs made from
the bundled photographs; the store built once and reused, the page cache warmed."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import shutil
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ingest.cores import usable_cores
from ingest.format import MANIFEST, read_manifest
from loader.bench.stores import note_build

CLASSES = 10
SHORT_SIDE = (300, 450)  # ImageNet's shape; larger makes photos as cameras take them


@dataclass(frozen=True)
class Data:
    """What the pipelines read: an image folder (None when only a store was given) and a
    store (None when it could not be built), with the number of images and their size."""

    folder: Path | None
    store: Path | None
    images: int
    mean_kib: float
    origin: str
    kept: int | None = None  # the store's samples: the folder's images less those rejected
    jpeg_store: Path | None = None  # with another encoding: the store of JPEGs beside it


def is_store(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def prepare(
    data: Path | None,
    images: int,
    workdir: Path,
    photos: Path | None,
    say=print,
    max_size: int | None = None,
    short_side: tuple[int, int] = SHORT_SIDE,
    encoding: str = "jpeg",
) -> Data:
    """Resolve ``--data`` (or make ``images`` JPEGs, their short side in ``short_side``),
    build the store if needed, warm both.

    With ``max_size`` the store is built with ``ingest build --max-size``, and its records
    are also written out as an image folder, so that the pipelines reading a folder (PIL,
    DALI) read the same capped images as ours. With an ``encoding`` other than jpeg, ours
    read a store of that encoding, built from the same folder (the peers read its JPEGs).

    Raises:
        ValueError: ``data`` is neither an image folder nor a store, or a store is given
            with ``max_size`` (there is nothing to cap it from).
    """
    if data is None:
        folder = make_folder(workdir, images, photos, say, short_side)
        store, origin = workdir / f"store-{folder.name.removeprefix('images-')}", "generated"
        if short_side != SHORT_SIDE:
            origin += f", short side {short_side[0]}-{short_side[1]} px"
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
    original = folder  # with max_size, peers then read the capped images of an export
    jpeg_store = None
    if max_size is not None:
        if folder is None:
            raise ValueError(
                f"--max-size {max_size} builds a store from images: give --data a folder, "
                "not a store (or leave --data out to generate images)"
            )
        store = store.with_name(f"{store.name}-max{max_size}")
        build_store(folder, store, say, max_size)
        folder = export_store(store, workdir / f"{folder.name}-max{max_size}", say)
        origin += f", capped at {max_size} px"
    elif folder is not None:
        build_store(folder, store, say)
    if encoding != "jpeg":
        if original is None:
            raise ValueError(f"--encoding {encoding} builds a store: give --data a folder")
        jpeg_store, store = store, store.with_name(f"{store.name}-{encoding.replace(':', '')}")
        build_store(original, store, say, max_size, encoding)
        origin += f", stored as {encoding}"
    files = _files(folder) if folder is not None else []
    sizes = sum(len(p.read_bytes()) for p in files)  # reading them warms the page cache
    for kept in {store, jpeg_store} - {None}:
        _warm(kept)
    if not files:  # a store alone: its records' sizes stand in for the files'
        count, sizes = _store_sizes(store)
    else:
        count = len(files)
    kept = read_manifest(store)["num_samples"] if store is not None and is_store(store) else None
    mean_kib = round(sizes / max(count, 1) / 1024, 1)
    return Data(folder, store, count, mean_kib, origin, kept, jpeg_store)


def make_folder(
    workdir: Path,
    images: int,
    photos: Path | None,
    say,
    short_side: tuple[int, int] = SHORT_SIDE,
) -> Path:
    """``images`` JPEGs cut from the photographs (short side in ``short_side``: by default
    ImageNet's 300-450 px) in 10 classes, made once, a class per process."""
    per_class = -(-images // CLASSES)
    size = "" if short_side == SHORT_SIDE else f"-short{short_side[0]}-{short_side[1]}"
    folder = workdir / f"images-{CLASSES}x{per_class}{size}"
    stamp = folder / f".made-{photos.name if photos else 'bundled'}"
    if stamp.exists():
        say(f"reusing {CLASSES * per_class} images in {folder}")
        return folder
    lo, hi = short_side
    say(f"making {CLASSES * per_class} JPEGs (short side {lo}-{hi} px) in {folder} ...")
    parts = workdir / f".making-{CLASSES}x{per_class}{size}"
    shutil.rmtree(parts, ignore_errors=True)
    jobs = [(parts / str(c), per_class, c, photos, short_side) for c in range(CLASSES)]
    workers = min(CLASSES, usable_cores())
    with ProcessPoolExecutor(workers, mp_context=mp.get_context("fork")) as pool:
        list(pool.map(_make_class, jobs))
    folder.mkdir(parents=True, exist_ok=True)
    for c in range(CLASSES):  # each part made one class_00: the class it stands for
        os.replace(parts / str(c) / "class_00", folder / f"class_{c:02d}")
    shutil.rmtree(parts)
    stamp.touch()
    return folder


def _make_class(job: tuple) -> None:
    from loader.bench.synth import make_image_folder

    dst, per_class, seed, photos, short_side = job
    make_image_folder(
        dst, 1, per_class, seed=seed, photos=photos, quality=(90, 97), short_side=short_side
    )


def build_store(
    folder: Path, store: Path, say, max_size: int | None = None, encoding: str = "jpeg"
) -> None:
    """Build ``store`` from ``folder`` unless a complete one is there already."""
    from ingest.build import BuildOptions, build

    if is_store(store):
        say(f"reusing the store {store} (delete it to rebuild)")
        return
    say(f"building the store {store} (once; later runs reuse it) ...")
    options = BuildOptions(max_size=max_size, encoding=encoding)
    t0 = time.perf_counter()
    build(folder, store, options=options, workers=usable_cores(), progress=False)
    note_build(store, time.perf_counter() - t0)  # reported beside the peers' conversions


def export_store(store: Path, folder: Path, say) -> Path:
    """Every record of ``store`` as a file of ``folder`` (its class sub-folders), made once:
    the stored bytes as they are, so a folder reader sees exactly the store's images."""
    from loader.store import Store

    stamp = folder / ".exported"
    if stamp.exists():
        say(f"reusing the images of {store.name} in {folder}")
        return folder
    say(f"writing the images of {store.name} to {folder} ...")
    shutil.rmtree(folder, ignore_errors=True)
    st = Store(store)
    for i, (path, label) in enumerate(zip(st.paths, st.labels.tolist(), strict=True)):
        data, kind = st.image(i)
        dst = (
            folder
            / st.classes[label]
            / Path(path).with_suffix(".png" if kind == "png" else ".jpg").name
        )
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(data)
    stamp.touch()
    return folder


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

"""Shared pieces of the benchmarks: the dataset they run on and the machine they ran on."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED_PHOTOS = REPO.parent / "shared" / "photos"
# ImageNet's training JPEGs average ~110 KB: views of the project's photographs reach it
# at these sizes and qualities (they are smoother than ImageNet's photos, so at a higher
# quality for the same bytes).
IMAGENET_SIZED = {"short_side": (400, 540), "quality": (97, 99)}


def photos_dir() -> Path | None:
    """The project's 33 photographs when checked out beside shared/, else the bundled ten."""
    return SHARED_PHOTOS if SHARED_PHOTOS.is_dir() else None


def make_dataset(root: Path, num_classes: int, per_class: int, seed: int = 0) -> Path:
    """ImageNet-shaped JPEGs (short side 300-450 px) under root/src, made once and reused."""
    from loader.bench.synth import make_image_folder

    src = root / "src"
    stamp = src / f".made-{num_classes}x{per_class}-{seed}"
    if not stamp.exists():
        make_image_folder(src, num_classes, per_class, seed=seed, photos=photos_dir(),
                          quality=(90, 97))  # fmt: skip
        stamp.touch()
    return src


def make_store(
    root: Path, images: int, num_classes: int, shard_size: int | None = None
) -> tuple[Path, Path]:
    """``make_dataset`` of about ``images`` JPEGs and a store built from it (all cores;
    ``shard_size`` in bytes, else the default), both made once and reused: (src, store)."""
    from ingest.build import BuildOptions, build
    from ingest.cores import usable_cores
    from ingest.format import MANIFEST

    per_class = -(-images // num_classes)
    src = make_dataset(root, num_classes, per_class)
    store = root / f"store-{num_classes}x{per_class}{f'-{shard_size}' if shard_size else ''}"
    if not (store / MANIFEST).exists():
        options = BuildOptions(shard_size=shard_size) if shard_size else BuildOptions()
        build(src, store, options, workers=usable_cores(), progress=False, overwrite=True)
    return src, store


def make_imagenet_sized(root: Path, images: int, workers: int, seed: int = 0) -> Path:
    """``images`` JPEGs of ImageNet's mean size (~110 KB) in 10 classes under
    root/src-imagenet-N, made once (on ``workers`` processes) and reused."""
    import cv2

    from loader.bench.synth import sample_photos

    src = root / f"src-imagenet-{images}"
    stamp = src / f".made-{seed}"
    if not stamp.exists():
        counts = [images // 10 + (c < images % 10) for c in range(10)]
        jobs = [(src / f"class_{c:02d}", range(a, min(a + 100, count)), seed, c)
                for c, count in enumerate(counts) for a in range(0, count, 100)]  # fmt: skip
        # Decoded once, here: the forked workers share them.
        _PHOTOS[:] = [cv2.imread(str(p), cv2.IMREAD_COLOR) for p in sample_photos(photos_dir())]
        with mp.get_context("fork").Pool(workers) as pool:
            made = sum(pool.starmap(_write_part, jobs))
        assert made == images, f"made {made} of {images} images"
        stamp.touch()
    return src


_PHOTOS: list = []


def _write_part(folder: Path, numbers: range, seed: int, c: int) -> int:
    import numpy as np

    from loader.bench.synth import write_images

    rng = np.random.default_rng([seed, c, numbers.start])  # the same files for any workers
    return len(write_images(folder, numbers, _PHOTOS, rng, **IMAGENET_SIZED))


def image_files(src: Path) -> list[Path]:
    return sorted(p for p in src.rglob("*") if p.is_file() and not p.name.startswith("."))


def warm(paths: list[Path]) -> int:
    """Read every file once so that all timed runs start from a warm page cache."""
    return sum(len(p.read_bytes()) for p in paths)


def machine() -> dict:
    """The hardware and software fingerprint, as imfeed-bench writes it."""
    from loader.bench.machine import fingerprint

    return fingerprint()


_LIBRARIES = {"opencv": "cv2", "numpy": "numpy", "lmdb": "lmdb", "simplejpeg": "simplejpeg",
              "pillow": "PIL", "msgpack": "msgpack"}  # fmt: skip


def cpu_machine() -> dict:
    """The CPU side of ``machine()``, without importing torch (or the loader)."""
    spec = importlib.util.spec_from_file_location("_machine", REPO / "loader/bench/machine.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # stdlib only at import: not through loader/__init__
    with open("/proc/meminfo") as f:
        mem_kib = int(f.readline().split()[1])
    return {
        "cpu": mod.cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(mem_kib / (1 << 20), 1),
        "python": mod.sys.version.split()[0],
        "platform": mod.platform.platform(),
        **{name: mod._version(module) for name, module in _LIBRARIES.items()},
        "imfeed": mod._imfeed_version(),
    }


def write_result(out: Path, name: str, report: dict) -> Path:
    """Write ``report`` as ``out/name`` (indented JSON), say so, and return the path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return path

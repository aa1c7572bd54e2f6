"""What each pipeline reads, its size on disk and the time it took to make: the image folder
as it is (nothing to make), our store (its build timed once, in a note beside it, since
later runs reuse it), or a peer's conversion (its stamp).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from ingest.format.atomic import write_json_atomic
from loader.bench.peers.conversion import size_of
from loader.bench.pipelines import BASELINE, JPEG_TWIN, PEERS

FOLDER = "image folder"


def _note(store: Path) -> Path:
    return store.with_name(f"{store.name}.built.json")


def note_build(store: Path, seconds: float) -> None:
    """Keep the time ``store`` took to build beside it (the store itself is the format's)."""
    write_json_atomic(_note(store), {"seconds": round(seconds, 2)})


def build_seconds(store: Path) -> float | None:
    """The time ``store`` took to build, where a run of the bench built it; else None."""
    try:
        return json.loads(_note(store).read_text())["seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


@functools.lru_cache(maxsize=8)
def _size(path: str) -> tuple[int, int]:
    return size_of(Path(path))


def described(path: str | None, what: str, seconds: float | None) -> dict | None:
    """The figures of the data at ``path`` for the results (None without a path)."""
    if path is None:
        return None
    size, files = _size(path)
    return {"format": what, "mib": round(size / (1 << 20), 1), "convert_seconds": seconds,
            "files": files}  # fmt: skip


def _store(path: str | None) -> dict | None:
    if path is None:
        return None
    from ingest.format import read_manifest

    encoding = read_manifest(path)["options"].get("encoding", "jpeg")
    return described(path, f"imfeed store ({encoding})", build_seconds(Path(path)))


def of(name: str, settings: dict, made: dict | None) -> dict | None:
    """What pipeline ``name`` reads in a run of ``settings`` (the report's): a peer's
    conversion ``made``, the folder, our store (or its JPEG twin); None for the others."""
    if name in PEERS:
        return made
    if name == BASELINE or name.startswith("dali-"):
        return described(settings["folder"], FOLDER, None)
    if name.endswith(JPEG_TWIN):
        return _store(settings.get("jpeg_store"))
    if name == "torch-lmdb" or name.startswith("loader-"):
        return _store(settings["store"])
    return None

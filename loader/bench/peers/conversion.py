"""A peer's one-time conversion of the run's image folder into its own format.

Made once per folder and recipe, then reused: a later run reports the time the conversion
took when it was made. The data first, the stamp (what was made, from what, how long it
took, how large it is) last and atomically, so that a conversion cut short never looks
complete and is made again.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from ingest.format.atomic import write_json_atomic
from loader.bench.settings import Settings

STAMP = "converted.json"
MARK = ".made-by-imfeed-bench"  # ".FMT" + MARK, beside FMT first: the bench may remake FMT


def samples(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """``(path, label)`` of every image of ``folder``, with torchvision ImageFolder's labels
    (those the baseline reads), in a seeded random order: the peers' ImageNet converters
    write the samples shuffled, so that a shard holds many classes."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    _, index = find_classes(str(folder))
    found = make_dataset(str(folder), index, extensions=IMG_EXTENSIONS)
    random.Random(0).shuffle(found)
    return found


def place(s: Settings, fmt: str) -> Path:
    """Where the conversion ``fmt`` of ``s.folder`` lives: under ``s.workdir``, beside the
    run's generated images and stores."""
    if not s.workdir:  # never beside the user's images (a read-only mount, a shared set)
        raise ValueError("a peer's conversion needs Settings.workdir: where to keep it")
    folder = Path(s.folder).resolve()
    key = hashlib.sha1(str(folder).encode()).hexdigest()[:8]
    return Path(s.workdir) / "peers" / f"{folder.name}-{key}" / fmt


def size_of(path: Path) -> tuple[int, int]:
    """(bytes, files) of the regular files under ``path``: what a format holds, its hidden
    files (locks, notes) and a conversion's stamp left out."""
    files = [
        p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".") and p.name != STAMP
    ]
    return sum(p.stat().st_size for p in files), len(files)


def _signature(found: list[tuple[str, int]]) -> list:
    """The folder as a conversion saw it: how many images, and a digest of each one's path,
    label, size and time of change (an image moved, swapped or rewritten: converted again)."""
    digest = hashlib.sha1()
    for path, label in found:
        st = os.stat(path)
        digest.update(f"{path}\0{label}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return [len(found), digest.hexdigest()]


def made(s: Settings, fmt: str, recipe: dict, signature: list | None = None) -> dict | None:
    """The stamp of a complete conversion ``fmt`` of ``s.folder`` with ``recipe``, or None
    (``signature``: the folder's, where the caller has it)."""
    try:
        stamp = json.loads((place(s, fmt) / STAMP).read_text())
    except (OSError, ValueError):
        return None
    if signature is None:
        signature = _signature(samples(s.folder))
    if stamp.get("recipe") != recipe or stamp.get("signature") != signature:
        return None
    return stamp


def convert(
    s: Settings, fmt: str, recipe: dict, write: Callable[[list[tuple[str, int]], Path], int]
) -> dict:
    """Convert ``s.folder`` into ``fmt`` with ``write(samples, out)`` unless a complete
    conversion with the same ``recipe`` is there; return its stamp, with ``reused``.

    ``recipe`` says how the format was written (it must be JSON); a change makes it anew.
    ``write`` returns the samples its output holds, as read back from it (its index).

    Raises:
        RuntimeError: the output holds another number of samples than the folder.
    """
    found = samples(s.folder)
    signature = _signature(found)
    stamp = made(s, fmt, recipe, signature)
    if stamp is not None:
        return stamp | {"reused": True}
    out = place(s, fmt)
    _clear(out)
    t0 = time.perf_counter()
    wrote = write(found, out)
    seconds = time.perf_counter() - t0
    if wrote != len(found):
        raise RuntimeError(
            f"{out}: the {fmt} converter wrote {wrote} samples of the {len(found)} images of "
            f"{s.folder}; see its output above for why"
        )
    size, files = size_of(out)
    stamp = {
        "format": fmt,
        "recipe": recipe,
        "folder": str(Path(s.folder).resolve()),
        "signature": signature,
        "samples": len(found),
        "seconds": round(seconds, 2),
        "bytes": size,
        "files": files,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    write_json_atomic(out / STAMP, stamp)
    return stamp | {"reused": False}


def _clear(out: Path) -> None:
    """Make ``out`` an empty folder marked as this bench's; what was there goes only where
    the bench made it (a conversion cut short), never a folder of someone else's."""
    mark = out.parent / f".{out.name}{MARK}"  # beside it: some writers want an empty folder
    if out.exists():
        if not mark.exists():
            raise RuntimeError(
                f"{out} exists and was not made by imfeed-bench: move it away, or pass "
                "another --workdir"
            )
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    mark.touch()
    out.mkdir()


def summary(stamp: dict, what: str) -> dict:
    """A conversion's figures for the results: ``what`` it is, MiB, seconds, files."""
    return {
        "format": what,
        "mib": round(stamp["bytes"] / (1 << 20), 1),
        "convert_seconds": stamp["seconds"],
        "files": stamp["files"],
        "reused": stamp["reused"],
    }

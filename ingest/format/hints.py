"""What to do about a folder that is not a complete store: the hint ``read_manifest`` adds
to its error (a build writing it now, one that failed, one cut short, an image folder)."""

from __future__ import annotations

import itertools
import json
import os
import shlex
from pathlib import Path

from ingest.format.layout import BUILD_STATE, IMAGE_EXTENSIONS, MANIFEST, REJECTS, STAGING_DIR
from ingest.format.lock import holder
from ingest.format.safeio import FileRefused, read_regular


def missing_manifest_hint(root: Path) -> str:
    """Why ``root`` has no manifest and what to do, as " (...)"; "" where nothing is known."""
    if who := holder(root):
        return f" (`ingest build` is writing it now, {who}: wait for it to end)"
    if _failed_build(root):
        return (f" (its last build found no valid image: the reasons are in "
                f"{root / REJECTS}; mend the source and build again)")  # fmt: skip
    if os.path.exists(root / STAGING_DIR / MANIFEST):
        return (" (an --overwrite build was cut short as its new store replaced the old "
                "one: run the same `ingest build --overwrite` again to finish it)")  # fmt: skip
    if (root / BUILD_STATE).exists():
        return " (an interrupted build: run the same `ingest build` again to resume)"
    if looks_like_image_folder(root):  # the likeliest slip when swapping in a store
        return (f" (it is an image folder: convert it once with `{_build_command(root)}` "
                "and give that store instead)")  # fmt: skip
    return ""


def looks_like_image_folder(root: Path, peek: int = 64) -> bool:
    """Whether ``root`` holds image files, in it or in its first 8 subfolders (ImageFolder's
    layout), judged from at most ``peek`` entries of each."""
    folders = [root]
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                for entry in itertools.islice(entries, peek):
                    if entry.name.lower().endswith(IMAGE_EXTENSIONS):
                        return True
                    if folder == root and len(folders) < 9 and entry.is_dir():
                        folders.append(Path(entry.path))
        except OSError:
            continue
    return False


def _build_command(folder: Path) -> str:
    """The command that converts ``folder`` into a store beside it (outside it, which the
    build requires), as a shell takes it; relative where ``folder`` was given so."""
    real = folder.resolve()
    out = real.parent / f"{real.name or 'images'}.lmdb"
    shown = out if folder.is_absolute() else os.path.relpath(out)
    return f"ingest build {shlex.quote(str(folder))} {shlex.quote(str(shown))}"


def _failed_build(root: Path) -> bool:
    """Whether ``root`` holds the state of a build that found no valid image."""
    try:
        state = json.loads(read_regular(root / BUILD_STATE, 1 << 20))
    except (OSError, ValueError, FileRefused):  # none, or not ours to judge: not failed
        return False
    return isinstance(state, dict) and state.get("failed") is True

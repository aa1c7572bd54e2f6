"""Walk an ImageFolder-layout source tree into its classes and sorted (path, label) items."""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ingest.format.layout import (
    BUILD_STATE,
    FORMAT_NAME,
    IMAGE_EXTENSIONS,
    INDEX,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    PARTIAL_DIR,
)

SYSTEM_FILES = {"thumbs.db", "desktop.ini", "ehthumbs.db", "icon\r"}


@dataclass
class Scan:
    root: Path
    classes: list[str]
    items: list[tuple[str, int]]  # (path relative to root, POSIX separators; label)
    ignored: Counter = field(default_factory=Counter)  # reason -> count
    skipped: list[tuple[str, str]] = field(default_factory=list)  # folders not walked, why

    @property
    def num_ignored(self) -> int:
        return sum(self.ignored.values())


class SourceError(ValueError):
    """SRC is not a usable ImageFolder tree."""


def scan(root: str | os.PathLike) -> Scan:
    """List ``root`` the way ``torchvision.datasets.ImageFolder`` does.

    Classes are the sorted names of the sub-directories of ``root`` (hidden ones excepted);
    items are every image file below each class directory, nested folders included,
    ordered as ImageFolder orders them, so index i here is index i there. Hidden and
    system files, and files without an image extension, are counted in ``ignored``.

    Directory links are followed, but a folder is walked once: a link to a folder already
    walked (an ancestor, a class folder, another link's target) is listed in ``skipped``,
    where ImageFolder would walk it again, or forever. So are stores (``ingest build``
    output) found inside ``root``. Names that are not UTF-8 come as ``os.walk`` gives them
    (undecodable bytes as surrogate escapes; see ``ingest.format.path_value``).

    Raises:
        SourceError: ``root`` is missing, not a directory, a store (or a build of one), or
            has no class directories.
    """
    root = Path(root)
    if not root.exists():
        raise SourceError(f"source {root} does not exist; pass the image folder to convert")
    if not root.is_dir():
        raise SourceError(f"source {root} is not a directory; pass the image folder to convert")
    if _is_store(root):  # its shard folders would be classes of no image
        raise SourceError(
            f"source {root} is the output of `ingest build` (a store, or a build of one), "
            "not an image folder; pass the image folder it was built from"
        )
    result = Scan(root, [], [])
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                is_dir = _is_dir(entry)
                if is_dir and _is_store(entry.path):
                    result.skipped.append(
                        (entry.name, "a store (ingest build output), not a class")
                    )
                elif is_dir and not entry.name.startswith("."):
                    result.classes.append(entry.name)
                elif is_dir:
                    result.ignored["hidden folder"] += _count_files(entry.path)
                else:
                    result.ignored["file outside class folders"] += 1
    except OSError as e:
        raise SourceError(
            f"source {root} cannot be read ({e.strerror or e}); give this user access to it"
        ) from None
    result.classes.sort()
    if not result.classes:
        raise SourceError(
            f"source {root} has no class folders; expected the ImageFolder layout "
            f"{root}/CLASS_NAME/IMAGE.jpg"
        )
    # A class folder is walked as a class, never through a link from elsewhere.
    walked = {_dir_id(root): "the source folder"}
    for name in result.classes:
        with contextlib.suppress(OSError):  # unreachable: walking it says why (_walk)
            walked[_dir_id(root / name)] = name
    for label, name in enumerate(result.classes):
        _scan_class(root, name, label, result, walked)
    return result


def _scan_class(root: Path, name: str, label: int, result: Scan, walked: dict) -> None:
    # Sorted by directory path as torchvision sorts os.walk's tuples, so the order matches.
    for dirpath, fnames in sorted(_walk(root, root / name, result, walked)):
        rel_dir = Path(dirpath).relative_to(root)
        hidden_dir = any(part.startswith(".") for part in rel_dir.parts)
        prefix = rel_dir.as_posix() + "/"  # not pathlib per file: the scan runs on one core
        for fname in sorted(fnames):
            reason = _ignore_reason(fname, hidden_dir)
            if reason:
                result.ignored[reason] += 1
            else:
                result.items.append((prefix + fname, label))


def _walk(root: Path, top: Path, result: Scan, walked: dict) -> list[tuple[str, list[str]]]:
    """(directory, its non-directory entries) for ``top`` and every folder below it, links
    followed, each real folder once; folders not walked go to ``result.skipped``."""
    out, stack = [], [top]
    while stack:
        path = stack.pop()
        files = []
        try:
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as e:
            result.skipped.append((_rel(root, path), f"unreadable folder: {e.strerror or e}"))
            continue
        for entry in entries:
            if not _is_dir(entry):  # files, and anything else (FIFOs, broken links): read later
                files.append(entry.name)
                continue
            rel = _rel(root, entry.path)
            try:
                key = _dir_id(entry.path)
            except FileNotFoundError:  # gone since the listing: its files are not seen
                continue
            except OSError as e:  # a name too long to reach, a folder this user cannot
                result.skipped.append((rel, f"unreadable folder: {e.strerror or e}"))
                continue
            if key in walked:
                what = "a link to a folder" if entry.is_symlink() else "a folder"
                result.skipped.append((rel, f"{what} walked already ({walked[key]})"))
            elif _is_store(entry.path):
                result.skipped.append((rel, "a store (ingest build output), not images"))
            else:
                walked[key] = rel
                stack.append(Path(entry.path))
        out.append((str(path), files))
    return out


def _is_dir(entry: os.DirEntry) -> bool:
    """A directory, links followed; a link loop or a vanished entry is not (it is read as a
    file later, and rejected with the reason)."""
    try:
        return entry.is_dir()
    except OSError:
        return False


def _dir_id(path: str | os.PathLike) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _rel(root: Path, path: str | os.PathLike) -> str:
    return Path(path).relative_to(root).as_posix()


def _is_store(path: str) -> bool:
    """A store or an interrupted build: never a class folder or images to convert. A file
    named manifest.json alone does not make one (a class folder may hold any file): the
    manifest must be a store's, or unreadable beside a store's index."""
    if any(os.path.exists(os.path.join(path, n)) for n in (BUILD_STATE, PARTIAL_DIR)):
        return True
    manifest = os.path.join(path, MANIFEST)
    try:
        st = os.stat(manifest)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MANIFEST_BYTES:  # a FIFO would hang
        return False
    try:
        with open(manifest, "rb") as f:
            found = json.load(f)
    except (OSError, ValueError, RecursionError):  # not JSON: a damaged store's, or not one
        return os.path.exists(os.path.join(path, INDEX))
    return isinstance(found, dict) and found.get("format") == FORMAT_NAME


def _ignore_reason(fname: str, hidden_dir: bool) -> str | None:
    if hidden_dir or fname.startswith(".") or fname.lower() in SYSTEM_FILES:
        return "hidden or system file"
    if not fname.lower().endswith(IMAGE_EXTENSIONS):
        return "not an image file (extension)"
    return None


def _count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))

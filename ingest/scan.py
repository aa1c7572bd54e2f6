"""Walk an ImageFolder-layout source tree into its classes and sorted (path, label) items."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# torchvision's IMG_EXTENSIONS plus GIF and JFIF; matched case-insensitively, as it does.
IMAGE_EXTENSIONS = (
    ".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp", ".gif", ".jfif",
)  # fmt: skip
SYSTEM_FILES = {"thumbs.db", "desktop.ini", "ehthumbs.db", "icon\r"}


@dataclass
class Scan:
    root: Path
    classes: list[str]
    items: list[tuple[str, int]]  # (path relative to root, POSIX separators; label)
    ignored: Counter = field(default_factory=Counter)  # reason -> count

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

    Raises:
        SourceError: ``root`` is missing, not a directory, or has no class directories.
    """
    root = Path(root)
    if not root.exists():
        raise SourceError(f"source {root} does not exist; pass the image folder to convert")
    if not root.is_dir():
        raise SourceError(f"source {root} is not a directory; pass the image folder to convert")
    result = Scan(root, [], [])
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.is_dir() and not entry.name.startswith("."):
                result.classes.append(entry.name)
            elif entry.is_dir():
                result.ignored["hidden folder"] += _count_files(entry.path)
            else:
                result.ignored["file outside class folders"] += 1
    result.classes.sort()
    if not result.classes:
        raise SourceError(
            f"source {root} has no class folders; expected the ImageFolder layout "
            f"{root}/CLASS_NAME/IMAGE.jpg"
        )
    for label, name in enumerate(result.classes):
        _scan_class(root, name, label, result)
    return result


def _scan_class(root: Path, name: str, label: int, result: Scan) -> None:
    for dirpath, _, fnames in sorted(os.walk(root / name, followlinks=True)):
        rel_dir = Path(dirpath).relative_to(root)
        hidden_dir = any(part.startswith(".") for part in rel_dir.parts)
        for fname in sorted(fnames):
            reason = _ignore_reason(fname, hidden_dir)
            if reason:
                result.ignored[reason] += 1
            else:
                result.items.append(((rel_dir / fname).as_posix(), label))


def _ignore_reason(fname: str, hidden_dir: bool) -> str | None:
    if hidden_dir or fname.startswith(".") or fname.lower() in SYSTEM_FILES:
        return "hidden or system file"
    if not fname.lower().endswith(IMAGE_EXTENSIONS):
        return "not an image file (extension)"
    return None


def _count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))

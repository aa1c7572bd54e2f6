"""OUT for one build: refuse what is not ours, own it alone, replace a store only when whole.

One build at a time writes OUT (``BuildLock``). With --overwrite the new store is built in
OUT/.overwrite beside the old one, which stays whole and readable until the new one is
complete; then ``swap_in`` sets the old store's files aside, moves the new ones in (the
manifest last) and deletes what it set aside. A swap cut short is finished by the next
build of OUT. Nothing is deleted that a build did not write: only ``fmt.own_entries``,
never OUT itself (it may be a symlink, or hold the user's own files).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

from ingest import format as fmt
from ingest.build.resume import OutputError
from ingest.format.lock import LOCK, BuildLock, Busy


class Claim:
    """One build's hold on OUT: ``check`` (before the scan: nothing is written), ``take``
    (the lock; the directory the build writes), ``commit`` (a staged store replaces the
    old one), ``release`` (the lock, at the end, whatever happened)."""

    def __init__(self, src: Path, out: Path, overwrite: bool) -> None:
        self.src, self.out, self.overwrite = Path(src), Path(out), overwrite
        self.lock: BuildLock | None = None
        self.target = self.out
        self.swapped = False  # take() finished a swap an earlier --overwrite cut short

    def check(self) -> None:
        """Refuse an OUT that overlaps SRC, is a file, or is a folder that is not ours."""
        check_apart(self.src, self.out)
        out = self.out
        if out.exists() and not out.is_dir():
            raise OutputError(f"output {out} is a file; pass a directory path for the store")
        if out.is_dir() and not _ours(out):
            raise OutputError(
                f"output {out} is a non-empty directory that is not a store; "
                "choose a new or empty directory"
            )

    def take(self) -> Path:
        """Lock OUT and return the directory this build writes: OUT, or OUT/.overwrite
        where OUT holds a complete store that --overwrite replaces."""
        out = self.out
        out.mkdir(parents=True, exist_ok=True)
        lock = BuildLock(out)
        try:
            lock.__enter__()
        except Busy as e:
            raise OutputError(
                f"output {out} is being written by another `ingest build` ({e}); wait for it "
                "to end, or stop it and run this command again"
            ) from None
        self.lock = lock
        self.check()  # again, now that no other build can change it
        self.swapped = finish_swap(out)
        staged = out / fmt.STAGING_DIR
        if (out / fmt.MANIFEST).exists():
            if not self.overwrite:
                again = (" (an --overwrite build of it was interrupted: pass --overwrite to "
                         "resume it)") if (staged / fmt.BUILD_STATE).exists() else ""  # fmt: skip
                raise OutputError(
                    f"output {out} is already a complete store{again}; pass --overwrite to "
                    "replace it"
                )
            staged.mkdir(exist_ok=True)
            self.target = staged
        elif staged.is_dir():  # the store it was to replace is gone: build OUT itself
            _remove(staged)
        return self.target

    def finished(self, build: str) -> dict | None:
        """The manifest of the store that take() swapped in, where it is the build
        ``build`` (the one asked for again: nothing left to do); else None."""
        if not self.swapped:
            return None
        manifest = fmt.read_manifest(self.out)
        if manifest.get("build") != build:
            return None
        if self.target != self.out:
            _remove(self.target)  # the staging folder take() made for a new build
            self.target = self.out
        return manifest

    def commit(self) -> None:
        """After the build: a staged store replaces the old one."""
        if self.target != self.out:
            swap_in(self.out)

    def release(self) -> None:
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None


def check_apart(src: Path, out: Path) -> None:
    """Refuse an OUT inside SRC (the build would read its own output, and every later
    build of SRC find a class named after the store) and a SRC inside OUT (a build
    writes and replaces OUT's files: the images must not live among them)."""
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    common = os.path.commonpath([real_src, real_out])
    if common == real_src:
        raise OutputError(
            f"output {out} is inside the source folder {src}; put the store outside it "
            "(e.g. next to it)"
        )
    if common == real_out:
        raise OutputError(
            f"source {src} is inside the output {out}; move the image folder out of the "
            "store's directory (e.g. next to it), then build again"
        )


# A build's own names, seen also mid-write (another build's state as it is first written).
_BUILD_ONLY = {fmt.BUILD_STATE, f"{fmt.BUILD_STATE}.tmp", fmt.PARTIAL_DIR, fmt.STAGING_DIR,
               fmt.RETIRED_DIR}  # fmt: skip


def _ours(out: Path) -> bool:
    """Whether ``out`` is empty (but for a build lock), a store, or a build's: a
    manifest.json of another program's does not make a folder ours."""
    names = set(os.listdir(out)) - {LOCK}
    if not names or names & _BUILD_ONLY:  # names no other program writes
        return True
    if fmt.MANIFEST not in names:
        return False
    shards = any(name.startswith("shard-") for name in fmt.own_entries(out))
    return shards or _a_store_manifest(out / fmt.MANIFEST)  # a damaged one has its shards


def _a_store_manifest(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read(fmt.MAX_MANIFEST_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and obj.get("format") == fmt.FORMAT_NAME


def finish_swap(out: Path) -> bool:
    """Finish what a swap cut short left: the new store in (whether or not the old one's
    manifest was set aside yet: the staged store is complete), or the old one's files gone.
    Whether it moved a new store in."""
    if (out / fmt.STAGING_DIR / fmt.MANIFEST).exists():
        swap_in(out)
        return True
    if (out / fmt.RETIRED_DIR).is_dir():
        _remove(out / fmt.RETIRED_DIR)
    return False


def swap_in(out: Path) -> None:
    """Replace the store in ``out`` by the complete one in ``out``/.overwrite; safe to run
    again after a crash at any point of it (the new store's files are told from the old
    ones by the new manifest)."""
    staged, retired = out / fmt.STAGING_DIR, out / fmt.RETIRED_DIR
    with open(staged / fmt.MANIFEST, encoding="utf-8") as f:
        manifest = json.load(f)
    new = {s["name"] for s in manifest["shards"]}
    new |= {manifest[k]["file"] for k in ("index", "paths", "rejects") if k in manifest}
    retired.mkdir(exist_ok=True)
    if (out / fmt.MANIFEST).exists():  # first: from here OUT is not a complete store
        os.replace(out / fmt.MANIFEST, retired / fmt.MANIFEST)
        fmt.fsync_path(out)
    for name in fmt.own_entries(out):
        if name in new and not (staged / name).exists():
            continue  # the new store's, moved in before a crash
        _move(out / name, retired / name)
    for name in fmt.own_entries(staged):
        if name != fmt.MANIFEST:
            _move(staged / name, out / name)
    os.replace(staged / fmt.MANIFEST, out / fmt.MANIFEST)  # last: the new store is complete
    fmt.fsync_path(out)
    _remove(staged)
    _remove(retired)


def _move(src: Path, dst: Path) -> None:
    if dst.is_dir() and not dst.is_symlink():  # set aside by a swap that crashed
        shutil.rmtree(dst)
    os.replace(src, dst)


def _remove(folder: Path) -> None:
    """Delete a build's folder: its own entries, then the folder where nothing else is left."""
    for name in fmt.own_entries(folder):
        fmt.remove_entry(folder / name)
    with contextlib.suppress(OSError):  # something of the user's is in it: kept
        folder.rmdir()

"""The OUT directory across runs: refuse what is not ours, resume what was interrupted.

A build records its sealed progress in OUT/.build-state.json after every shard; its
fingerprint (inputs, their sizes and mtimes, the options that decide the content) says
whether a later run of the same command may resume from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

from ingest import format as fmt
from ingest.scan import Scan

log = logging.getLogger(__name__)


class OutputError(ValueError):
    """OUT cannot be written as asked (exists, is a file, is someone else's directory)."""


def prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise OutputError(f"output {out} is a file; pass a directory path for the store")
    if (out / fmt.MANIFEST).exists():
        if not overwrite:
            raise OutputError(
                f"output {out} is already a complete store; pass --overwrite to replace it"
            )
        (out / fmt.MANIFEST).unlink()  # first, so a crash mid-delete never looks complete
        shutil.rmtree(out)
    elif out.is_dir() and any(out.iterdir()) and not (out / fmt.BUILD_STATE).exists():
        raise OutputError(
            f"output {out} is a non-empty directory that is not a store; "
            "choose a new or empty directory"
        )
    out.mkdir(parents=True, exist_ok=True)


def check_out_outside(src: Path, out: Path) -> None:
    """Refuse an OUT inside SRC: this build would read its own output, and every later
    build of SRC would find a class named after the store."""
    real_src, real_out = os.path.realpath(src), os.path.realpath(out)
    if os.path.commonpath([real_src, real_out]) == real_src:
        raise OutputError(
            f"output {out} is inside the source folder {src}; put the store outside it "
            "(e.g. next to it)"
        )


def fingerprint(tree: Scan, options: dict) -> str:
    """Digest of what decides a build's content: inputs with their sizes and mtimes, options.

    It is also the build's identity (the manifest's "build"). A file that cannot be
    stat'ed (a broken link, a link loop, a file deleted since the scan) enters with the
    error's number: the worker that reads it rejects it with the reason.
    """
    h = hashlib.sha256()
    h.update(json.dumps([fmt.FORMAT_VERSION, options, tree.classes]).encode())
    root = str(tree.root)
    for rel, label in tree.items:
        try:
            st = os.stat(os.path.join(root, rel))
            facts = f"{st.st_size}\0{st.st_mtime_ns}"
        except OSError as e:
            facts = f"error {e.errno}"
        h.update(os.fsencode(rel) + f"\0{label}\0{facts}\n".encode())
    return h.hexdigest()


def fresh_state(digest: str) -> dict:
    return {"fingerprint": digest, "cursor": 0, "shards": [], "rejects": [], "stats": {}}


def load_state(out: Path, digest: str) -> dict:
    """The sealed progress of an interrupted build of the same inputs, else a fresh start."""
    path = out / fmt.BUILD_STATE
    state = None
    if path.exists():
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("fingerprint") != digest:
            log.warning("ingest: %s holds an interrupted build of other inputs; starting over", out)
            state = None
    if state is None:
        for child in out.iterdir():  # only our own leftovers can be here (see _prepare_out)
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        state = fresh_state(digest)
        fmt.write_json_atomic(path, state)
    sealed = {s["name"] for s in state["shards"]}
    for child in out.glob("shard-*"):
        if child.name not in sealed:  # renamed into place, but the state never recorded it
            shutil.rmtree(child)
    return state

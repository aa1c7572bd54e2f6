"""A build's progress across runs: resume what was interrupted, start over what differs.

A build records its sealed progress in OUT/.build-state.json after every shard; its
fingerprint (inputs, their sizes and mtimes, the options that decide the content) says
whether a later run of the same command may resume from it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

from ingest import format as fmt
from ingest.build.scan import Scan

log = logging.getLogger(__name__)


class OutputError(ValueError):
    """OUT cannot be written as asked (exists, is a file, is someone else's directory)."""


def fingerprint(tree: Scan, options: dict, facts: Iterable[bytes] | None = None) -> dict:
    """What decides a build's content (JSON-able): the format version, the converter's
    version, the options, the classes and a digest of the inputs with their sizes and
    mtimes. ``identity`` of it is
    the build's identity (the manifest's "build").

    Args:
        facts: ``file_facts`` of consecutive runs of ``tree.items``, in order (default:
            made here; a local build makes them on its workers).
    """
    if facts is None:
        root, items = str(tree.root), tree.items
        facts = (file_facts(root, items[a : a + 10_000]) for a in range(0, len(items), 10_000))
    h = hashlib.sha256()
    for chunk in facts:
        h.update(chunk)
    digest = {
        "version": fmt.written_version(options.get("encoding", "jpeg")),
        "converter": fmt.CONVERTER_VERSION, "options": options,
        "classes": tree.classes, "files": len(tree.items), "inputs": h.hexdigest(),
    }  # fmt: skip
    return json.loads(json.dumps(digest))  # as the state file gives it back (lists, not tuples)


def file_facts(root: str, items: list[tuple[str, int]]) -> bytes:
    """What a fingerprint takes of each item: its path, label, size and mtime, one line each.

    A file that cannot be stat'ed (a broken link, a link loop, a file deleted since the
    scan) enters with the error's number: the worker that reads it rejects it with the
    reason.
    """
    lines = []
    for rel, label in items:
        try:
            st = os.stat(os.path.join(root, rel))
            facts = f"{st.st_size}\0{st.st_mtime_ns}"
        except OSError as e:
            facts = f"error {e.errno}"
        lines.append(os.fsencode(rel) + f"\0{label}\0{facts}\n".encode())
    return b"".join(lines)


def identity(digest: dict) -> str:
    """The build identity (ASCII hex) of a ``fingerprint``: same inputs, same identity."""
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()


def difference(old, new: dict) -> str:
    """What differs between two fingerprints, in the user's terms (options as flags)."""
    if not isinstance(old, dict) or old.keys() != new.keys():
        return "made by another version of ingest"
    if old["converter"] != new["converter"]:
        return "made by another version of ingest (its converter stores other bytes)"
    was, now = _options(old), _options(new)
    options = [f"{_flag(k, was.get(k))} then, {_flag(k, now.get(k))} now"
               for k in sorted(was.keys() | now.keys()) if was.get(k) != now.get(k)]  # fmt: skip
    if options:  # before the version: --encoding decides it
        return "with other options (" + "; ".join(options) + ")"
    if old["version"] != new["version"]:
        return f"of store format v{old['version']} (this ingest writes v{new['version']})"
    if old["classes"] != new["classes"]:
        return f"of other class folders ({len(old['classes'])} then, {len(new['classes'])} now)"
    return (
        f"of other source files ({old['files']} then, {new['files']} now, or files were "
        "changed, renamed or touched since)"
    )


def _options(digest: dict) -> dict:
    """A fingerprint's options, with the encoding a JPEG build leaves out."""
    options = digest["options"] if isinstance(digest.get("options"), dict) else {}
    return {"encoding": "jpeg", **options}


def _flag(option: str, value) -> str:
    """An output-affecting option as the `ingest build` flag that sets it."""
    if option == "verify":
        return "--no-verify" if value is False else "verification on"
    if option == "shard_size" and isinstance(value, int) and value % 1024 == 0:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"--shard-size {value // size}{unit}"
    return f"--{option.replace('_', '-')} {value}"


def fresh_state(digest: dict, mode: str = "local") -> dict:
    state = {"fingerprint": digest, "cursor": 0, "shards": [], "rejects": [], "stats": {}}
    if mode != "local":  # a local build's state keeps the shape older versions wrote
        state["mode"] = mode
    return state


def load_state(out: Path, digest: dict, mode: str = "local") -> dict:
    """The sealed progress of an interrupted build of the same inputs, else a fresh start;
    logs which one, and what differs when an interrupted build is discarded.

    ``mode`` is "local" or "ray": a local build seals shards in order and resumes from a
    cursor, a Ray build seals them in any order; neither resumes the other's progress.
    """
    path = out / fmt.BUILD_STATE
    state = None
    if path.exists():
        with open(path, encoding="utf-8") as f:
            state = json.load(f)
        if state.get("failed"):  # found no valid image: nothing to resume, nothing to say
            state = None
        elif state.get("fingerprint") != digest:
            why = difference(state.get("fingerprint"), digest)
            log.warning("ingest: %s holds an interrupted build %s; starting over", out, why)
            state = None
        elif state.get("mode", "local") != mode:
            made = "with --ray" if mode == "local" else "without --ray"
            log.warning("ingest: %s holds an interrupted build made %s; starting over", out, made)
            state = None
        elif mode == "ray" and state["shards"]:
            log.warning(
                "ingest: resuming the interrupted build in %s: %d sealed shard(s) of %d images",
                out, len(state["shards"]), state["cursor"],
            )  # fmt: skip
        elif state["cursor"]:
            log.warning(
                "ingest: resuming the interrupted build in %s: %d of %d images were done, in "
                "%d sealed shard(s)", out, state["cursor"], digest["files"], len(state["shards"]),
            )  # fmt: skip
    sealed = set() if state is None else {s["name"] for s in state["shards"]}
    for name in fmt.own_entries(out):  # never what a build did not write (outdir.Claim)
        if name not in sealed and (name.startswith("shard-") or state is None):
            fmt.remove_entry(out / name)  # a shard renamed into place but never recorded
    if state is None:
        state = fresh_state(digest, mode)
        fmt.write_json_atomic(path, state)
    return state

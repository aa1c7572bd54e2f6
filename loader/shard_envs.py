"""The LMDB environments of a store's shards: one per shard file and process, checked.

LMDB forbids opening an environment twice in one process (py-lmdb refuses), so every
``Store`` of a process shares one per file, held weakly: it closes with the last Store
using it. A forked child drops all of the parent's handles, those of every Store it
inherited, before it opens its own (fork hygiene).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import NamedTuple

import lmdb

from ingest import format as fmt
from ingest.format import pages


class Opened(NamedTuple):
    """A shard's environment in one process, and the cache's copy it maps, if any."""

    env: lmdb.Environment
    copy: Path | None = None  # the copy's data.mdb; None: the store's own shard
    ident: tuple | None = None  # the copy's identity (``pages.identity``) when opened


_ENVS: weakref.WeakValueDictionary[tuple, lmdb.Environment] = weakref.WeakValueDictionary()
_LIVE: weakref.WeakSet = weakref.WeakSet()  # the Stores of this process


def track(store) -> None:
    """Have ``store`` let go of its environments (``store.close()``) in a forked child."""
    _LIVE.add(store)


def env_key(path: Path) -> str:
    return os.path.realpath(path)


def identity(path: Path) -> tuple | None:
    try:
        return pages.identity(path)
    except OSError:  # gone
        return None


def open_env(key: str) -> lmdb.Environment:
    """The environment of the shard directory ``key`` (a real path), opened once per process
    and file (as LMDB requires: a copy replaced at the same path is another file)."""
    ident = identity(Path(key) / "data.mdb")
    file = (key, *ident[:2]) if ident else (key,)
    env = _ENVS.get(file)
    if env is None:
        env = pages.open_lmdb(
            key, readonly=True, lock=False, readahead=False, subdir=True,
            max_readers=1, max_spare_txns=1,
        )  # fmt: skip
        _ENVS[file] = env
    return env


def check_build(env: lmdb.Environment, manifest: dict, where: Path) -> None:
    """Raise StoreError unless the shard ``env`` was written by the manifest's build.

    A version 1 store records no build identity: nothing to check.
    """
    if "build" not in manifest:
        return
    with env.begin() as txn:
        build = txn.get(fmt.BUILD_KEY)
    if build != manifest["build"].encode():  # the manifest on disk the same: not a rebuild
        raise fmt.StoreError(
            f"{where}: written by another build than the store's manifest (a mixed store, "
            "or damaged pages LMDB reads as an older state); rebuild the store"
        )


def rebuilt(where: Path) -> str:
    """The message for the store's file ``where`` changed by a rebuild since it was opened."""
    return (
        f"{where}: written by another build than the store's manifest (the store was "
        "rebuilt or changed since it was opened); open the store again"
    )


def _forget_parent_envs() -> None:
    for store in list(_LIVE):
        store.close()
    _ENVS.clear()


os.register_at_fork(after_in_child=_forget_parent_envs)

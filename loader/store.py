"""Fork-safe, read-only access to a store's shards; LMDB handles open lazily in each process."""

from __future__ import annotations

import os
import weakref
from functools import cached_property
from pathlib import Path

import lmdb
import msgpack
import numpy as np

from ingest import format as fmt
from ingest.codec import image_bytes, unpack_record


class Store:
    """A complete store opened for reading.

    Safe to pickle (for ``spawn`` workers) and to use after ``fork``: LMDB environments
    are opened on first use in each process, read-only and without a lock file, so a
    store on a read-only filesystem reads fine. The index is memory-mapped.

    Args:
        root: the store directory.
        cache: where to open each shard from, e.g. an ``ingest.shmcache.ShmCache``: its
            ``shard_path(shard)`` gives the shard directory to open (a RAM copy or the
            original), asked once per shard and process.

    Raises:
        ingest.format.StoreError: ``root`` is not a complete store.
    """

    def __init__(self, root: str | os.PathLike, cache=None) -> None:
        self.root = Path(root)
        self.cache = cache
        self.manifest = fmt.read_manifest(self.root)
        self.classes: list[str] = list(self.manifest["classes"])
        self._first = np.array([s["first"] for s in self.manifest["shards"]], dtype=np.int64)
        self._keys = [_env_key(self.root / fmt.shard_name(s)) for s in range(len(self._first))]
        self._envs: dict[int, lmdb.Environment] = {}  # keeps the shared environments open
        _LIVE.add(self)

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_envs"] = {}
        state.pop("index", None)  # re-mapped in the receiving process, not copied
        state.pop("paths", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _LIVE.add(self)

    @cached_property
    def index(self) -> np.ndarray:
        """Per-sample index rows (``ingest.format.INDEX_DTYPE``), memory-mapped."""
        return fmt.load_index(self.root)

    @cached_property
    def paths(self) -> list[str]:
        """Source path of every sample, relative to the converted folder."""
        with open(self.root / fmt.PATHS, "rb") as f:
            return msgpack.unpackb(f.read(), raw=False)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.index["label"], dtype=np.int64)

    def shard_of(self, i: int) -> int:
        return int(np.searchsorted(self._first, i, side="right") - 1)

    def _env(self, shard: int) -> lmdb.Environment:
        env = self._envs.get(shard)
        if env is None:
            key = self._keys[shard]
            if self.cache is not None:  # a RAM copy, or the original when it has none
                key = _env_key(Path(self.cache.shard_path(shard)))
            env = self._envs[shard] = _open_env(key)
        return env

    def raw(self, i: int) -> bytes:
        """The stored value of sample ``i`` (a packed record), as bytes.

        Raises:
            IndexError: ``i`` is outside the store.
            KeyError: the record is missing from its shard (a damaged store).
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} is out of range for a store of {n} samples")
        i = int(i) % n
        shard = self.shard_of(i)
        with self._env(shard).begin() as txn:
            value = txn.get(fmt.encode_key(i))
        if value is None:
            raise KeyError(f"{self.root}/{fmt.shard_name(shard)}: key {i} is missing")
        return value

    def record(self, i: int) -> dict:
        return unpack_record(self.raw(i))

    def image(self, i: int) -> tuple[bytes, str]:
        """The encoded image of sample ``i`` (decompressed) and its format ("jpeg", "png")."""
        rec = self.record(i)
        return image_bytes(rec), rec["format"]

    def close(self) -> None:
        """Let go of this store's shard environments; LMDB closes each one as soon as no
        Store of this process uses it any more (reopened on next use)."""
        self._envs = {}


# Every Store of a process shares one environment per shard: LMDB forbids opening an
# environment twice in one process (py-lmdb refuses). The registry holds them weakly, so an
# environment closes with the last Store using it. A forked child must drop all of the
# parent's handles, those of every Store it inherited, before it can open its own.
_ENVS: weakref.WeakValueDictionary[str, lmdb.Environment] = weakref.WeakValueDictionary()
_LIVE: weakref.WeakSet[Store] = weakref.WeakSet()


def _env_key(path: Path) -> str:
    return os.path.realpath(path)


def _open_env(key: str) -> lmdb.Environment:
    """The environment of the shard directory ``key`` (a real path), opened once per process."""
    env = _ENVS.get(key)
    if env is None:
        env = lmdb.open(
            key, readonly=True, lock=False, readahead=False, subdir=True,
            max_readers=1, max_spare_txns=1,
        )  # fmt: skip
        _ENVS[key] = env
    return env


def _forget_parent_envs() -> None:
    for store in list(_LIVE):
        store._envs = {}
    _ENVS.clear()


os.register_at_fork(after_in_child=_forget_parent_envs)

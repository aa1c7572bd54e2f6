"""Store: fork-safe, read-only access to a store; LMDB handles open lazily in each process.

The shard environments live in ``loader.shard_envs``, the checked reads of one record in
``loader.records``; this module decides where each read goes (the store's shard or a
cache's copy) and which error a failure is (a bad sample, a bad store, a rebuild).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import TypeVar

import lmdb
import numpy as np

from ingest import format as fmt
from ingest.format import pages
from ingest.format.codec import image_bytes, payload_limit, size_problem
from ingest.images.probe import header_problem
from loader.records import read_paths, read_record, read_value, verify_advice
from loader.shard_envs import Opened, check_build, env_key, identity, open_env, rebuilt, track

T = TypeVar("T")


class Store:
    """A complete store opened for reading.

    Safe to pickle (for ``spawn`` workers) and to use after ``fork``: LMDB environments
    are opened on first use in each process, read-only and without a lock file, so a
    store on a read-only filesystem reads fine. The index is memory-mapped.

    A store is untrusted input: the manifest, the index and each shard file's size and
    LMDB pages (``ingest.format.pages``) are checked when the store is opened; the file a
    process maps (the shard's, or a cache's copy), before it maps it, with the shard's
    build identity (its pages walked again unless those very bytes were walked by this
    process, the one that forked it, or the cache's copier); and each record (CRC-32,
    fields, pixel count) as it is read; see ``record``. A cache's copy is the cache's
    problem, never the store's: one changed since it was opened is asked of the cache again
    (which checks it again) before LMDB reads it, and one whose record fails where the
    store's shard reads fine is discarded (``ShmCache.discard``), in each process.

    Args:
        root: the store directory.
        cache: where to open each shard from, e.g. an ``loader.cache.shm.ShmCache``: its
            ``shard_path(shard)`` gives the shard directory to open (a RAM copy or the
            original), asked once per shard and process.
        max_pixels: the most pixels this reader decodes for one image (default
            ``ingest.format.DEFAULT_MAX_PIXELS``, the build's default); the store's own
            limit applies when lower (``ingest.format.pixel_limit``).

    Raises:
        ingest.format.StoreError: ``root`` is not a complete, consistent store, or holds
            an image over ``max_pixels``.
        ValueError: ``max_pixels`` is not a positive int.
    """

    def __init__(self, root: str | os.PathLike, cache=None, max_pixels: int | None = None) -> None:
        self.root = Path(root)
        self.cache = cache
        self.manifest = fmt.read_manifest(self.root)
        _ = self.index  # checked against the manifest now, not at the first batch
        # Records over this many pixels are refused before they are decoded.
        self.max_pixels = fmt.pixel_limit(self.root, self.manifest, self.index, max_pixels)
        self.classes: list[str] = list(self.manifest["classes"])
        self._first = np.array([s["first"] for s in self.manifest["shards"]], dtype=np.int64)
        self._keys = [env_key(self.root / fmt.shard_name(s)) for s in range(len(self._first))]
        self._envs: dict[int, Opened] = {}  # keeps the shared environments open
        # How a read's messages begin and end, made once: a read is per sample.
        self._shard_texts = [f"{self.root}/{fmt.shard_name(s)}" for s in range(len(self._first))]
        self._advice = verify_advice("", self.root)
        if problem := pages.engine_problem():  # at open, not at the first batch
            raise fmt.StoreError(problem)
        # Every shard file's size and LMDB pages now: a damaged store is refused at open,
        # not hours in, and the workers forked from this process inherit the walk (a
        # cache's copy is walked by its copier, and trusted while it is those bytes).
        for shard in range(len(self._first)):
            with self._rebuilt_if_refused(self.root / fmt.shard_name(shard)):
                pages.require_sound(fmt.store_file(self.root, self.manifest, shard))
        track(self)

    def __len__(self) -> int:
        return self.manifest["num_samples"]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_envs"] = {}
        state.pop("index", None)  # re-mapped in the receiving process, not copied
        state.pop("paths", None)
        state["_sound"] = pages.sound_files()  # a spawned process walks none again
        return state

    def __setstate__(self, state: dict) -> None:
        pages.trust_sound(state.pop("_sound", []))
        self.__dict__.update(state)
        track(self)

    @cached_property
    def index(self) -> np.ndarray:
        """Per-sample index rows (``ingest.format.INDEX_DTYPE``), memory-mapped, checked
        against the manifest when loaded."""
        # Here, not at open only: a spawned worker loads it again.
        with self._rebuilt_if_refused(self.root / self.manifest["index"]["file"]):
            return fmt.load_index(self.root, manifest=self.manifest)

    @cached_property
    def paths(self) -> list[str]:
        """Source path of every sample, relative to the converted folder (names that are
        not UTF-8 as ``os.walk`` gives them, with surrogate escapes)."""
        with self._rebuilt_if_refused(self.root / self.manifest["paths"]["file"]):
            return read_paths(self.root, self.manifest)

    @property
    def labels(self) -> np.ndarray:
        return np.asarray(self.index["label"], dtype=np.int64)

    def shard_of(self, i: int) -> int:
        return int(np.searchsorted(self._first, i, side="right") - 1)

    def _env(self, shard: int) -> Opened:
        opened = self._envs.get(shard)
        # A copy changed since it was opened (damaged in place, replaced, removed) is asked
        # of the cache again before LMDB reads its pages, which it trusts (a stat, in RAM).
        if opened is None or (opened.copy is not None and identity(opened.copy) != opened.ident):
            opened = self._envs[shard] = self._open_checked(shard)
        return opened

    def _open_checked(self, shard: int) -> Opened:
        """Shard ``shard``'s environment, once its file has the recorded size (mapping a
        truncated file kills the process with SIGBUS), LMDB's pages in the file it opens
        (the original or the cache's copy) lead nowhere outside it (``ingest.format.pages``:
        LMDB trusts them), and it was written by the build that wrote this manifest (a
        store rebuilt while open must not mix two builds). A copy that fails is discarded
        and the original opened.

        Raises:
            ingest.format.StoreError: naming the shard and what differs.
        """
        where = self.root / fmt.shard_name(shard)
        with self._rebuilt_if_refused(where):  # whatever refuses it, a rebuild is said so
            fmt.store_file(self.root, self.manifest, shard)
            copy = self._copy_of(shard)
            if copy is not None:
                try:
                    ident = identity(copy / "data.mdb")
                    return Opened(self._open_shard(env_key(copy), copy), copy / "data.mdb", ident)
                except fmt.StoreError as e:  # the store's advice does not apply to a copy
                    self.cache.discard(shard, str(e).rsplit("; ", 1)[0])
            return Opened(self._open_shard(self._keys[shard], where))

    def _copy_of(self, shard: int) -> Path | None:
        """The cache's copy of shard ``shard`` (a RAM copy), or None: the store's own."""
        if self.cache is None:
            return None
        path = Path(self.cache.shard_path(shard))
        return None if env_key(path) == self._keys[shard] else path

    def _open_shard(self, key: str, where: Path) -> lmdb.Environment:
        """The checked environment of the shard directory ``key``, the store's ``where``
        or a copy of it (see ``_open_checked``).

        Raises:
            ingest.format.StoreError: naming the file and what is wrong with it.
        """
        pages.require_sound(Path(key) / "data.mdb")
        try:
            env = open_env(key)
            check_build(env, self.manifest, where)
        except lmdb.Error as e:  # the whole shard, not one sample: no replacement helps
            raise fmt.StoreError(
                f"{key}: LMDB cannot open the shard ({e}); check the store with "
                f"`ingest verify {self.root}`"
            ) from None
        return env

    def _read(self, i: int, read: Callable[[lmdb.Environment, str, str], T]) -> T:
        """``read(env, where, advice)`` of sample ``i`` from its shard (``where`` and
        ``advice`` begin and end its messages): from the cache's copy, and from the store's
        shard where the copy's record fails; the store's shard reading fine, the copy is
        discarded and this process reads that shard from the store from now on."""
        shard = self.shard_of(i)
        opened = self._env(shard)
        here, advice = self._shard_texts[shard], self._advice
        if opened.copy is None:
            return read(opened.env, here, advice)
        try:
            return read(opened.env, str(opened.copy.parent), "")
        except (fmt.RecordError, KeyError) as e:
            problem = str(e.args[0]) if isinstance(e, KeyError) else str(e)
        except lmdb.Error as e:
            problem = f"{opened.copy.parent}: key {i}: LMDB cannot read it ({e})"
        with self._rebuilt_if_refused(Path(here)):
            store = Opened(self._open_shard(self._keys[shard], Path(here)))
        value = read(store.env, here, advice)  # the store's own error, should it fail too
        self._envs[shard] = store
        self.cache.discard(shard, problem)
        return value

    @contextlib.contextmanager
    def _rebuilt_if_refused(self, where: Path) -> Iterator[None]:
        """Run the block; its StoreError about the store's file ``where`` becomes the error
        of a store rebuilt since it was opened, where it was (the likelier cause, and
        what to do differs: open it again, not rebuild it)."""
        try:
            yield
        except fmt.AccessDenied:  # this user's access changed, not the store
            raise
        except fmt.StoreError as e:
            try:
                build = fmt.read_manifest(self.root).get("build")
            except fmt.AccessDenied:
                raise e from None
            except fmt.StoreError:  # its manifest gone or replaced since: a rebuild under way
                build = None
            if build != self.manifest.get("build"):
                raise fmt.StoreError(rebuilt(where)) from None
            raise

    def raw(self, i: int, nbytes: int | None = None) -> bytes:
        """The stored value of sample ``i`` (a packed record), as bytes; with ``nbytes``,
        a value of another length is refused before it is copied (a forged store's value
        of gigabytes behind a small index entry costs nothing).

        Raises:
            IndexError: ``i`` is outside the store.
            KeyError: the record is missing from its shard (a damaged store).
            ingest.format.RecordError: the value is not ``nbytes`` long.
        """
        i = self._position(i)
        return self._read(i, lambda env, where, advice: read_value(env, where, i, nbytes, advice))

    def _position(self, i: int) -> int:
        """Sample ``i`` (negative: from the end) as a position in the store.

        Raises:
            IndexError: ``i`` is outside the store.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample index {i} is out of range for a store of {n} samples")
        return int(i) % n

    def record(self, i: int) -> dict:
        """The record of sample ``i``, checked: its size (pixels) within ``max_pixels``
        (before anything reads it), its CRC-32 and length as the index records them, its
        fields of the format's types.

        Raises:
            ingest.format.RecordError: the record is damaged or too large (names the shard
                and key); a bad sample, not a bad store. Nothing is decoded before the
                pixel count is checked.
            IndexError, KeyError: as ``raw``.
        """
        return self._checked(i)[2]

    def _checked(self, i: int) -> tuple[int, np.void, dict]:
        """``record``'s work: (``i`` within the store, its index row, its record)."""
        i = self._position(i)
        row = self.index[i]
        nbytes = int(row["nbytes"])
        problem = size_problem(int(row["height"]), int(row["width"]), nbytes, self.max_pixels)
        if problem:
            raise fmt.RecordError(f"{self._where(i)}: {problem}; rebuild the store")
        return (
            i,
            row,
            self._read(i, lambda env, where, advice: read_record(env, where, i, row, advice)),
        )

    def _where(self, i: int) -> str:
        return f"{self._shard_texts[self.shard_of(i)]}: key {i}"

    def image(self, i: int) -> tuple[bytes, str]:
        """The encoded image of sample ``i`` (decompressed) and its format ("jpeg", "png",
        or "raw": pixels, HxWxC by the index),
        its header checked against the index: every decoder sizes its work from the
        index (the pixel limit, crop windows, buffers), so an image of another size, a
        decompression bomb behind a small index entry among them, never reaches one.

        Raises:
            ingest.format.RecordError: see ``record``; also a payload that does not
                decompress, or whose header gives another size than the index.
        """
        i, row, rec = self._checked(i)
        try:
            limit = payload_limit(rec["format"], int(row["height"]), int(row["width"]))
            data = image_bytes(rec, limit)
        except Exception as e:  # zstandard raises its own error type
            raise fmt.RecordError(f"{self._where(i)}: payload does not decompress: {e}") from None
        h, w, c = int(row["height"]), int(row["width"]), int(row["channels"])
        problem = header_problem(data, rec["format"], h, w, c)
        if problem:
            raise fmt.RecordError(
                f"{self._where(i)}: {problem}; check the store with `ingest verify "
                f"{self.root}` and rebuild it"
            )
        return data, rec["format"]

    def close(self) -> None:
        """Let go of this store's shard environments; LMDB closes each one as soon as no
        Store of this process uses it any more (reopened on next use)."""
        self._envs = {}

"""A check of a shard's LMDB pages before LMDB reads them (LMDB 0.9's format, ``mdb.c``).

LMDB trusts its file: a page number, node offset or value length damaged in place makes it
read past the end of the file (SIGBUS) or fail an assertion (SIGABRT) in the reader. This
walks the main database's tree as LMDB's lookups and cursors do, and refuses what would
lead them outside the file or into a code path a store never uses: the meta page LMDB
picks; every branch and leaf page from the root (number, kind, bounds, nodes, node flags,
keys a branch, each child reached once, every leaf at the tree's depth); every overflow
value's first page and length. It reads the tree's pages only, never the values, through a
read-only map Python bounds-checks (``lmdb.verify`` also checks the write paths' invariants
and reads every value's first page: a random read per record on a cold disk).

Every LMDB environment of a store is opened through ``open_lmdb``, with the 0.9 engine
this check models: py-lmdb 3 picks its engine from a file's first bytes, which damage can
make the 1.0 engine's.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct

import lmdb
import numpy as np

from ingest.format.errors import StoreError

# lmdb.open's arguments that choose LMDB 0.9's engine (data format 1), where the binding
# has several (py-lmdb 3); older bindings have that engine only.
ENGINE = {"lib_version": 0} if hasattr(lmdb.Environment, "lib_version") else {}


def open_lmdb(path: str | os.PathLike, **options) -> lmdb.Environment:
    """``lmdb.open(path, **options)`` with LMDB 0.9's engine: how every shard is opened,
    written or read (``ENGINE``). A binding without that engine is a StoreError that says
    how to get one, before LMDB is asked."""
    if problem := engine_problem():
        raise StoreError(problem)
    return lmdb.open(str(path), **options, **ENGINE)


def engine_problem() -> str | None:
    """Why this py-lmdb cannot open a store's shards, or None: a py-lmdb 3 built on a
    system's LMDB 1.x (``LMDB_FORCE_SYSTEM``) has no 0.9 engine, and ``lib_version=0``
    would raise a bare ``lmdb.Error`` at each open."""
    if not ENGINE:
        return None
    try:
        lmdb.version(**ENGINE)
    except lmdb.Error:
        return (
            f"py-lmdb {lmdb.__version__} here has no LMDB 0.9 engine (it was built on the "
            "system's LMDB), and a store's shards are LMDB 0.9 files; install its own build: "
            "pip install --force-reinstall --no-cache-dir lmdb, with LMDB_FORCE_SYSTEM unset"
        )
    return None


MAGIC, VERSION = 0xBEEFC0DE, 1
HEADER = 16  # a page's header: number (8), pad (2), flags (2), lower and upper bounds (2, 2)
NODE = 8  # a node's header: value size or child page (2 + 2 + 2 of it), flags, key size
P_BRANCH, P_LEAF = 0x01, 0x02
P_WRITTEN = 0x10 | 0x8000  # dirty and keep: in-memory flags that may be left on a page
F_BIGDATA = 0x01  # a leaf node whose value lies on overflow pages
MAX_DEPTH = 31  # LMDB's cursor stack holds 32 pages
MAX_NODES = 1 << 20  # nodes walked at once (some 100 MiB of numpy's temporaries)
# struct MDB_meta after the page header: magic, version, address, map size, two MDB_db of
# 48 bytes (pad, flags, depth, branch, leaf and overflow pages, entries, root), last page,
# transaction id.
_META = struct.Struct("<IIQQ48s48sQQ")
_DB = struct.Struct("<IHHQQQQQ")


def pages_problem(path: str | os.PathLike) -> str | None:
    """What in the LMDB file ``path`` (a shard's ``data.mdb``) could kill a reader, or
    None when its tree is sound."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 2 * 512:
            return f"{size} bytes, too short for LMDB's two meta pages"
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return _problem(m, size)  # the map closes with its last view (an error's frames hold some)


def _problem(m: mmap.mmap, size: int) -> str | None:
    words = struct.unpack_from("<16I", m)  # where py-lmdb 3 reads a file's format
    named = next((after for word, after in itertools.pairwise(words) if word == MAGIC), VERSION)
    if named != VERSION:
        return (f"LMDB data format {named}, where a store's shards are of format "
                f"{VERSION} (LMDB 0.9)")  # fmt: skip
    metas = []
    for k in range(2):
        at = 0 if k == 0 else metas[0][1]
        if at + HEADER + _META.size > size:
            return "the second meta page lies past the end of the file"
        number, flags = struct.unpack_from("<Q2xH", m, at)
        magic, version, _, _, free, main, last, txnid = _META.unpack_from(m, at + HEADER)
        if number != k or not flags & 0x08 or magic != MAGIC or version != VERSION:
            return f"meta page {k} is not an LMDB 0.9 meta page"
        psize = _DB.unpack(free)[0]  # the page size is kept in the free database's pad
        if k == 0 and (psize < 512 or psize > 32768 or psize & (psize - 1)):
            return f"a page size of {psize} bytes"
        metas.append((txnid, psize, _DB.unpack(main), last))
    if metas[1][1] != metas[0][1]:
        return "the two meta pages give different page sizes"
    _, psize, main, last = metas[metas[0][0] < metas[1][0]]  # LMDB's pick: the newer
    if (last + 1) * psize > size:
        return f"its last page ({last}) lies past the end of the file ({size // psize} pages)"
    _, flags, depth, *_, root = main
    if flags:
        return f"its database has flags {flags:#x}, which a store never uses"
    if root == 2**64 - 1:
        return None  # an empty database: nothing to read
    return _tree_problem(np.frombuffer(m, np.uint8), psize, last, root, depth)


def _tree_problem(data: np.ndarray, psize: int, last: int, root: int, depth: int) -> str | None:
    """The walk, a level of the tree at a time and at most ``MAX_NODES`` nodes of it at once
    (a page may point all its slots at one node: pages alone would not bound the memory).
    A page is queued once: a child already queued is a page reached twice, so a level
    holds at most every page of the file."""
    if not 1 <= depth <= MAX_DEPTH:
        return f"a tree of depth {depth}"
    if not 2 <= root <= last:
        return f"a page number ({root}) outside the file's pages 2-{last}"
    pages = data[: (last + 1) * psize].reshape(last + 1, psize)
    queued = np.zeros(last + 1, dtype=bool)
    queued[root] = True
    level, at = np.array([root], dtype=np.int64), 1
    while len(level):
        lower = pages[level, 12].astype(np.int64) | pages[level, 13].astype(np.int64) << 8
        weight = np.cumsum(np.maximum(lower - HEADER, 0) // 2 + 1)  # a page's nodes, and it
        cuts = np.searchsorted(weight, np.arange(MAX_NODES, weight[-1], MAX_NODES))
        children: list[np.ndarray] = []
        for chunk in np.split(level, sorted(set(np.maximum(cuts, 1).tolist()))):
            problem = _pages_problem(pages, chunk, queued, psize, last, at, depth, children)
            if problem:
                return problem
        level, at = (np.concatenate(children) if children else level[:0]), at + 1
    return None


def _first(bad: np.ndarray, pgnos: np.ndarray) -> int:
    return int(pgnos[np.flatnonzero(bad)[0]])


def _pages_problem(
    pages: np.ndarray, pgnos: np.ndarray, queued: np.ndarray, psize: int, last: int,
    level: int, depth: int, children: list,
) -> str | None:  # fmt: skip
    """The first problem of the pages ``pgnos`` (queued: within the file, each once) at
    ``level``; a branch level's children, checked and queued, go to ``children``."""
    p = pgnos  # (short: it names the page in every message)
    head = pages[p, :HEADER]
    number = head[:, :8].copy().view("<u8").ravel()
    flags, lower, upper = head[:, 10:16].copy().view("<u2").astype(np.int64).T
    bad = number != p.astype(np.uint64)
    if bad.any():
        k = np.flatnonzero(bad)[0]
        return f"page {p[k]} says it is page {number[k]}"
    kind = flags & ~P_WRITTEN
    want = P_LEAF if level == depth else P_BRANCH
    bad = kind != want
    if bad.any():
        k = np.flatnonzero(bad)[0]
        return f"page {p[k]} at depth {level} of {depth} has flags {int(flags[k]):#x}"
    bad = (lower < HEADER) | (lower > upper) | (upper > psize) | (lower % 2 == 1)
    if bad.any():
        k = np.flatnonzero(bad)[0]
        return f"page {p[k]} has bounds {lower[k]}-{upper[k]}"
    nkeys = (lower - HEADER) // 2
    bad = nkeys < (2 if want == P_BRANCH else 1)
    if bad.any():
        k = np.flatnonzero(bad)[0]
        return f"page {p[k]} has {nkeys[k]} key(s)"
    owner = np.repeat(np.arange(len(p)), nkeys)  # the page of each node
    slot = np.arange(len(owner)) - np.repeat(np.cumsum(nkeys) - nkeys, nkeys)
    rows = p[owner]
    at = HEADER + 2 * slot
    ptrs = pages[rows, at].astype(np.int64) | pages[rows, at + 1].astype(np.int64) << 8
    bad = (ptrs < upper[owner]) | (ptrs > psize - NODE)
    if bad.any():
        return f"page {p[owner[np.flatnonzero(bad)[0]]]} has a node outside its node area"
    lo, hi, nflags, ksize = (
        pages[rows[:, None], ptrs[:, None] + np.arange(NODE)].view("<u2").astype(np.int64).T
    )
    ends = ptrs + NODE + ksize
    if want == P_BRANCH:
        bad = ends > psize
        if bad.any():
            return f"page {p[owner[np.flatnonzero(bad)[0]]]} has a key past the page"
        kids = lo | hi << 16 | nflags << 32  # 48-bit page numbers
        out = (kids < 2) | (kids > last)
        if out.any():
            return f"a page number ({_first(out, kids)}) outside the file's pages 2-{last}"
        order = np.argsort(kids, kind="stable")
        dup = np.zeros(len(kids), bool)
        dup[order[1:]] = kids[order[1:]] == kids[order[:-1]]
        dup |= queued[kids]
        if dup.any():
            return f"page {_first(dup, kids)} is reached twice"
        queued[kids] = True
        children.append(kids)
        return None
    bad = (nflags & ~F_BIGDATA) != 0
    if bad.any():
        k = owner[np.flatnonzero(bad)[0]]
        return f"page {p[k]} has a node with flags {int(nflags[owner == k].max()):#x}"
    big = nflags == F_BIGDATA
    dsize = lo | hi << 16
    bad = ends + np.where(big, 8, dsize) > psize
    if bad.any():
        return f"page {p[owner[np.flatnonzero(bad)[0]]]} has a key or value past the page"
    if big.any():
        first = pages[rows[big][:, None], ends[big][:, None] + np.arange(8)].view("<u8").ravel()
        npages = ((HEADER + dsize[big] + psize - 1) // psize).astype(np.uint64)
        bad = (first < 2) | (first > last) | (first + npages - 1 > last)
        if bad.any():
            k = owner[big][np.flatnonzero(bad)[0]]
            return f"page {p[k]} has a value on pages outside the file's pages 2-{last}"
    return None


_SOUND: set[tuple[int, ...]] = set()  # files found sound by this process (or its parent)


def identity(path: str | os.PathLike) -> tuple[int, ...]:
    """What tells a file from the same file changed: device, inode, size, modification
    and change times (any write, in place or not, changes the last)."""
    st = os.stat(path)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def sound_files() -> list[tuple[int, ...]]:
    """The identities of the files found sound, to carry to a process that does not share
    this one's memory (a spawned worker, another process of the shm cache): there,
    ``trust_sound``."""
    return sorted(_SOUND)


def trust_sound(identities: list) -> None:
    """Take the files of these identities as walked and sound (``sound_files``)."""
    _SOUND.update(tuple(k) for k in identities)


def require_sound(path: str | os.PathLike) -> None:
    """Raise StoreError unless the LMDB file ``path`` passes ``pages_problem``. A file
    found sound is not walked again by this process, nor by its forks, while its identity,
    size and times are unchanged.

    Raises:
        ingest.format.StoreError: naming the file and what is wrong with its pages.
    """
    try:
        key = identity(path)
        if key in _SOUND:
            return
        problem = pages_problem(path)
    except OSError as e:
        raise StoreError(f"{path}: {e.strerror or e}; check the store's files") from None
    if problem is not None:
        raise StoreError(f"{path}: damaged LMDB pages ({problem}); rebuild the store")
    _SOUND.add(key)

"""ingest.format.pages: a shard's LMDB pages are checked before LMDB trusts them.

Each damage LMDB's lookups would follow outside the file, or into one of its assertions,
is refused with its own message; thousands of random damages to the tree's pages either
are refused or leave LMDB reading safely, where without the check some of them kill the
reader.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from pathlib import Path

import lmdb
import pytest
from fixtures import run_python

from ingest.format import StoreError
from ingest.format.pages import open_lmdb, pages_problem, require_sound

PAGE = min(mmap.PAGESIZE, 32768)  # LMDB's page: the system's, at most 32 KiB
KEYS = 400  # two levels: a branch page over leaf pages


def _lmdb_file(root: Path) -> Path:
    """An LMDB file laid out as a shard's: 8-byte keys, every third value on overflow
    pages (3,000 bytes), the others inline (100 bytes), and a build identity."""
    root.mkdir()
    env = open_lmdb(root, map_size=64 << 20)
    with env.begin(write=True) as txn:
        for i in range(KEYS):
            txn.put(i.to_bytes(8, "big"), bytes([i % 251]) * (3000 if i % 3 == 0 else 100))
        txn.put(b"build", b"b" * 32)
    env.close()
    return root / "data.mdb"


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> bytes:
    return _lmdb_file(tmp_path_factory.mktemp("lmdb") / "db").read_bytes()


class Layout:
    """Where things are in ``data``: the newer meta page and the tree's pages."""

    def __init__(self, data: bytes) -> None:
        txnids = [struct.unpack_from("<Q", data, k * PAGE + 144)[0] for k in (0, 1)]
        self.meta = PAGE * (txnids[0] < txnids[1])
        self.last = struct.unpack_from("<Q", data, self.meta + 136)[0]
        self.root = struct.unpack_from("<Q", data, self.meta + 128)[0]
        self.depth = struct.unpack_from("<H", data, self.meta + 94)[0]
        flags = [struct.unpack_from("<H", data, k * PAGE + 10)[0] for k in range(self.last + 1)]
        self.leaves = [k for k in range(2, self.last + 1) if flags[k] == 0x02]

    def node(self, data: bytes, page: int, i: int) -> int:
        """The offset in the file of node ``i`` of ``page``."""
        return page * PAGE + struct.unpack_from("<H", data, page * PAGE + 16 + 2 * i)[0]

    def big_node(self, data: bytes) -> tuple[int, int]:
        """A leaf node whose value is on overflow pages, and its page."""
        for page in self.leaves:
            for i in range(self.nkeys(data, page)):
                if struct.unpack_from("<H", data, self.node(data, page, i) + 4)[0] == 1:
                    return page, self.node(data, page, i)
        raise AssertionError("no value on overflow pages")

    @staticmethod
    def nkeys(data: bytes, page: int) -> int:
        return (struct.unpack_from("<H", data, page * PAGE + 12)[0] - 16) // 2


def test_the_layout_is_the_one_the_damages_assume(sound: bytes):
    at = Layout(sound)
    assert (at.depth, len(at.leaves)) == (2, Layout.nkeys(sound, at.root))
    assert struct.unpack_from("<H", sound, at.root * PAGE + 10)[0] == 0x01  # a branch page
    assert at.nkeys(sound, at.root) >= 2
    assert (at.last + 1) * PAGE == len(sound)


def test_a_sound_file_passes(sound: bytes, tmp_path: Path):
    path = tmp_path / "data.mdb"
    path.write_bytes(sound)
    assert pages_problem(path) is None
    require_sound(path)  # no error


def _damaged(sound: bytes, damage: str) -> tuple[bytes, str]:
    """``sound`` with one damage, and the problem it must be reported as."""
    data, at = bytearray(sound), Layout(sound)
    leaf = at.leaves[-1]
    last_node = at.node(sound, leaf, at.nkeys(sound, leaf) - 1)
    if damage == "last page past the end":
        struct.pack_into("<Q", data, at.meta + 136, at.last + 1)
        pages = at.last + 1
        return data, f"its last page ({pages}) lies past the end of the file ({pages} pages)"
    if damage == "not a meta page":
        struct.pack_into("<I", data, 16, 0xDEADBEEF)
        return data, "meta page 0 is not an LMDB 0.9 meta page"
    if damage == "meta page number":  # py-lmdb 3 reads a file's format from its first words
        struct.pack_into("<II", data, 0, 0xBEEFC0DE, 1)
        return data, "meta page 0 is not an LMDB 0.9 meta page"
    if damage == "page size":
        struct.pack_into("<I", data, 40, 3000)
        return data, "a page size of 3000 bytes"
    if damage == "database flags":
        struct.pack_into("<H", data, at.meta + 92, 0x04)  # MDB_DUPSORT
        return data, "its database has flags 0x4, which a store never uses"
    if damage == "depth":
        struct.pack_into("<H", data, at.meta + 94, 40)
        return data, "a tree of depth 40"
    if damage == "root outside":
        struct.pack_into("<Q", data, at.meta + 128, at.last + 7)
        return data, f"a page number ({at.last + 7}) outside the file's pages 2-{at.last}"
    if damage == "a cycle":  # the branch page's second child is the branch page itself
        node = at.node(sound, at.root, 1)
        struct.pack_into("<HHH", data, node, at.root & 0xFFFF, at.root >> 16, 0)
        return data, f"page {at.root} is reached twice"
    if damage == "a page twice":
        node = at.node(sound, at.root, 1)
        first = at.node(sound, at.root, 0)
        data[node : node + 6] = sound[first : first + 6]
        lo, hi, top = struct.unpack_from("<HHH", sound, first)
        return data, f"page {lo | hi << 16 | top << 32} is reached twice"
    if damage == "page number":
        struct.pack_into("<Q", data, leaf * PAGE, leaf + 1)
        return data, f"page {leaf} says it is page {leaf + 1}"
    if damage == "page kind":
        struct.pack_into("<H", data, leaf * PAGE + 10, 0x22)  # a LEAF2 page (DUPFIXED)
        return data, f"page {leaf} at depth 2 of 2 has flags 0x22"
    if damage == "bounds":
        upper = struct.unpack_from("<H", sound, leaf * PAGE + 14)[0]
        struct.pack_into("<H", data, leaf * PAGE + 12, upper + 2)
        return data, f"page {leaf} has bounds {upper + 2}-{upper}"
    if damage == "one key in a branch page":  # LMDB asserts at least two
        struct.pack_into("<H", data, at.root * PAGE + 12, 18)
        return data, f"page {at.root} has 1 key(s)"
    if damage == "node outside":
        struct.pack_into("<H", data, leaf * PAGE + 16, 0xFFFF)
        return data, f"page {leaf} has a node outside its node area"
    if damage == "key past the page":
        struct.pack_into("<H", data, last_node + 6, 0xF000)
        return data, f"page {leaf} has a key or value past the page"
    if damage == "node flags":
        struct.pack_into("<H", data, last_node + 4, 0x04)  # F_DUPDATA
        return data, f"page {leaf} has a node with flags 0x4"
    big_page, big = at.big_node(sound)
    if damage == "overflow page outside":
        ksize = struct.unpack_from("<H", sound, big + 6)[0]
        struct.pack_into("<Q", data, big + 8 + ksize, at.last + 1)
        return data, f"page {big_page} has a value on pages outside the file's pages 2-{at.last}"
    if damage == "value past the end":  # a length that runs past the last page
        struct.pack_into("<HH", data, big, 0, 0x7FFF)
        return data, f"page {big_page} has a value on pages outside the file's pages 2-{at.last}"
    raise AssertionError(damage)


DAMAGES = [
    "last page past the end", "not a meta page", "meta page number", "page size",
    "database flags", "depth", "root outside", "a cycle", "a page twice", "page number",
    "page kind", "bounds",
    "one key in a branch page", "node outside", "key past the page", "node flags",
    "overflow page outside", "value past the end",
]  # fmt: skip


@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damage_is_named(sound: bytes, tmp_path: Path, damage: str):
    data, problem = _damaged(sound, damage)
    assert len(data) == len(sound) and data != sound
    path = tmp_path / "data.mdb"
    path.write_bytes(bytes(data))
    assert pages_problem(path) == problem
    with pytest.raises(StoreError) as caught:
        require_sound(path)
    assert str(caught.value) == f"{path}: damaged LMDB pages ({problem}); rebuild the store"


def test_a_file_too_short_for_its_meta_pages(tmp_path: Path):
    path = tmp_path / "data.mdb"
    path.write_bytes(b"\0" * 1000)
    assert pages_problem(path) == "1000 bytes, too short for LMDB's two meta pages"


def test_a_sound_file_is_walked_once_until_it_changes(sound: bytes, tmp_path: Path, monkeypatch):
    import ingest.format.pages as lmdbpages

    path = tmp_path / "data.mdb"
    path.write_bytes(sound)
    walks = []
    monkeypatch.setattr(lmdbpages, "pages_problem", lambda p: walks.append(p))
    require_sound(path)
    require_sound(path)
    assert walks == [path]
    os.utime(path, ns=(1, 1))  # changed: walked again
    require_sound(path)
    assert walks == [path, path]


# A child process damages the file at random (1 to 4 bytes of the meta and tree pages, at
# fixed seeds), then, unless the check refuses the damage, reads every key and walks a
# cursor over the file in a grandchild. It prints how many damages were refused, how
# many read, and the seeds whose reader died.
_FUZZ = r"""
import json, os, random, struct, sys, lmdb
from pathlib import Path
from ingest.format.pages import open_lmdb, pages_problem
base, seeds, check = Path(sys.argv[1]), range(*map(int, sys.argv[2:4])), sys.argv[4] == "1"
sound = base.read_bytes()
page = struct.unpack_from("<I", sound, 40)[0]  # the page size, in the first meta page
tree = [k for k in range(len(sound) // page)
        if k < 2 or struct.unpack_from("<H", sound, k * page + 10)[0] & 3]
work = base.parent / "damaged"
work.mkdir()
counts = {"refused": 0, "read": 0, "died": []}
for seed in seeds:
    rng, data = random.Random(seed), bytearray(sound)
    for _ in range(rng.choice([1, 1, 2, 4])):
        at = rng.choice(tree) * page + rng.randrange(64 if rng.random() < 0.5 else page)
        data[at] = data[at] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
    (work / "data.mdb").write_bytes(data)
    if check and pages_problem(work / "data.mdb") is not None:
        counts["refused"] += 1
        continue
    pid = os.fork()
    if pid == 0:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)  # LMDB's assertion message
        try:  # an error from LMDB is safe: the reader lives
            env = open_lmdb(work, readonly=True, lock=False, max_readers=1)
            txn = env.begin(buffers=True)
        except lmdb.Error:
            os._exit(0)
        for i in range(KEYS):
            try:
                value = txn.get(i.to_bytes(8, "big"))
                bytes(value) if value is not None else None
            except lmdb.Error:
                pass
        try:
            for _, value in txn.cursor():
                bytes(value)
        except lmdb.Error:
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status) or os.WEXITSTATUS(status):
        counts["died"].append(seed)
    else:
        counts["read"] += 1
print(json.dumps(counts))
""".replace("KEYS", str(KEYS))


def _fuzz(sound: bytes, tmp_path: Path, seeds: tuple[int, int], check: bool) -> dict:
    base = tmp_path / "base" / "data.mdb"
    base.parent.mkdir()
    base.write_bytes(sound)
    result = run_python("-c", _FUZZ, base, *seeds, "1" if check else "0", timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_random_damage_is_refused_or_read_safely(sound: bytes, tmp_path: Path):
    counts = _fuzz(sound, tmp_path, (0, 1500), check=True)
    assert counts["died"] == []
    assert counts["refused"] + counts["read"] == 1500
    assert counts["refused"] > 300 and counts["read"] > 300  # both outcomes exercised


def test_without_the_check_random_damage_kills_readers(sound: bytes, tmp_path: Path):
    """The fuzz above can fail: the same damages, unchecked, kill LMDB's reader."""
    counts = _fuzz(sound, tmp_path, (0, 1500), check=False)
    assert len(counts["died"]) >= 3
    assert counts["read"] + len(counts["died"]) == 1500


TWO_ENGINES = pytest.mark.skipif(
    not hasattr(lmdb.Environment, "lib_version"), reason="py-lmdb < 3 has one LMDB engine"
)


@TWO_ENGINES
def test_an_lmdb_1_file_is_named_as_such(tmp_path: Path):
    """py-lmdb 3 writes LMDB 1.0's format (3) when asked; a store's shards are of 0.9's."""
    env = lmdb.open(str(tmp_path), lib_version=1)
    with env.begin(write=True) as txn:
        txn.put(b"k", b"v")
    env.close()
    assert pages_problem(tmp_path / "data.mdb") == (
        "LMDB data format 3, where a store's shards are of format 1 (LMDB 0.9)"
    )


@TWO_ENGINES
def test_stores_are_written_and_read_by_lmdb_0_9_whatever_the_default(tmp_path: Path, monkeypatch):
    """py-lmdb 3 picks an engine for a new file from LMDB_DEFAULT_LIB_VERSION, and for an
    existing one from its first bytes, which a damaged file can make 1.0's: the build and
    every reader name LMDB 0.9's, whose format the page check models."""
    from loader.bench.synth import make_image_folder

    make_image_folder(tmp_path / "src", 2, 2, short_side=(48, 72))
    result = run_python(
        "-m", "ingest", "build", tmp_path / "src", tmp_path / "out", LMDB_DEFAULT_LIB_VERSION="1"
    )
    assert result.returncode == 0, result.stderr
    shard = tmp_path / "out" / "shard-00000"
    data = (shard / "data.mdb").read_bytes()
    assert struct.unpack_from("<I", data, 20)[0] == 1  # data format 1: LMDB 0.9's
    assert pages_problem(shard / "data.mdb") is None
    import loader.store

    asked, real_open = [], lmdb.open

    def open_env(*args, **kwargs):
        asked.append(kwargs)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(loader.store.lmdb, "open", open_env)
    store = loader.store.Store(tmp_path / "out")
    assert len(store.raw(0)) == int(store.index["nbytes"][0])
    assert [kw["lib_version"] for kw in asked] == [0]  # whatever the file's first bytes say


@TWO_ENGINES
def test_a_binding_without_lmdb_0_9_is_one_line_that_says_what_to_install(
    tmp_path: Path, monkeypatch, capsys
):
    """A py-lmdb 3 built on a system's LMDB 1.x has no 0.9 engine: ``lib_version=0``
    raised a bare ``lmdb.Error`` at every open. The build, verify and readers now say what
    to install, before a worker or LMDB is asked."""
    from ingest import cli
    from loader.bench.synth import make_image_folder

    make_image_folder(tmp_path / "src", 2, 2, short_side=(48, 72))
    assert cli.main(["build", str(tmp_path / "src"), str(tmp_path / "out")]) == 0
    capsys.readouterr()
    import loader.store

    real_version = lmdb.version

    def version(subpatch=False, lib_version=None):  # as such a build answers
        if lib_version == 0:
            raise lmdb.Error("lib_version=0: this build has no LMDB 0.x engine.")
        return real_version(subpatch)

    monkeypatch.setattr(lmdb, "version", version)
    for argv in (["build", str(tmp_path / "src"), str(tmp_path / "again")],
                 ["verify", str(tmp_path / "out")]):  # fmt: skip
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "has no LMDB 0.9 engine" in err, err
        assert "pip install --force-reinstall --no-cache-dir lmdb" in err
    assert not (tmp_path / "again").exists()
    with pytest.raises(StoreError, match=r"has no LMDB 0\.9 engine"):
        loader.store.Store(tmp_path / "out")

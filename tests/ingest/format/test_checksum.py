"""The records' CRC-32 is zlib's, whichever implementation computes it."""

from __future__ import annotations

import importlib
import sys
import zlib

import numpy as np

from ingest.format import checksum


def test_the_crc32_of_records_is_zlibs_on_bytes_and_views() -> None:
    rng = np.random.default_rng(7)
    for size in (0, 1, 63, 4096, 1 << 20, (1 << 20) + 17):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert checksum.crc32(data) == zlib.crc32(data)
        assert checksum.crc32(memoryview(data)[3:]) == zlib.crc32(data[3:])


def test_without_isal_it_is_zlibs_own(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "isal", None)  # as where its wheel is missing
    monkeypatch.setitem(sys.modules, "isal.isal_zlib", None)
    try:
        fallback = importlib.reload(checksum)
        assert fallback.crc32 is zlib.crc32
    finally:
        monkeypatch.undo()
        importlib.reload(checksum)
    assert checksum.crc32(b"store") == zlib.crc32(b"store")

"""``crc32``: the CRC-32 of the index's ``crc32`` column (zlib's polynomial and values).

ISA-L's (the ``isal`` package, a dependency): about six times zlib's speed, and every
record is summed when it is built, written and read. zlib's where isal cannot be imported
(a checkout run without installing it): the same values, slower.
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:
    from zlib import crc32

__all__ = ["crc32"]

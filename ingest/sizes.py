"""Human sizes ("512MiB", "1GiB", "200KB", "1048576"), as the CLI and the loader take them."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    """Bytes of a human size; argparse's type error (its message shown as it is) if not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 512MiB, 1GiB, 200KB")
    size = int(Fraction(m.group(1)) * _UNITS[unit])  # exact, however many digits
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be at least 1 byte")
    return size

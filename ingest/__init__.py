"""Offline converter: ImageFolder trees into sharded LMDB stores (see docs/FORMAT.md).

Never imports torch: a store is built on any machine with numpy, lmdb and OpenCV.
"""

__version__ = "0.1.0"

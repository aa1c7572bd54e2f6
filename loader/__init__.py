"""Runtime side: read stores made by ``ingest`` and feed them to training fast."""

from loader.dataset import LMDBDataset
from loader.store import Store

__all__ = ["LMDBDataset", "Store"]

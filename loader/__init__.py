"""Runtime side: read stores made by ``ingest`` and feed them to training fast."""

from loader.augment import Transform
from loader.dataloader import DataLoader
from loader.dataset import LMDBDataset
from loader.decode import get_decoder
from loader.ops.mixup import Mixup
from loader.plan.sampler import EpochPlan
from loader.store import Store
from loader.telemetry.profiler import Profile, profile

__all__ = [
    "DataLoader",
    "EpochPlan",
    "LMDBDataset",
    "Mixup",
    "Profile",
    "Store",
    "Transform",
    "get_decoder",
    "profile",
]

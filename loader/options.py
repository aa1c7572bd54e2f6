"""Checks of the DataLoader's arguments where they enter: each message names the argument,
the value, the limit and what to do instead."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os

from loader.dataset import LMDBDataset
from loader.decode import decoders, delivers_to
from loader.sampler import check_int
from loader.store import Store

log = logging.getLogger(__name__)

# Arguments only the store path uses; meaningless for torch's DataLoader over a Dataset.
STORE_ONLY = (
    "transform",
    "image_size",
    "mean",
    "std",
    "dtype",
    "channels_last",
    "device",
    "seed",
    "rank",
    "world_size",
    "with_indices",
    "decoder",
    "cpu_share",
    "cache",
    "cache_limit",
    "cache_root",
)


def reads_store(dataset, sampler=None, batch_sampler=None, collate_fn=None) -> bool:
    """True when the fast path applies: a store path, or an LMDBDataset that yields raw PIL
    images (no transform) with no sampler or collate_fn of the user's."""
    if isinstance(dataset, (str, os.PathLike)):
        return True
    return (
        isinstance(dataset, LMDBDataset)
        and dataset.transform is None
        and dataset.target_transform is None
        and sampler is None
        and batch_sampler is None
        and collate_fn is None
    )


def open_store(dataset, **cache) -> tuple[Store, LMDBDataset]:
    """The store behind ``dataset`` (a path or an LMDBDataset) and a Dataset view of it;
    ``cache`` holds the ``cache=``, ``cache_limit=``, ``cache_root=`` arguments.

    Raises:
        ingest.format.StoreError: the path is not a complete store (says how to make one).
        ValueError: a cache argument is invalid, or given with an LMDBDataset.
    """
    if isinstance(dataset, LMDBDataset):
        given = [k + "=" for k, v in cache.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} cannot be given with an LMDBDataset, which opened the "
                "store already: pass them to LMDBDataset(root, cache=...) instead"
            )
        return dataset.store, dataset
    ds = LMDBDataset(dataset, **cache)
    return ds.store, ds


def check_not_for_store(sampler, batch_sampler, collate_fn) -> None:
    given = [
        n
        for n, v in (
            ("sampler", sampler),
            ("batch_sampler", batch_sampler),
            ("collate_fn", collate_fn),
        )
        if v is not None
    ]
    if given:
        raise ValueError(
            f"{'/'.join(given)}= cannot be used when reading a store: the loader plans each "
            "epoch itself (shuffle=, seed=, rank=, world_size=) and batches pixels in shared "
            "memory; to use your own, pass loader.LMDBDataset(root, transform=<torchvision "
            "transform>) instead of the path and get torch's DataLoader"
        )


def check_batch_size(batch_size) -> int:
    if batch_size is None:
        raise ValueError(
            "batch_size=None (no batching) is not supported when reading a store; "
            "pass the number of samples per batch"
        )
    return check_int("batch_size", batch_size, 1, "pass the number of samples per batch")


def check_workers(num_workers, prefetch_factor, timeout) -> tuple[int, int, float]:
    """(num_workers, prefetch_factor, timeout) checked; prefetch_factor defaults to 2."""
    check_int("num_workers", num_workers, 0, "use num_workers=0 to decode in the main process")
    prefetch = 2 if prefetch_factor is None else prefetch_factor
    check_int(
        "prefetch_factor", prefetch, 1, "it is the number of batches each worker prepares ahead"
    )
    if not isinstance(timeout, (int, float)) or timeout < 0:
        raise ValueError(f"timeout={timeout!r} is invalid: seconds >= 0 (0 waits forever)")
    return num_workers, prefetch, float(timeout)


def resolve_decoder(name: str, device) -> str:
    """The decoder backend ``decoder=`` asks for on ``device``: "auto" is the GPU path
    ("nvjpeg", torchvision's batched nvjpeg decode) on a CUDA device, else "cpu".

    Raises:
        ValueError: an unknown name, or a GPU decoder with a CPU device.
    """
    if name == "auto":
        if device.type != "cuda":
            return "cpu"
        try:
            import torchvision.io  # noqa: F401  (the nvjpeg backend's only need)
        except ImportError:
            log.info("DataLoader: torchvision is not installed: decoding on the CPU")
            return "cpu"
        return "nvjpeg"
    if name not in decoders():
        raise ValueError(
            f"decoder={name!r} is unknown; known decoders: auto, {', '.join(decoders())}"
        )
    if device.type not in delivers_to(name):
        raise ValueError(
            f"decoder={name!r} decodes on a CUDA device but device={str(device)!r}; pass "
            "device='cuda' or decoder='cpu'"
        )
    return name


def check_cpu_share(share) -> float | str:
    """``cpu_share=``: "auto" or a fraction in [0, 1]."""
    if share == "auto":
        return share
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ValueError(
            f"cpu_share={share!r} is invalid: pass 'auto' (sized from measured decode rates) "
            "or the fraction of JPEGs the workers decode on the CPU, in [0, 1]"
        )
    return float(share)


def mp_context(context):
    """A multiprocessing context: the given one (name or object), else fork where the
    platform has it (workers start in milliseconds), else spawn."""
    if context is None:
        context = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    if isinstance(context, str):
        try:
            return mp.get_context(context)
        except ValueError:
            raise ValueError(
                f"multiprocessing_context={context!r} is not a start method here; use one of "
                f"{', '.join(mp.get_all_start_methods())}"
            ) from None
    return context


def resolve_seed(seed, generator) -> int:
    """``seed=``, else the initial seed of a torch ``generator``, else 0."""
    if seed is None:
        seed = generator.initial_seed() if generator is not None else 0
    return check_int("seed", seed, 0, "pass a non-negative integer")

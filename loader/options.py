"""Checks of the DataLoader's arguments where they enter: each message names the argument,
the value, the limit and what to do instead."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import warnings

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

from loader.augment import Transform
from loader.dataset import LMDBDataset
from loader.decode import decoders, delivers_to
from loader.gpu.nvjpeg import import_torchvision_io
from loader.plan.sampler import check_int
from loader.recipes import NotARecipe, recognise
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
    "max_pixels",
)


SAMPLERS = (DistributedSampler, RandomSampler, SequentialSampler)


def route(dataset, given: dict) -> tuple[bool, str]:
    """(True, why) when the fast path reads ``dataset``, else (False, why not).

    The fast path reads a store path, or an LMDBDataset without a target_transform whose
    transform is None or a recognised torchvision recipe, with no batch_sampler, collate_fn
    or sampler other than those ``check_sampler`` follows. An LMDBDataset given with
    store-only arguments takes it regardless, so that ``__init__`` says what is wrong.
    """
    if isinstance(dataset, (str, os.PathLike)):
        return True, "a store path"
    if not isinstance(dataset, LMDBDataset):
        return False, f"a {type(dataset).__name__} is not a store"
    if dataset.target_transform is not None:
        return False, "the LMDBDataset has a target_transform"
    why = "an LMDBDataset without a transform"
    if dataset.transform is not None:
        try:
            recipe = recognise(dataset.transform)
        except NotARecipe as e:
            return False, f"the LMDBDataset's transform is not a recognised recipe: {e}"
        why = f"the LMDBDataset's transform is the recipe {recipe}"
    if any(k in given for k in STORE_ONLY):
        return True, why
    sampler = given.get("sampler")
    if given.get("batch_sampler") is not None or given.get("collate_fn") is not None:
        return False, "a batch_sampler or collate_fn of your own was given"
    if sampler is not None and type(sampler) not in SAMPLERS:
        return False, f"sampler={type(sampler).__name__} is not one the loader follows"
    return True, why


def ignore_store_only(kwargs: dict, why: str) -> dict:
    """``kwargs`` less the store-only arguments, which torch's DataLoader does not take;
    warns once, naming them and ``why`` torch's DataLoader reads the dataset."""
    ours = [k for k in STORE_ONLY if k in kwargs]
    if ours:
        warnings.warn(
            f"loader.DataLoader: {', '.join(k + '=' for k in ours)} ignored: torch's "
            f"DataLoader reads this dataset ({why}) and they apply only to the fast path",
            stacklevel=3,
        )
    return {k: v for k, v in kwargs.items() if k not in STORE_ONLY}


def store_transform(dataset, transform: str | Transform | None) -> str | Transform | None:
    """``transform=``, or the recipe of an LMDBDataset's own transform (given once only)."""
    own = getattr(dataset, "transform", None)
    if own is None:
        return transform
    if transform is not None:
        raise ValueError(
            f"transform={transform!r} given to a loader.DataLoader over an LMDBDataset that "
            "has its own transform; give the transform once, on one or the other"
        )
    return recognise(own)


def open_store(dataset, **opening) -> tuple[Store, LMDBDataset]:
    """The store behind ``dataset`` (a path or an LMDBDataset) and a Dataset view of it;
    ``opening`` holds the ``cache=``, ``cache_limit=``, ``cache_root=``, ``max_pixels=``
    arguments.

    Raises:
        ingest.format.StoreError: the path is not a complete store (says how to make one).
        ValueError: one of these arguments is invalid, or given with an LMDBDataset.
    """
    if isinstance(dataset, LMDBDataset):
        given = [k + "=" for k, v in opening.items() if v is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)} cannot be given with an LMDBDataset, which opened the "
                "store already: pass them to LMDBDataset(root, ...) instead"
            )
        return dataset.store, dataset
    ds = LMDBDataset(dataset, **opening)
    return ds.store, ds


def check_not_for_store(sampler, batch_sampler, collate_fn) -> None:
    """Refuse what the fast path cannot follow, naming it as the cause."""
    if sampler is not None and type(sampler) not in SAMPLERS:
        raise ValueError(
            f"sampler={type(sampler).__name__} cannot be used when reading a store: the loader "
            "plans each epoch itself and follows only DistributedSampler, RandomSampler and "
            "SequentialSampler; for another sampler, pass loader.LMDBDataset(root, "
            "transform=<torchvision transform>) without store-only arguments and get "
            "torch's DataLoader"
        )
    pairs = (("batch_sampler", batch_sampler), ("collate_fn", collate_fn))
    given = [name for name, value in pairs if value is not None]
    if given:
        raise ValueError(
            f"{'/'.join(given)}= cannot be used when reading a store: the loader plans each "
            "epoch itself (shuffle=, seed=, rank=, world_size=) and batches pixels in shared "
            "memory; to use your own, pass loader.LMDBDataset(root, transform=<torchvision "
            "transform>) without store-only arguments and get torch's DataLoader"
        )


def check_sampler(sampler, shuffle, num_samples: int, rank, world_size) -> dict:
    """The ``EpochPlan`` arguments that follow ``sampler`` (and ``shuffle``, ``rank``,
    ``world_size``), with "seed" set to the sampler's seed when it has one, else None.

    Raises:
        ValueError: shuffle=True with a sampler (as torch), a sampler over another number
            of samples, or rank/world_size that contradict a DistributedSampler.
    """
    if sampler is None:
        return {"shuffle": bool(shuffle), "rank": rank, "world_size": world_size, "seed": None}
    name = type(sampler).__name__
    if shuffle:
        raise ValueError(f"sampler={name} and shuffle=True exclude each other (as in torch)")
    source = sampler.dataset if isinstance(sampler, DistributedSampler) else sampler.data_source
    if len(source) != num_samples:
        raise ValueError(
            f"sampler={name} is over {len(source)} samples but the store holds {num_samples}; "
            "build the sampler over the same dataset"
        )
    if isinstance(sampler, SequentialSampler):
        return {"shuffle": False, "rank": rank, "world_size": world_size, "seed": None}
    if isinstance(sampler, RandomSampler):
        if sampler.replacement or sampler._num_samples is not None:
            raise ValueError(
                "sampler=RandomSampler with replacement or num_samples cannot be used when "
                "reading a store: the loader reads each sample once per epoch"
            )
        seed = sampler.generator.initial_seed() if sampler.generator is not None else None
        return {"shuffle": True, "rank": rank, "world_size": world_size, "seed": seed}
    for arg, value, own in (("rank", rank, sampler.rank), ("world_size", world_size,
                            sampler.num_replicas)):  # fmt: skip
        if value is not None and value != own:
            raise ValueError(f"{arg}={value} contradicts the DistributedSampler's {own}")
    return {
        "shuffle": sampler.shuffle, "rank": sampler.rank, "world_size": sampler.num_replicas,
        "seed": sampler.seed, "even": "cut" if sampler.drop_last else "pad", "strided": True,
        "torch_order": True,
    }  # fmt: skip


def check_batch_size(batch_size) -> int:
    if batch_size is None:
        raise ValueError(
            "batch_size=None (no batching) is not supported when reading a store; "
            "pass the number of samples per batch"
        )
    return check_int("batch_size", batch_size, 1, "pass the number of samples per batch")


RESTARTED_WORKERS = (
    "loader.DataLoader: persistent_workers=False: the workers start again each epoch "
    "(persistent_workers=True keeps them and starts each epoch during the last)"
)


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


def check_worker_nice(nice) -> int:
    """``worker_nice`` checked: the niceness the workers add to their own, 0 to 19."""
    hint = "0 runs the workers at the training process's priority, 19 at the lowest"
    check_int("worker_nice", nice, 0, hint)
    if nice > 19:
        raise ValueError(f"worker_nice={nice!r} is invalid: it must be at most 19; {hint}")
    return int(nice)


def check_flag(name: str, value) -> bool:
    """A True / False argument checked (a string such as "no" is truthy: refused)."""
    if isinstance(value, (str, bytes)) or value not in (True, False):
        raise ValueError(f"{name}={value!r} is invalid: pass True or False")
    return bool(value)


def resolve_decoder(name: str, device) -> str:
    """The decoder backend ``decoder=`` asks for on ``device``: "auto" is the GPU path on
    a CUDA device, else "cpu". The GPU path: "dali" (the whole stage in DALI) where NVIDIA
    DALI is installed, as it is faster and leaves more of the GPU to training; else
    "nvjpeg" (torchvision's batched nvjpeg decode, which needs nothing beyond torchvision).

    Raises:
        ValueError: an unknown name, or a GPU decoder with a CPU device.
    """
    if name == "auto":
        if device.type != "cuda":
            return "cpu"
        try:
            import nvidia.dali  # noqa: F401  (imfeed[dali])
        except ImportError:
            pass
        else:
            return "dali"
        try:
            import_torchvision_io()  # the nvjpeg backend's only need
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


def resolve_seed(
    seed, generator, sampler_seed: int | None = None, world_size: int | None = None
) -> tuple[int, bool]:
    """(seed, chosen): ``seed=``, else the sampler's, else the initial seed of a torch
    ``generator``; else (chosen=False) one drawn from torch's global RNG as torch's
    DataLoader draws its base seed, rank 0's when the loader's ranks are torch.distributed's.
    Ranks given by ``world_size=`` > 1 outside torch.distributed cannot agree on a drawn
    seed: they use 0.

    Raises:
        ValueError: ``seed=`` is not a non-negative integer or contradicts the sampler's.
    """
    if seed is not None and sampler_seed is not None and seed != sampler_seed:
        raise ValueError(f"seed={seed!r} contradicts the sampler's seed {sampler_seed}; pass one")
    seed = sampler_seed if seed is None else seed
    if seed is None and generator is not None:
        seed = generator.initial_seed()
    if seed is not None:
        return check_int("seed", seed, 0, "pass a non-negative integer"), True
    group = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if group > 1 and world_size in (None, group):
        return _rank0_seed(), False
    return (0 if world_size not in (None, 1) else _drawn_seed()), False


def _drawn_seed() -> int:
    """A seed from torch's global RNG, as torch's DataLoader draws its base seed."""
    return int(torch.empty((), dtype=torch.int64).random_().item())


def _rank0_seed() -> int:
    """Rank 0's drawn seed on every rank (a broadcast: every rank builds its loader, as
    every rank builds its DDP model)."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
    value = torch.tensor([_drawn_seed()], dtype=torch.int64, device=device)
    dist.broadcast(value, src=0)
    return int(value.item())

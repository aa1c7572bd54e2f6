"""EpochPlan: seeded epoch order over a store's samples, split across ranks, resumable mid-epoch.

The order depends on ``seed``, ``epoch`` and the number of samples only (never on the world
size, rank or worker count), and each global step takes the next ``batch_size * world_size``
entries of it: the samples consumed so far are always a prefix of the order, which is all
``state_dict`` records, so a resume, at any world size, sees each remaining sample exactly
once. The tail is cut to whole steps (``drop_last``) or padded from the epoch's start, as
``DistributedSampler`` pads; ``like_distributed_sampler`` reproduces that sampler's batches
exactly. The full semantics: ``docs/design/loader.md``, "Epoch order, ranks and resume".
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator, Mapping

import numpy as np

_STATE_KEYS = ("epoch", "seed", "shuffle", "drop_last", "num_samples", "batch_size", "consumed")
# How a setting a saved state must share reads in a message, from its value.
_SAVED_WITH = {
    "num_samples": lambda n: f"a store of {n} samples",
    "seed": lambda seed: f"seed={seed}",
    "shuffle": lambda shuffle: f"shuffle={shuffle}",
    "torch_order": lambda torch: "a DistributedSampler's order" if torch else "the loader's order",
}
EVEN = ("pad", "cut")  # how the order is made a multiple of the world size (see the module doc)


def batch_seed(seed: int, epoch: int, step: int, *, rank: int = 0) -> int:
    """A seed for the random augmentation of one batch, in ``[0, 2**63)``.

    Depends only on its arguments, so a batch gets the same seed whatever the number of
    workers and after a resume. Pass ``rank`` so ranks of one step draw different numbers.
    """
    state = np.random.SeedSequence([seed, epoch, step, rank]).generate_state(1, dtype=np.uint64)
    return int(state[0] >> np.uint64(1))


def _torch_permutation(n: int, seed: int) -> np.ndarray:
    """``torch.randperm(n)`` from a generator seeded ``seed``, as DistributedSampler draws."""
    import torch  # lazy: only DistributedSampler's order needs it

    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randperm(n, generator=g).numpy()


def _dist_rank_world() -> tuple[int, int]:
    """(rank, world size) of the default torch.distributed group, or (0, 1) without one."""
    import torch.distributed as dist  # lazy: the plan itself needs only numpy

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def check_int(name: str, value: int, low: int, hint: str) -> int:
    """``value`` as an int, if it is an integer >= ``low``; else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {low}; {hint}")
    return int(value)


def check_state(state) -> None:
    """Refuse what is not a ``state_dict()`` output: not a mapping, keys missing, or a count
    that is not an integer (``step`` may be absent: states saved before it had none).

    Raises:
        ValueError: naming what is wrong, before anything reads the state.
    """
    if not isinstance(state, Mapping):
        raise ValueError(
            f"state={type(state).__name__} is not a state dict; pass the output of state_dict()"
        )
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"state dict lacks {missing}; pass the output of state_dict()")
    for key, low in (("num_samples", 1), ("seed", 0), ("consumed", 0), ("epoch", 0),
                     ("step", 0)):  # fmt: skip
        if key in state:
            check_int(f"state['{key}']", state[key], low, "the state dict is corrupt")


class EpochPlan:
    """Seeded epoch order over a store's samples, split across ranks, resumable.

    Args:
        num_samples: samples in the store (``len(store)``).
        batch_size: samples per batch on each rank.
        shuffle: a new seeded permutation each epoch instead of store order.
        seed: seed of the permutations (the same on every rank).
        drop_last: drop the tail that does not fill a whole step on every rank.
        rank: this process's rank; ``None`` takes it from ``torch.distributed`` (else 0).
        world_size: number of ranks; ``None`` takes it from ``torch.distributed`` (else 1).
        even: "pad" or "cut" the order to a multiple of ``world_size`` before batching,
            then ``drop_last`` drops partial batches only (DistributedSampler's way);
            ``None`` (the loader's own): pad unless ``drop_last``, which cuts whole steps.
        strided: rank ``r`` takes ``step[r::world_size]`` instead of the ``r``-th
            contiguous chunk (DistributedSampler's split).
        torch_order: shuffle with ``torch.randperm`` seeded ``seed + epoch``
            (DistributedSampler's permutation) instead of numpy's.

    Raises:
        ValueError: an argument is out of range (the message names it and the fix).
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, shuffle: bool = False, seed: int = 0,
        drop_last: bool = False, rank: int | None = None, world_size: int | None = None,
        even: str | None = None, strided: bool = False, torch_order: bool = False,
    ) -> None:  # fmt: skip
        if world_size is not None:
            check_int("world_size", world_size, 1, "pass the number of training processes")
        if rank is None or world_size is None:
            dist_rank, dist_world = _dist_rank_world()
            if rank is None and world_size == 1:
                dist_rank = 0  # one rank alone (an evaluation on rank 0): every rank agrees
            elif rank is None and world_size not in (None, dist_world):
                group = (f"torch.distributed's group has {dist_world}" if dist_world > 1 else
                         "or initialise torch.distributed first")  # fmt: skip
                raise ValueError(  # each rank would take rank 0's share: half the epoch, twice
                    f"world_size={world_size!r} without rank=: pass this process's rank (0 to "
                    f"{int(world_size) - 1}){'; ' if dist_world > 1 else ', '}{group}"
                )
            rank = dist_rank if rank is None else rank
            world_size = dist_world if world_size is None else world_size
        check_int("num_samples", num_samples, 1, "the store must hold at least one sample")
        check_int("batch_size", batch_size, 1, "pass a positive batch size")
        check_int("seed", seed, 0, "pass a non-negative seed")
        check_int("world_size", world_size, 1, "pass the number of training processes")
        if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world_size:
            raise ValueError(
                f"rank={rank!r} is invalid: it must be in [0, world_size={world_size}); "
                "pass this process's rank or initialise torch.distributed first"
            )
        if even not in (None, *EVEN):
            raise ValueError(f"even={even!r} is invalid: use None, 'pad' or 'cut'")
        self.num_samples, self.batch_size = int(num_samples), int(batch_size)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.rank, self.world_size = int(rank), int(world_size)
        self.even = even if even is not None else (None if self.drop_last else "pad")
        self.strided, self.torch_order = bool(strided), bool(torch_order)
        if len(self) == 0 and self.even == "cut" and self.num_samples < self.world_size:
            raise ValueError(  # the sampler's drop_last, not the loader's
                f"DistributedSampler(drop_last=True) over {world_size} replicas leaves no "
                f"sample of {num_samples} to any rank; pass drop_last=False to the sampler, "
                "or use fewer ranks"
            )
        if len(self) == 0:
            raise ValueError(
                f"drop_last=True with num_samples={num_samples} and batch_size*world_size="
                f"{batch_size * world_size} leaves no batch at all; lower batch_size or "
                "set drop_last=False"
            )
        self.epoch = 0
        self.consumed = 0  # samples of this epoch's order consumed by all ranks together
        self.step = 0  # global step index of the next batch, for batch_seed()
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, order) cache

    def order(self, epoch: int | None = None) -> np.ndarray:
        """The global sample order (int64) of ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self._order is None or self._order[0] != epoch:
            if self.shuffle and self.torch_order:
                order = _torch_permutation(self.num_samples, self.seed + epoch)
            elif self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            self._order = (epoch, order.astype(np.int64, copy=False))
        return self._order[1]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (as ``DistributedSampler.set_epoch``)."""
        check_int("epoch", epoch, 0, "epochs count from 0")
        self.epoch, self.consumed, self.step = int(epoch), 0, 0

    def reseed(self, seed: int) -> None:
        """Use ``seed`` for the orders from now on (the current epoch restarts)."""
        self.seed = check_int("seed", seed, 0, "pass a non-negative seed")
        self._order = None
        self.set_epoch(self.epoch)

    def end_epoch(self) -> None:
        """Move to the start of the next epoch."""
        self.set_epoch(self.epoch + 1)

    def _evened(self, remaining: int) -> int:
        """How many entries ``remaining`` unconsumed samples become across the ranks."""
        world = self.world_size
        if self.even == "pad":
            return -(-remaining // world) * world
        if self.even == "cut":
            return remaining // world * world
        return remaining

    def _steps(self, remaining: int) -> int:
        """Global steps (= batches per rank) left for ``remaining`` unconsumed samples."""
        span, n = self.batch_size * self.world_size, self._evened(remaining)
        return n // span if self.drop_last else -(-n // span)

    def rank_samples(self) -> int:
        """Samples this rank yields in a full epoch (the ``len`` of torch's sampler)."""
        n, span = self._evened(self.num_samples), self.batch_size * self.world_size
        return (n // span * span if self.drop_last else n) // self.world_size

    def __len__(self) -> int:
        return self._steps(self.num_samples)

    def remaining(self) -> int:
        """Batches this rank still yields in the current epoch, from the resume point."""
        return self._steps(self.num_samples - self.consumed)

    def batches(self) -> Iterator[np.ndarray]:
        """Yield this rank's batches (int64 global sample indices) for the rest of the epoch.

        ``consumed`` and ``step`` advance as each batch is yielded, so ``state_dict()`` taken
        after receiving ``k`` batches resumes after them. Does not start the next epoch: call
        ``end_epoch()`` or ``set_epoch()``.

        Raises:
            RuntimeError: the plan was moved (``set_epoch``, ``load_state_dict``) meanwhile.
        """
        epoch, start = self.epoch, self.consumed
        order = self.order(epoch)
        rest = order[start:]
        span, world = self.batch_size * self.world_size, self.world_size
        n = self._evened(len(rest))
        if n > len(rest):  # padded from the start of the epoch's order, cyclically
            rest = np.concatenate([rest, np.resize(order, n - len(rest))])
        if self.drop_last:
            n = n // span * span
        rest = rest[:n]
        for lo in range(0, len(rest), span):
            if (self.epoch, self.consumed) != (epoch, min(start + lo, self.num_samples)):
                raise RuntimeError(
                    "the plan was moved (set_epoch/end_epoch/load_state_dict) while "
                    "batches() was iterating; call batches() again"
                )
            chunk = rest[lo : lo + span]
            per_rank = len(chunk) // world
            self.consumed = min(start + lo + len(chunk), self.num_samples)
            self.step += 1
            if self.strided:
                yield chunk[self.rank :: world].copy()
            else:
                yield chunk[self.rank * per_rank : (self.rank + 1) * per_rank].copy()

    def state_dict(self) -> dict:
        """Progress as a plain JSON-able dict; world-size independent."""
        return {
            "epoch": self.epoch, "seed": self.seed, "shuffle": self.shuffle,
            "drop_last": self.drop_last, "num_samples": self.num_samples,
            "batch_size": self.batch_size, "consumed": self.consumed, "step": self.step,
            "torch_order": self.torch_order,
        }  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` output, possibly saved with another world size.

        ``batch_size`` and ``drop_last`` of this plan are kept (progress is counted in samples).

        Raises:
            ValueError: ``state`` is not a mapping, keys are missing, ``consumed``, ``epoch``
                or ``step`` is not a non-negative integer (before anything changes), or
                ``num_samples``/``seed``/``shuffle``/``torch_order`` differ, so the saved
                progress would refer to another order.
        """
        check_state(state)
        for key in ("num_samples", "seed", "shuffle", "torch_order"):
            # torch_order is absent from states saved before it existed: numpy's order.
            if state.get(key, False) != getattr(self, key):
                raise ValueError(
                    f"the state was saved with {_SAVED_WITH[key](state.get(key, False))}, and "
                    f"this loader reads with {_SAVED_WITH[key](getattr(self, key))}: the saved "
                    "progress is for another order; "
                    + ("load it into a loader of that store" if key == "num_samples" else
                       "build the loader as the saved one was") + ", or start afresh"
                )  # fmt: skip
        consumed = int(state["consumed"])
        if consumed > self.num_samples:
            raise ValueError(
                f"state['consumed']={consumed} exceeds num_samples={self.num_samples}; "
                "the state dict is corrupt"
            )
        span = self.batch_size * self.world_size
        self.set_epoch(int(state["epoch"]))
        self.consumed, self.step = consumed, int(state.get("step", -(-consumed // span)))


class RankSampler:
    """``DataLoader.sampler`` when no sampler was given: this rank's share of each epoch.

    ``len()`` is the number of samples this rank yields per epoch, iterating yields their
    indices in the current epoch, and ``set_epoch`` is the loader's.

    Args:
        plan: the loader's plan (read, never advanced).
        set_epoch: the loader's ``set_epoch``.
    """

    def __init__(self, plan: EpochPlan, set_epoch) -> None:
        self._plan = plan
        # A bound method would keep the loader (and its workers) alive.
        self._set_epoch = weakref.WeakMethod(set_epoch)

    def __len__(self) -> int:
        return self._plan.rank_samples()

    def __iter__(self) -> Iterator[int]:
        shadow = copy.copy(self._plan)
        shadow.set_epoch(self._plan.epoch)
        for batch in shadow.batches():
            yield from batch.tolist()

    @property
    def epoch(self) -> int:
        return self._plan.epoch

    def set_epoch(self, epoch: int) -> None:
        """The loader's ``set_epoch`` (as ``DistributedSampler.set_epoch``)."""
        self._set_epoch()(epoch)

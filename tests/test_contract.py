"""The loader's contract, run against every executor: the order is the sampler's, every
sample once per epoch, resume mid-epoch, world sizes, determinism, bad-sample replacement.

Executors: the CPU path with 0 and 2 workers; the GPU path with 0 and 2 workers (nvjpeg on
CUDA; without CUDA a CPU stand-in decoder and Triton's interpreter, see ``gpu_path_data``);
the DALI decoder where DALI is installed. All read one store of 23 small images (a PNG, a
progressive and a grayscale JPEG among them). Orders are compared with ``EpochPlan``'s and
indices across executors; pixels bit for bit only between runs of one executor or of its
other worker count (decoders differ within the tolerances the GPU path tests state).
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from gpu_path_data import (
    BACKEND,
    DEVICE,
    NUM_SAMPLES,
    SIZE,
    dali_backend,
    make_small_store,
    use_stand_ins,
)
from loader_data import corrupt

import loader
from loader.augment import Transform
from loader.store import Store

B = 8  # 23 samples: batches of 8, 8, 7
TRAIN = Transform("train", SIZE)


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


needs_triton = pytest.mark.skipif(not _has("triton"), reason="the GPU path needs Triton")
needs_dali = pytest.mark.skipif(not _has("nvidia.dali"), reason="needs NVIDIA DALI")
EXECUTORS = {  # name: the loader's arguments that pick it
    "cpu-0": {"device": "cpu", "decoder": "cpu", "num_workers": 0},
    "cpu-2": {"device": "cpu", "decoder": "cpu", "num_workers": 2},
    "gpu-0": {"device": DEVICE, "decoder": BACKEND, "num_workers": 0},
    "gpu-2": {"device": DEVICE, "decoder": BACKEND, "num_workers": 2},
    "dali-2": {"device": DEVICE, "decoder": dali_backend(), "num_workers": 2},
}
OTHER_WORKERS = {"cpu-0": "cpu-2", "cpu-2": "cpu-0", "gpu-0": "gpu-2", "gpu-2": "gpu-0"}
MARKS = {"gpu-0": [needs_triton], "gpu-2": [needs_triton], "dali-2": [needs_triton, needs_dali]}
every_executor = pytest.mark.parametrize(
    "executor", [pytest.param(name, marks=MARKS.get(name, [])) for name in EXECUTORS]
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_small_store(tmp_path_factory.mktemp("contract"))


@pytest.fixture(scope="module")
def damaged(store, tmp_path_factory):
    """(the source path of record 3, a copy of the store with record 3's image corrupt)."""
    return corrupt(store, tmp_path_factory.mktemp("contract-damaged"), 3)


@pytest.fixture(autouse=True)
def backends(monkeypatch):
    use_stand_ins(monkeypatch)


def make(store, executor: str, **kwargs) -> loader.DataLoader:
    args = {
        "batch_size": B, "transform": TRAIN, "dtype": torch.uint8, "with_indices": True,
        "shuffle": True, "seed": 5, **EXECUTORS[executor],
    }  # fmt: skip
    return loader.DataLoader(store, **{**args, **kwargs})


def epoch(dl) -> list[tuple]:
    return [tuple(t.cpu().clone() for t in batch) for batch in dl]


def indices(batches: list[tuple]) -> list[int]:
    return [i for b in batches for i in b[2].tolist()]


def same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True)
    )


def planned(epoch_: int = 0, **kwargs) -> list[list[int]]:
    """The batches ``EpochPlan`` plans for one rank of epoch ``epoch_``."""
    plan = loader.EpochPlan(NUM_SAMPLES, B, **{"shuffle": True, "seed": 5, **kwargs})
    plan.set_epoch(epoch_)
    return [b.tolist() for b in plan.batches()]


@every_executor
def test_the_order_is_the_samplers(store, executor):
    dl = make(store, executor)
    first, second = epoch(dl), epoch(dl)
    assert [b[2].tolist() for b in first] == planned(0)
    assert [b[2].tolist() for b in second] == planned(1)
    assert indices(first) != indices(second)
    dl.set_epoch(0)  # an epoch again is that epoch's order and batches again
    assert same(epoch(dl), first)
    in_order = make(store, executor, shuffle=False)
    assert indices(epoch(in_order)) == list(range(NUM_SAMPLES))


@every_executor
def test_every_sample_exactly_once_per_epoch(store, executor):
    dl = make(store, executor)
    labels = Store(store).labels
    for _ in range(2):
        batches = epoch(dl)
        assert [len(b[0]) for b in batches] == [8, 8, 7] and len(dl) == 3
        got = indices(batches)
        assert sorted(got) == list(range(NUM_SAMPLES))
        assert torch.cat([b[1] for b in batches]).tolist() == labels[got].tolist()
        assert all(b[0].shape[1:] == (3, SIZE, SIZE) for b in batches)
    assert dl.epoch == 2


@every_executor
def test_resume_mid_epoch_gives_exactly_the_rest(store, executor):
    dl = make(store, executor)
    it = iter(dl)
    head = [tuple(t.cpu().clone() for t in next(it)) for _ in range(2)]
    state = dl.state_dict()
    assert state["consumed"] == 2 * B and state["epoch"] == 0
    rest = [tuple(t.cpu().clone() for t in b) for b in it]
    later = epoch(dl)
    # A fresh loader, with the other worker count where there is one.
    resumed = make(store, OTHER_WORKERS.get(executor, executor))
    resumed.load_state_dict(state)
    resumed.set_epoch(0)  # the usual loop calls set_epoch(epoch) first: the resume is kept
    assert same(epoch(resumed), rest) and len(rest) == 1
    assert same(epoch(resumed), later)
    assert sorted(indices(head + rest)) == list(range(NUM_SAMPLES))


@every_executor
@pytest.mark.parametrize("world", [2, 3])
def test_the_ranks_share_each_epoch(store, executor, world):
    ranks = [make(store, executor, rank=r, world_size=world) for r in range(world)]
    parts = [epoch(r) for r in ranks]
    for r, part in enumerate(parts):
        assert [b[2].tolist() for b in part] == planned(rank=r, world_size=world)
    assert len({len(r) for r in ranks} | {len(p) for p in parts}) == 1
    assert len({len(indices(p)) for p in parts}) == 1  # the same share on every rank
    # The union is every sample once, and the few padded ones (the order's first) twice.
    union = Counter(i for p in parts for i in indices(p))
    pad = -NUM_SAMPLES % world
    order = loader.EpochPlan(NUM_SAMPLES, B, shuffle=True, seed=5).order()
    assert union == Counter(list(range(NUM_SAMPLES)) + order[:pad].tolist())
    # drop_last: whole steps only, the same number of full batches on every rank.
    cut = [make(store, executor, batch_size=4, rank=r, world_size=world, drop_last=True)
           for r in range(world)]  # fmt: skip
    kept = [indices(epoch(r)) for r in cut]
    assert all(len(k) == len(kept[0]) == len(cut[0]) * 4 for k in kept)
    flat = [i for k in kept for i in k]
    assert len(set(flat)) == len(flat) == NUM_SAMPLES // (4 * world) * 4 * world


@every_executor
def test_resume_with_another_world_size(store, executor):
    one = make(store, executor)
    it = iter(one)
    seen = indices([next(it)])
    state = one.state_dict()
    del it
    ranks = [make(store, executor, rank=r, world_size=2) for r in range(2)]
    for r in ranks:
        r.load_state_dict(state)
    parts = [indices(epoch(r)) for r in ranks]
    order = loader.EpochPlan(NUM_SAMPLES, B, shuffle=True, seed=5).order().tolist()
    rest = order[B:] + order[: (NUM_SAMPLES - B) % 2]  # padded to a multiple of 2
    assert len(parts[0]) == len(parts[1]) == len(rest) // 2
    assert Counter(parts[0] + parts[1]) == Counter(rest)
    assert set(seen + parts[0] + parts[1]) == set(range(NUM_SAMPLES))


@every_executor
def test_same_seed_same_batches(store, executor):
    a = epoch(make(store, executor))
    assert same(epoch(make(store, executor)), a)  # pixels, labels and indices
    if executor in OTHER_WORKERS:
        assert same(epoch(make(store, OTHER_WORKERS[executor])), a)
    other = epoch(make(store, executor, seed=6))
    assert indices(other) != indices(a)
    # The same order, other augmentation draws: the seed reaches the windows too.
    mine, theirs = (epoch(make(store, executor, shuffle=False, seed=s)) for s in (5, 6))
    assert indices(mine) == indices(theirs)
    assert not torch.equal(torch.cat([b[0] for b in mine]), torch.cat([b[0] for b in theirs]))


@every_executor
def test_a_corrupt_sample_is_replaced_and_counted(damaged, executor, caplog):
    path, copy = damaged
    fresh = epoch(make(copy, executor, shuffle=False))  # another loader: it logs on its own
    reference = indices(epoch(make(copy, "cpu-0", shuffle=False)))
    dl = make(copy, executor, shuffle=False)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loader"):
        batches, again = epoch(dl), epoch(dl)
    assert [len(b[0]) for b in batches] == [len(b[0]) for b in again] == [8, 8, 7]
    got = indices(batches)
    assert 3 not in got and len(got) == NUM_SAMPLES
    assert list(dl.bad_samples) == [3] and dl.bad_samples[3].startswith(path)
    assert dl.num_replaced == 2  # once per epoch
    assert indices(again) == got  # replaced reproducibly: by the same sample each epoch
    assert same(fresh, batches) and reference == got  # by a new loader, by every executor
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    said = [w for w in warnings if "sample 3 " in w]
    assert len(said) == 1 and path in said[0]  # logged once


@pytest.mark.parametrize(
    "executor", [pytest.param("cpu-2"), pytest.param("gpu-2", marks=needs_triton)]
)
def test_spawned_workers_deliver_the_same_epoch(store, executor):
    """Workers started by "spawn" (a common choice beside CUDA) get the same tasks: the
    producer they are sent pickles (the GPU stage's hold on it once did not)."""
    forked = epoch(make(store, executor))
    spawned = epoch(make(store, executor, multiprocessing_context="spawn"))
    assert same(spawned, forked)

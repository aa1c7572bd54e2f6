"""loader.DataLoader with sampler=: DistributedSampler's batches reproduced, set_epoch followed,
evaluation that counts each sample once, RandomSampler/SequentialSampler, .sampler/.dataset,
and the samplers it cannot follow refused with the sampler named."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.utils.data
import torchvision.transforms as T
from loader_data import NUM_SAMPLES, make_store
from torch.utils.data import DistributedSampler, RandomSampler, SequentialSampler

import loader
from loader.plan.sampler import EpochPlan

B = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("follow"))


@pytest.fixture(scope="module")
def ds(store):
    return loader.LMDBDataset(store)


def make(ds, **kwargs) -> loader.DataLoader:
    args = {"batch_size": B, "transform": "eval", "image_size": 32, "device": "cpu"}
    return loader.DataLoader(ds, **{**args, "with_indices": True, **kwargs})


def read(dl) -> list[list[int]]:
    return [batch[2].tolist() for batch in dl]


def torchs(sampler, drop_last: bool = False) -> list[list[int]]:
    """The batches of indices torch's DataLoader yields over ``sampler``."""
    dl = torch.utils.data.DataLoader(range(NUM_SAMPLES), B, sampler=sampler, drop_last=drop_last)
    return [b.tolist() for b in dl]


@pytest.mark.parametrize(
    "n, world, shuffle, sampler_drop, drop_last",
    [
        (n, w, s, sd, dl)
        for n, w, s, sd, dl in itertools.product(
            [1, 7, 10, 63, 64], [1, 2, 3], [False, True], [False, True], [False, True]
        )
        if (n // w if sd else -(-n // w)) >= (B if dl else 1)  # else torch yields nothing
    ],
)
def test_plan_reproduces_distributed_sampler_batches(n, world, shuffle, sampler_drop, drop_last):
    data = range(n)
    for rank, epoch in itertools.product(range(world), (0, 3)):
        sampler = DistributedSampler(data, world, rank, shuffle, seed=9, drop_last=sampler_drop)
        sampler.set_epoch(epoch)
        ref = [b.tolist() for b in torch.utils.data.DataLoader(data, B, sampler=sampler,
                                                               drop_last=drop_last)]  # fmt: skip
        plan = EpochPlan(n, B, shuffle=shuffle, seed=9, drop_last=drop_last, rank=rank,
                         world_size=world, even="cut" if sampler_drop else "pad", strided=True,
                         torch_order=True)  # fmt: skip
        plan.set_epoch(epoch)
        assert [b.tolist() for b in plan.batches()] == ref and len(plan) == len(ref)


def test_a_distributed_sampler_that_leaves_no_rank_a_sample_says_so():
    """torch yields nothing there; the loader refuses, and the advice was the loader's
    drop_last and batch_size, which were not the cause."""
    with pytest.raises(ValueError, match=r"^DistributedSampler\(drop_last=True\) over 3 "
                       r"replicas leaves no sample of 2 to any rank; pass drop_last=False to "
                       r"the sampler, or use fewer ranks$"):  # fmt: skip
        EpochPlan(2, 1, rank=0, world_size=3, even="cut", strided=True, torch_order=True)


def test_loader_follows_distributed_sampler_and_its_set_epoch(ds):
    for rank in range(3):
        sampler = DistributedSampler(ds, num_replicas=3, rank=rank, seed=4)
        dl = make(ds, sampler=sampler, num_workers=rank % 2)
        assert dl.sampler is sampler and dl.dataset is ds
        assert len(dl.sampler) == 21 and len(dl) == 3
        for epoch in (0, 5, 1):
            sampler.set_epoch(epoch)
            assert read(dl) == torchs(sampler)


def test_the_distributed_samplers_epoch_decides_as_in_torch(ds):
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, seed=4)
    sampler.set_epoch(3)  # before the loader exists
    dl = make(ds, sampler=sampler)
    assert dl.epoch == 3
    first, second = read(dl), read(dl)  # no set_epoch between: epoch 3 again, as torch
    assert first == second == torchs(sampler)
    sampler.set_epoch(4)
    assert dl.epoch == 4 and read(dl) == torchs(sampler) != first
    sampler.set_epoch(3)
    assert read(dl) == first
    dl.set_epoch(6)  # the loader's set_epoch is the sampler's
    assert sampler.epoch == 6 and read(dl) == torchs(sampler)


def test_evaluation_counts_each_sample_once(ds):
    """imagenet/main.py's way: DistributedSampler(shuffle=False, drop_last=True) on every
    rank, then an extra pass over range(len(sampler) * world_size, len(dataset))."""
    world, seen = 4, []
    for rank in range(world):
        sampler = DistributedSampler(ds, world, rank, shuffle=False, drop_last=True)
        dl = make(ds, sampler=sampler, batch_size=4)
        assert len(dl.sampler) == 15 and [len(b) for b in read(dl)] == [4, 4, 4, 3]
        seen += [i for batch in read(dl) for i in batch]
    rest = list(range(len(dl.sampler) * world, len(dl.dataset)))
    assert rest == [60, 61, 62]
    assert sorted(seen + rest) == list(range(NUM_SAMPLES))


def test_resume_with_a_distributed_sampler(ds):
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, seed=1)
    sampler.set_epoch(2)
    full = read(make(ds, sampler=sampler))
    dl = make(ds, sampler=sampler)
    it = iter(dl)
    head = [next(it)[2].tolist() for _ in range(2)]
    state = dl.state_dict()
    assert state["torch_order"] is True and state["epoch"] == 2 and state["seed"] == 1
    again = make(ds, sampler=sampler)
    again.load_state_dict(state)
    sampler.set_epoch(2)  # the script's set_epoch of the same epoch keeps the resume
    assert head + read(again) == full
    with pytest.raises(
        ValueError,
        match=r"saved with a DistributedSampler's order, and this loader reads with the loader's",
    ):
        make(ds, shuffle=True, seed=1).load_state_dict(state)


def test_the_epoch_named_is_the_one_read_with_a_sampler_never_moved_on(ds):
    """A DistributedSampler without set_epoch repeats its epoch, as in torch; a loader
    given a state saved after one epoch named epoch 1 (``dl.epoch``) and read epoch 0."""
    sampler = DistributedSampler(ds, num_replicas=2, rank=0, seed=1)
    dl = make(ds, sampler=sampler)
    first = read(dl)
    assert dl.epoch == 0 and dl.state_dict()["epoch"] == 1  # the sampler was not moved on
    again = make(ds, sampler=sampler)
    again.load_state_dict(dl.state_dict())
    assert again.epoch == 0 and read(again) == first  # named, then read: epoch 0


def test_random_and_sequential_samplers(ds):
    gen = torch.Generator()
    gen.manual_seed(4)
    shuffled = make(ds, sampler=RandomSampler(ds, generator=gen))
    assert read(shuffled) == read(make(ds, shuffle=True, seed=4))
    in_order = read(make(ds, sampler=SequentialSampler(ds)))
    assert [i for b in in_order for i in b] == list(range(NUM_SAMPLES))


def test_own_sampler_is_this_ranks_share(store):
    dl = make(store, shuffle=True, seed=2, rank=1, world_size=2)
    assert isinstance(dl.dataset, loader.LMDBDataset) and len(dl.dataset) == NUM_SAMPLES
    assert len(dl.sampler) == 32  # 63 samples padded to 64, half each
    assert list(dl.sampler) == [i for b in read(dl) for i in b][: len(dl.sampler)]
    dl.sampler.set_epoch(5)
    assert dl.epoch == 5 and list(dl.sampler) == [i for b in read(dl) for i in b]
    dropped = make(store, rank=0, world_size=2, drop_last=True)
    assert len(dropped.sampler) == 24 == sum(map(len, read(dropped)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (
            {"sampler": torch.utils.data.WeightedRandomSampler([1.0] * 63, 63)},
            r"sampler=WeightedRandomSampler cannot be used when reading a store: the loader "
            r"plans each epoch itself and follows only DistributedSampler",
        ),
        (
            {"sampler": "dist", "shuffle": True},
            r"sampler=DistributedSampler and shuffle=True exclude each other \(as in torch\)",
        ),
        (
            {"sampler": DistributedSampler(range(10), 2, 0)},
            r"sampler=DistributedSampler is over 10 samples but the store holds 63",
        ),
        (
            {"sampler": RandomSampler(range(63), replacement=True)},
            r"sampler=RandomSampler with replacement or num_samples cannot be used",
        ),
        ({"sampler": "dist", "rank": 1}, r"rank=1 contradicts the DistributedSampler's 0"),
        ({"sampler": "dist", "seed": 3}, r"seed=3 contradicts the sampler's seed 0; pass one"),
        ({"batch_sampler": [[0]]}, r"batch_sampler= cannot be used when reading a store"),
    ],
)
def test_samplers_it_cannot_follow_are_named(ds, kwargs, match):
    if kwargs.get("sampler") == "dist":
        kwargs["sampler"] = DistributedSampler(ds, 2, 0)
    with pytest.raises(ValueError, match=match):
        make(ds, **kwargs)


def test_a_recipe_dataset_with_another_sampler_is_torchs(store):
    """Without store-only arguments, a sampler the loader cannot follow gets torch's
    DataLoader; with them (here transform="train"), the error names the sampler."""
    tf = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor()])
    ds = loader.LMDBDataset(store, transform=tf)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * NUM_SAMPLES, 4)
    dl = loader.DataLoader(ds, batch_size=4, sampler=weighted)
    assert type(dl) is torch.utils.data.DataLoader
    images, labels = next(iter(dl))
    assert images.shape == (4, 3, 32, 32) and labels.dtype == torch.int64
    plain = loader.LMDBDataset(store)
    with pytest.raises(ValueError, match=r"sampler=WeightedRandomSampler cannot be used"):
        loader.DataLoader(plain, batch_size=4, sampler=weighted, transform="train")


def test_len_matches_torchs_for_every_tail(ds):
    for world, sampler_drop, drop_last in itertools.product([2, 5], [False, True], [False, True]):
        sampler = DistributedSampler(ds, world, world - 1, seed=3, drop_last=sampler_drop)
        dl = make(ds, sampler=sampler, drop_last=drop_last)
        ref = torchs(sampler, drop_last)
        assert len(dl) == len(ref) and read(dl) == ref

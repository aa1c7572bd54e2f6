"""The loader's seed follows torch: drawn from torch's global RNG unless given, the same on
every rank (rank 0's under torch.distributed), recorded by state_dict and adopted on resume."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from loader_data import NUM_SAMPLES, make_store

import loader

B = 8
_TIMEOUT = datetime.timedelta(seconds=30)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("seeding"))


def make(store, **kwargs) -> loader.DataLoader:
    args = {"batch_size": B, "transform": "eval", "image_size": 32, "device": "cpu"}
    return loader.DataLoader(store, **{**args, "with_indices": True, "shuffle": True, **kwargs})


def order(dl) -> list[int]:
    return [i for batch in dl for i in batch[2].tolist()]


def test_torch_manual_seed_makes_runs_repeatable(store):
    torch.manual_seed(5)
    a = make(store)
    torch.manual_seed(5)
    b = make(store)
    c = make(store)  # the global RNG moved on: another seed, as an unseeded run
    assert a.seed == b.seed != c.seed
    assert order(a) == order(b) != order(c)
    assert sorted(order(c)) == list(range(NUM_SAMPLES))
    assert a.state_dict()["seed"] == a.seed


def test_given_seeds_win(store):
    gen = torch.Generator()
    gen.manual_seed(9)
    assert make(store, seed=4).seed == 4 and make(store, generator=gen).seed == 9
    assert order(make(store, seed=4)) == order(make(store, seed=4))


def test_ranks_outside_torch_distributed_agree_on_seed_zero(store):
    ranks = [make(store, rank=r, world_size=2) for r in range(2)]
    assert [r.seed for r in ranks] == [0, 0]
    first, second = order(ranks[0]), order(ranks[1])
    # 63 samples padded to 64 with the epoch's first sample, which rank 0 reads first
    assert sorted(first + second) == sorted([*range(NUM_SAMPLES), first[0]])


def test_a_drawn_seed_yields_to_the_saved_one(store):
    first = make(store)
    it = iter(first)
    head = [next(it)[2].tolist() for _ in range(3)]
    state = first.state_dict()
    full = order(make(store, seed=first.seed))
    resumed = make(store)  # unseeded: it draws another seed, then takes the saved one
    assert resumed.seed != first.seed
    resumed.load_state_dict(state)
    assert resumed.seed == first.seed and resumed.state_dict()["seed"] == first.seed
    assert [i for b in head for i in b] + order(resumed) == full
    with pytest.raises(ValueError, match=rf"saved with seed={first.seed}, and this loader reads"):
        make(store, seed=first.seed + 1).load_state_dict(state)


def _rank(rank: int, port: int, store, out) -> None:
    url = f"tcp://127.0.0.1:{port}"
    # A collective that only one rank calls fails after the timeout instead of hanging.
    dist.init_process_group("gloo", init_method=url, world_size=2, rank=rank, timeout=_TIMEOUT)
    torch.manual_seed(100 + rank)  # unseeded ranks draw different numbers
    dl = make(store)
    out[rank] = (dl.seed, order(dl))
    if rank == 0:  # a loader of this rank alone (say, for evaluation) draws its own seed
        out["alone"] = make(store, rank=0, world_size=1).seed
    dist.barrier()
    dist.destroy_process_group()


def test_under_torch_distributed_every_rank_uses_rank_0s_seed(store):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(port, store, out), nprocs=2)
        (seed0, order0), (seed1, order1), out_alone = out[0], out[1], out["alone"]
    torch.manual_seed(100)
    assert seed0 == seed1 == int(torch.empty((), dtype=torch.int64).random_().item())
    # rank 0's next draw is the alone loader's: it did not take part in a broadcast
    assert out_alone == int(torch.empty((), dtype=torch.int64).random_().item())
    assert len(order0) == len(order1) == 32  # 63 padded to 64, half each
    assert set(order0) | set(order1) == set(range(NUM_SAMPLES))

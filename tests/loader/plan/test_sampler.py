"""Tests of loader.plan.sampler: exactly-once epochs, ranks, resume, determinism, bad arguments."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest

from loader.plan.sampler import EpochPlan, batch_seed
from loader.plan.tasks import EpochTasks


def plans(world: int, n: int, bs: int, **kw) -> list[EpochPlan]:
    return [EpochPlan(n, bs, rank=r, world_size=world, **kw) for r in range(world)]


def drain(plan: EpochPlan, k: int | None = None) -> list[list[int]]:
    """The next ``k`` batches of ``plan`` (all that remain by default), as lists."""
    out = []
    for batch in plan.batches():
        assert batch.dtype == np.int64
        out.append(batch.tolist())
        if k is not None and len(out) == k:
            break
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize(("n", "bs"), [(1, 1), (1, 4), (10, 3), (12, 4), (12, 12), (7, 100)])
def test_single_process_exactly_once(shuffle: bool, n: int, bs: int) -> None:
    plan = EpochPlan(n, bs, shuffle=shuffle, seed=3, rank=0, world_size=1)
    assert plan.remaining() == len(plan) == -(-n // bs)
    batches = drain(plan)
    assert len(batches) == len(plan)
    assert [len(b) for b in batches] == [bs] * (n // bs) + ([n % bs] if n % bs else [])
    assert sorted(flat(batches)) == list(range(n))
    assert (flat(batches) == list(range(n))) == (not shuffle or n == 1)
    assert plan.remaining() == 0 and plan.consumed == n and plan.step == len(batches)
    assert drain(plan) == []  # no auto-advance
    plan.end_epoch()
    assert plan.epoch == 1 and plan.consumed == 0 and plan.remaining() == len(plan)


def test_single_process_drop_last() -> None:
    plan = EpochPlan(10, 3, shuffle=True, drop_last=True, rank=0, world_size=1)
    batches = drain(plan)
    assert len(batches) == len(plan) == 3 and all(len(b) == 3 for b in batches)
    assert flat(batches) == plan.order()[:9].tolist()


def _dist_worker(rank: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        result = {}
        for name, (n, bs, drop_last) in DIST_CASES.items():
            plan = EpochPlan(n, bs, shuffle=True, seed=5, drop_last=drop_last)
            result[name] = {
                "rank": plan.rank, "world": plan.world_size, "len": len(plan),
                "batches": drain(plan), "order": plan.order().tolist(),
            }  # fmt: skip
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


DIST_CASES = {  # name: (num_samples, batch_size, drop_last)
    "divisible": (24, 4, False),
    "padded": (23, 4, False),
    "padded_short_tail": (23, 5, False),
    "drop_last": (23, 4, True),
}


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    import torch.multiprocessing as mp

    tmp = tmp_path_factory.mktemp("dist")
    mp.spawn(_dist_worker, args=(f"file://{tmp}/rendezvous", str(tmp)), nprocs=2, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_processes_divisible(dist_results: list[dict]) -> None:
    r0, r1 = (res["divisible"] for res in dist_results)
    assert (r0["rank"], r0["world"], r1["rank"], r1["world"]) == (0, 2, 1, 2)
    assert r0["len"] == r1["len"] == len(r0["batches"]) == len(r1["batches"]) == 3
    seen = flat(r0["batches"]) + flat(r1["batches"])
    assert len(seen) == 24 and sorted(seen) == list(range(24))
    assert r0["order"] == r1["order"]
    # step k: rank 0 takes order[8k:8k+4], rank 1 order[8k+4:8k+8]
    assert r0["batches"][1] == r0["order"][8:12] and r1["batches"][1] == r0["order"][12:16]


def test_two_processes_padded(dist_results: list[dict]) -> None:
    for name, sizes in [("padded", [4, 4, 4]), ("padded_short_tail", [5, 5, 2])]:
        r0, r1 = (res[name] for res in dist_results)
        assert r0["len"] == r1["len"] == len(r0["batches"]) == len(r1["batches"]) == 3
        assert [len(b) for b in r0["batches"]] == [len(b) for b in r1["batches"]] == sizes
        counts = Counter(flat(r0["batches"]) + flat(r1["batches"]))
        assert sorted(counts) == list(range(23)) and sum(counts.values()) == 24
        assert [i for i, c in counts.items() if c == 2] == [r0["order"][0]]  # the one repeat


def test_two_processes_drop_last(dist_results: list[dict]) -> None:
    r0, r1 = (res["drop_last"] for res in dist_results)
    assert r0["len"] == r1["len"] == len(r0["batches"]) == len(r1["batches"]) == 2
    seen = flat(r0["batches"]) + flat(r1["batches"])
    assert sorted(seen) == sorted(r0["order"][:16])  # the last 7 of the order are dropped


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_mid_epoch(world: int, drop_last: bool) -> None:
    kw = {"shuffle": True, "seed": 11, "drop_last": drop_last}
    full = plans(world, 29, 3, **kw)
    expected = [[drain(p) for p in full]]
    for p in full:
        p.end_epoch()
    expected.append([drain(p) for p in full])

    part = plans(world, 29, 3, **kw)
    head = [drain(p, 2) for p in part]
    state = json.loads(json.dumps(part[0].state_dict()))
    assert state["consumed"] == 2 * 3 * world and state["step"] == 2
    assert all(p.state_dict() == state for p in part)
    fresh = plans(world, 29, 3, **kw)
    for p in fresh:
        p.load_state_dict(state)
        assert p.remaining() == len(p) - 2 and p.step == 2
    tail = [drain(p) for p in fresh]
    assert [h + t for h, t in zip(head, tail, strict=True)] == expected[0]
    for p in fresh:
        p.end_epoch()
    assert [drain(p) for p in fresh] == expected[1]


@pytest.mark.parametrize(("new_world", "drop_last"), [(3, False), (1, False), (3, True)])
def test_resume_with_other_world_size(new_world: int, drop_last: bool) -> None:
    n, bs = 31, 2
    old = plans(2, n, bs, shuffle=True, seed=4, drop_last=drop_last)
    seen = flat([b for p in old for b in drain(p, 3)])
    state = old[0].state_dict()
    assert state["consumed"] == 12 and sorted(seen) == sorted(old[0].order()[:12].tolist())

    new = plans(new_world, n, bs, shuffle=True, seed=4, drop_last=drop_last)
    for p in new:
        p.load_state_dict(state)
        assert (p.consumed, p.step) == (12, 3)  # step keeps counting for batch_seed
    lens = [p.remaining() for p in new]
    rest = [drain(p) for p in new]
    assert [len(r) for r in rest] == lens and len(set(lens)) == 1
    counts = Counter(seen + flat([b for r in rest for b in r]))
    left = new[0].order()[12:].tolist()
    if drop_last:  # whole steps of bs * new_world = 6 from the 19 left: 18, last one dropped
        assert sorted(counts) == sorted(new[0].order()[:30].tolist())
        assert set(counts.values()) == {1}
    else:  # 19 left over 3 ranks pads 2 (the first two of the epoch); over 1 rank pads none
        pad = -len(left) % new_world
        assert sorted(counts) == list(range(n)) and sum(counts.values()) == n + pad
        first = new[0].order()[:pad].tolist()
        assert sorted(i for i, c in counts.items() if c == 2) == sorted(first)
        merged = flat([b for step in zip(*rest, strict=True) for b in step])
        assert merged[len(merged) - pad :] == first  # the padding closes the epoch


def test_determinism_and_variation() -> None:
    def order(seed: int, epoch: int, world: int = 1) -> list[int]:
        ps = plans(world, 50, 4, shuffle=True, seed=seed)
        for p in ps:
            p.set_epoch(epoch)
        return [i for step in zip(*(drain(p) for p in ps), strict=True) for b in step for i in b]

    assert order(1, 0) == order(1, 0) == order(1, 0, world=2)[:50]
    assert order(1, 0) != order(2, 0) and order(1, 0) != order(1, 1)
    assert order(1, 3) == EpochPlan(50, 4, shuffle=True, seed=1, world_size=1).order(3).tolist()
    ref = np.random.default_rng([1, 3]).permutation(50).tolist()
    assert order(1, 3) == ref


def test_set_epoch_resets_progress() -> None:
    plan = EpochPlan(10, 2, shuffle=True, rank=0, world_size=1)
    drain(plan, 2)
    plan.set_epoch(4)
    assert (plan.epoch, plan.consumed, plan.step, plan.remaining()) == (4, 0, 0, 5)
    it = plan.batches()
    next(it)
    plan.set_epoch(5)
    with pytest.raises(RuntimeError, match=r"call batches\(\) again"):
        next(it)


def test_batch_seed() -> None:
    s = batch_seed(7, 2, 5)
    assert s == batch_seed(7, 2, 5) and 0 <= s < 2**63 and isinstance(s, int)
    others = {batch_seed(8, 2, 5), batch_seed(7, 3, 5), batch_seed(7, 2, 6), s}
    assert len(others | {batch_seed(7, 2, 5, rank=1)}) == 5


def test_no_distributed_defaults_to_single_rank() -> None:
    plan = EpochPlan(5, 2)
    assert (plan.rank, plan.world_size) == (0, 1)


@pytest.mark.parametrize(
    ("args", "kw", "match"),
    [
        ((0, 4), {}, r"num_samples=0 .*>= 1"),
        ((10, 0), {}, r"batch_size=0 .*>= 1.*positive batch size"),
        ((10, 2.5), {}, r"batch_size=2.5"),
        ((10, 2), {"seed": -1}, r"seed=-1 .*non-negative"),
        ((10, 2), {"rank": 2, "world_size": 2}, r"rank=2 .*\[0, world_size=2\)"),
        ((10, 2), {"rank": -1, "world_size": 2}, r"rank=-1"),
        ((10, 2), {"rank": 0, "world_size": 0}, r"world_size=0"),
        (
            (5, 4),
            {"drop_last": True, "rank": 0, "world_size": 2},
            r"drop_last=True.*set drop_last=False",
        ),
        # Each rank took rank 0's share: half the epoch, twice, without a word.
        (
            (10, 2),
            {"world_size": 2},
            r"^world_size=2 without rank=: pass this process's rank "
            r"\(0 to 1\), or initialise torch.distributed first$",
        ),
        ((10, 2), {"world_size": "2"}, r"^world_size='2' is invalid: it must be an integer"),
    ],
)
def test_bad_arguments(args: tuple, kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EpochPlan(*args, **kw)


def test_bad_state_and_epoch() -> None:
    plan = EpochPlan(10, 2, shuffle=True, seed=1, world_size=1)
    state = plan.state_dict()
    with pytest.raises(ValueError, match=r"^the state was saved with a store of 11 samples, "
                       r"and this loader reads with a store of 10 samples: the saved progress "
                       r"is for another order; load it into a loader of that store, or start "
                       r"afresh$"):  # fmt: skip
        plan.load_state_dict({**state, "num_samples": 11})
    with pytest.raises(ValueError, match=r"saved with seed=2, and this loader reads with seed=1"):
        plan.load_state_dict({**state, "seed": 2})
    with pytest.raises(ValueError, match=r"saved with shuffle=False, and this loader reads with "
                       r"shuffle=True"):  # fmt: skip
        plan.load_state_dict({**state, "shuffle": False})
    # Each refused before anything changed (a bad step failed later, with numpy's message).
    with pytest.raises(ValueError, match=r"^state=NoneType is not a state dict; pass the output"):
        plan.load_state_dict(None)
    for key, value in (("step", -3), ("step", "x"), ("epoch", 1.5), ("consumed", True)):
        with pytest.raises(ValueError, match=rf"state\['{key}'\]=.* is invalid: it must be an "
                           r"integer >= 0; the state dict is corrupt"):  # fmt: skip
            plan.load_state_dict({**state, key: value})
    assert plan.state_dict() == state
    with pytest.raises(ValueError, match=r"lacks \['consumed'\]"):
        plan.load_state_dict({k: v for k, v in state.items() if k != "consumed"})
    with pytest.raises(ValueError, match=r"consumed'\]=11 exceeds num_samples=10"):
        plan.load_state_dict({**state, "consumed": 11})
    with pytest.raises(ValueError, match=r"epoch=-1"):
        plan.set_epoch(-1)


def test_epoch_tasks_go_on_into_the_epochs_allowed():
    plan = EpochPlan(20, 8, shuffle=True, seed=3)  # steps of 8, 8, 4
    first = next(plan.batches())  # one batch delivered: the rest starts at step 1
    tasks = EpochTasks(plan, seed=9, ahead=1)
    got = list(itertools.islice(tasks, 5))  # the rest of epoch 0, then epoch 1 whole
    assert [key for key, _, _ in got] == [1, 2, 3, 4, 5]
    assert list(tasks.ends) == [3, 6]
    later = EpochPlan(20, 8, shuffle=True, seed=3)
    later.set_epoch(1)
    want = list(plan.order(0)[8:]), list(later.order(1))
    assert np.concatenate([i for _, i, _ in got[:2]]).tolist() == want[0]
    assert np.concatenate([i for _, i, _ in got[2:]]).tolist() == want[1]
    assert [s for _, _, s in got] == [
        batch_seed(9, 0, 1),
        batch_seed(9, 0, 2),
        *(batch_seed(9, 1, k) for k in range(3)),
    ]
    assert len(first) == 8 and plan.step == 1  # the plan itself is not moved
    assert next(tasks, None) is None and not tasks.wait(0.01)  # no epoch allowed further
    tasks.allow()
    assert tasks.wait(0.01) and next(tasks)[0] == 6 and list(tasks.ends) == [3, 6, 9]

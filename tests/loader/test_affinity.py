"""``pin_training_thread=True``: while an iteration runs, the iterating thread alone on the
first CPU of the process's set, the workers and every other thread of the process on the
others; afterwards every thread back on the whole set; the batches those of a loader
without it."""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch
from loader_data import make_store

import loader
from loader import affinity

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("affinity"))


@pytest.fixture
def restored():
    """Every thread of this process back on all its CPUs afterwards (the tests' own)."""
    yield
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has ended
            os.sched_setaffinity(int(tid), CORES)


def make(store, **kwargs) -> loader.DataLoader:
    args = dict(batch_size=4, transform="eval", image_size=16, device="cpu", shuffle=True, seed=0)
    return loader.DataLoader(store, **{**args, **kwargs})


@two_cores
def test_while_iterating_the_thread_keeps_its_cpu_and_gives_all_back_after(store, restored):
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # a thread of the process, started before
    other.start()
    dl = make(store, num_workers=2, persistent_workers=True, pin_training_thread=True)
    want = [(x, y) for x, y in make(store, num_workers=2)]
    own, rest = {CORES[0]}, set(CORES[1:])
    try:
        for epoch in range(2):  # persistent workers: the same processes, placed again
            got, seen = [], []
            for x, y in dl:
                got.append((x.clone(), y.clone()))
                seen.append(
                    (os.sched_getaffinity(0), os.sched_getaffinity(other.native_id),
                     [os.sched_getaffinity(pid) for pid in dl.worker_pids])
                )  # fmt: skip
            assert seen[2:] == [(own, rest, [rest, rest])] * (len(seen) - 2), epoch
            assert os.sched_getaffinity(0) == set(CORES)  # the epoch over: all given back
            assert os.sched_getaffinity(other.native_id) == set(CORES)
            assert len(got) == len(want)
            for (x, y), (wx, wy) in zip(got, want, strict=True):
                assert torch.equal(x, wx) and torch.equal(y, wy)
            dl.set_epoch(0)  # the same order again, to compare with the same batches
    finally:
        idle.set()
        other.join()
        dl.close()


@two_cores
def test_the_threads_are_placed_at_the_start_and_after_two_batches_only(store, monkeypatch):
    calls = []
    for module in (loader.session, loader.epoch):
        monkeypatch.setattr(module, "take", lambda cores: calls.append(cores))
    dl = make(store, num_workers=1, pin_training_thread=True)
    try:
        batches = sum(1 for _ in dl)
        assert batches > 3 and len(calls) == 1 + affinity.SWEEPS == 3
        assert all(c == affinity.Cores(CORES[0], frozenset(CORES[1:])) for c in calls)
    finally:
        dl.close()


def test_off_by_default_and_nothing_moves(store):
    before = os.sched_getaffinity(0)
    dl = make(store, num_workers=1)
    try:
        assert sum(len(y) for _, y in dl) > 0
        assert os.sched_getaffinity(0) == before
    finally:
        dl.close()


def test_one_cpu_or_a_non_flag_is_refused(store, monkeypatch):
    with pytest.raises(ValueError, match=r"pin_training_thread='yes' is invalid: pass True or"):
        make(store, pin_training_thread="yes")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match=r"needs at least 2 usable cores and this process has 1"):
        make(store, pin_training_thread=True)
    assert affinity.plan(False) is None


@two_cores
def test_the_gpu_paths_stage_thread_goes_to_the_other_cpus(tmp_path, monkeypatch, restored):
    # The stage thread starts from the iterating thread at the first batch (so on its
    # CPU): it is moved after that batch. Without CUDA, the stand-in decoder runs the path.
    from gpu_path_data import BACKEND, DEVICE, make_small_store, use_stand_ins

    use_stand_ins(monkeypatch)
    small = make_small_store(tmp_path)
    dl = loader.DataLoader(small, batch_size=4, transform="eval", image_size=16, device=DEVICE,
                           decoder=BACKEND, num_workers=1, pin_training_thread=True)  # fmt: skip
    try:
        it = iter(dl)
        next(it)
        stage = [t for t in threading.enumerate() if t.name == "imfeed-gpu-prefetch"]
        assert len(stage) == 1 and os.sched_getaffinity(stage[0].native_id) == set(CORES[1:])
        assert os.sched_getaffinity(0) == {CORES[0]}
        assert sum(len(y) for _, y in it) + 4 == len(dl.dataset)
        assert os.sched_getaffinity(0) == set(CORES)
    finally:
        dl.close()

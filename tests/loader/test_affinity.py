"""``pin_training_thread=True``: the iterating thread alone on the first core of the process's
CPU set, the workers and every other thread of the process on the others; the batches are
those of a loader without it."""

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


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("affinity"))


@pytest.fixture
def restored():
    """Every thread of this process back on all its cores afterwards (the tests' own)."""
    yield
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has ended
            os.sched_setaffinity(int(tid), CORES)


def make(store, **kwargs) -> loader.DataLoader:
    args = dict(batch_size=4, transform="eval", image_size=16, device="cpu", shuffle=True, seed=0)
    return loader.DataLoader(store, **{**args, **kwargs})


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
def test_the_iterating_thread_keeps_its_core_and_the_rest_go_to_the_others(store, restored):
    idle = threading.Event()
    other = threading.Thread(target=idle.wait)  # a thread of the process, started before
    other.start()
    dl = make(store, num_workers=2, persistent_workers=True, pin_training_thread=True)
    want = make(store, num_workers=2)
    try:
        got = [(x.clone(), y.clone()) for x, y in dl]
        own, rest = {CORES[0]}, set(CORES[1:])
        assert dl.pin_training_thread is True
        assert os.sched_getaffinity(0) == own
        assert os.sched_getaffinity(other.native_id) == rest
        assert [os.sched_getaffinity(pid) for pid in dl.worker_pids] == [rest, rest]
        expected = list(want)
        assert len(got) == len(expected)
        for (x, y), (wx, wy) in zip(got, expected, strict=True):
            assert torch.equal(x, wx) and torch.equal(y, wy)
    finally:
        idle.set()
        other.join()
        dl.close()


def test_off_by_default_and_nothing_moves(store, restored):
    before = os.sched_getaffinity(0)
    dl = make(store, num_workers=1)
    assert sum(len(y) for _, y in dl) > 0 and dl.pin_training_thread is False
    assert os.sched_getaffinity(0) == before


def test_one_core_or_a_non_flag_is_refused(store, monkeypatch):
    with pytest.raises(ValueError, match=r"pin_training_thread='yes' is invalid: pass True or"):
        make(store, pin_training_thread="yes")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})
    with pytest.raises(ValueError, match=r"needs at least 2 usable cores and this process has 1"):
        make(store, pin_training_thread=True)
    assert affinity.plan(False) is None


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
def test_the_gpu_paths_stage_thread_goes_to_the_other_cores(tmp_path, monkeypatch, restored):
    # The stage thread starts from the iterating thread at the first batch (so on its
    # core): it is moved after that batch. Without CUDA, the stand-in decoder runs the path.
    from gpu_path_data import BACKEND, DEVICE, make_small_store, use_stand_ins

    use_stand_ins(monkeypatch)
    small = make_small_store(tmp_path)
    dl = loader.DataLoader(small, batch_size=4, transform="eval", image_size=16, device=DEVICE,
                           decoder=BACKEND, num_workers=1, pin_training_thread=True)  # fmt: skip
    it = iter(dl)
    next(it)
    stage = [t for t in threading.enumerate() if t.name == "imfeed-gpu-prefetch"]
    assert len(stage) == 1 and os.sched_getaffinity(stage[0].native_id) == set(CORES[1:])
    assert os.sched_getaffinity(0) == {CORES[0]}
    assert sum(len(y) for _, y in it) + 4 == len(dl.dataset)
    dl.close()

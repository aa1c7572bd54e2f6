"""loader.profile: exact step and image counts, a wait share in [0, 1], and the verdict of
a loop that waits on its loader against one that waits on its step (no speed asserted: the
slow side sleeps far longer than the fast side takes)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.utils.data
from loader_data import make_store

import loader
import loader.decode as decode_registry
from ingest.cores import half_the_cores, usable_cores
from loader.telemetry.profiler import Stats, knob, verdict

SLEEP = 0.15  # far longer than anything else a step does here


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("profile"))


def batches(n: int, size: int = 4) -> list[tuple]:
    return [(torch.zeros(size, 3, 8, 8), torch.zeros(size, dtype=torch.long)) for _ in range(n)]


def slow(n: int):
    """A loader that sleeps before each batch: the loop waits on it."""
    for batch in batches(n):
        time.sleep(SLEEP)
        yield batch


def test_exported_from_the_package():
    assert loader.profile is loader.telemetry.profiler.profile
    assert isinstance(loader.profile([]), loader.Profile)


def test_slow_loader_is_input_bound():
    with loader.profile(slow(5)) as prof:
        for _images, _labels in prof:
            pass
    s = prof.stats
    assert (s.steps, s.images) == (5, 20)
    assert 0.5 < s.wait_share <= 1.0
    assert s.wait_seconds >= 5 * SLEEP
    assert prof.verdict().startswith("input-bound: the loop waited for data")
    assert "first knob to try: " in prof.verdict()


def test_fast_loader_is_compute_bound():
    with loader.profile(batches(5)) as prof:
        for _batch in prof:
            time.sleep(SLEEP)
    s = prof.stats
    assert (s.steps, s.images) == (5, 20)
    assert 0.0 <= s.wait_share < 0.05
    assert s.seconds >= 5 * SLEEP
    # The share measured, under 5%: "0%" or, on a busy machine, "1%" (CI once saw 1%).
    assert prof.verdict().startswith(
        f"compute-bound: the loop waited for data {s.wait_share:.0%} of the time; the loader "
        "keeps up"
    )


def test_warmup_steps_are_left_out():
    with loader.profile(batches(5), warmup=2) as prof:
        seen = sum(1 for _ in prof)
    assert seen == 5
    assert (prof.stats.steps, prof.stats.images) == (3, 12)


def test_a_loop_left_early_counts_what_it_ran():
    with loader.profile(batches(10)) as prof:
        for i, _ in enumerate(prof):
            if i == 3:
                break
    assert (prof.stats.steps, prof.stats.images) == (4, 16)


def test_report_says_what_was_measured():
    with loader.profile(slow(3)) as prof:
        for _ in prof:
            pass
    text = prof.report()
    lines = text.splitlines()
    assert lines[0].startswith("loader.profile: 3 steps, 12 images in ")
    assert "img/s (after 0 warm-up steps)" in lines[0]
    assert lines[1].startswith("waiting for data: ")
    assert "host time inside next()" in lines[1]
    assert lines[2].startswith("CPU cores busy: ")
    assert lines[3] == (
        "GPU utilisation: not measured (no CUDA batches, or pynvml / nvidia-ml-py not installed)"
    )
    assert lines[4].startswith("verdict: input-bound")


def test_warmup_is_checked():
    with pytest.raises(ValueError, match=r"warmup=-1 must be an int >= 0"):
        loader.profile([], warmup=-1)


def test_our_loader_counts_every_sample_once(store):
    dl = loader.DataLoader(store, batch_size=8, transform="eval", device="cpu", num_workers=2)
    with loader.profile(dl) as prof:
        for _images, _labels in prof:
            pass
    assert (prof.stats.steps, prof.stats.images) == (len(dl), 63)
    assert 0.0 <= prof.stats.wait_share <= 1.0
    assert prof.stats.cores_busy is not None and prof.stats.cores_busy > 0


def _stats(wait: float, busy: float) -> Stats:
    return Stats(steps=10, images=40, seconds=1.0, wait_seconds=wait, cores_busy=busy,
                 gpu_utilization=None)  # fmt: skip


def test_knob_more_workers_when_the_cpu_is_idle():
    dl = torch.utils.data.DataLoader(list(range(8)), num_workers=0)
    assert knob(_stats(0.5, 0.1), dl) == (
        f"more workers (num_workers=0 now, this process may use {usable_cores()} cores)"
    )
    assert verdict(_stats(0.1, 0.1), dl).startswith(
        "partly input-bound: the loop waited for data 10%"
    )


def test_the_cores_counted_are_those_this_process_may_run_on(monkeypatch):
    """Under ``taskset``, a cpuset or ``torchrun --numa-binding`` the process may use fewer
    cores than the machine has: the knob, the CPU conversion's threads and the DALI stage's
    threads (``half_the_cores``) count those (``os.cpu_count()`` counts the machine's)."""
    from loader.cpu.output import conversion_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6}, raising=False)
    assert usable_cores() == 3 and conversion_threads() == 1 and half_the_cores(8) == 1
    dl = torch.utils.data.DataLoader(list(range(8)), num_workers=1)
    assert knob(_stats(0.5, 0.1), dl) == (
        "more workers (num_workers=1 now, this process may use 3 cores)"
    )
    assert knob(_stats(0.5, 2.9), dl).startswith("loader.DataLoader over a store")


def test_knob_our_loader_when_torch_has_all_the_workers_it_can():
    dl = torch.utils.data.DataLoader(list(range(8)), num_workers=os.cpu_count())
    assert knob(_stats(0.5, os.cpu_count()), dl).startswith("loader.DataLoader over a store")


def test_knob_for_our_loader_on_the_cpu(store):
    dl = loader.DataLoader(store, batch_size=8, transform="eval", device="cpu",
                           num_workers=os.cpu_count())  # fmt: skip
    saturated = knob(_stats(0.5, os.cpu_count()), dl)
    assert saturated.startswith("smaller images: rebuild the store with `ingest build --max-size")
    idle = knob(_stats(0.5, 0.0), dl)
    assert "/dev/shm" in idle or 'cache="shm"' in idle


def test_knob_for_our_loader_on_the_gpu_path(store, monkeypatch):
    monkeypatch.setitem(
        decode_registry._BACKENDS, "tvcpu", "gpu_path_data:TorchvisionCpuBatchDecoder"
    )
    dl = loader.DataLoader(store, batch_size=8, transform="eval", device="cpu",
                           decoder="tvcpu", num_workers=1)  # fmt: skip
    busy = {"stage_wait_s": 0.2, "stage_busy_s": 3.0}  # the GPU stage holds batches up
    monkeypatch.setattr(dl, "stats", lambda: busy)
    assert knob(_stats(0.5, 0.0), dl).startswith(
        "smaller images: rebuild the store with `ingest build --max-size 512` (the GPU decoder"
    )
    waiting = {"stage_wait_s": 3.0, "stage_busy_s": 0.2}  # its thread waits for the workers
    monkeypatch.setattr(dl, "stats", lambda: waiting)
    assert knob(_stats(0.5, 0.0), dl).startswith("more workers (num_workers=1 now")


def test_epochs_add_up_and_the_time_between_them_is_left_out():
    dl = batches(3)
    with loader.profile(dl, warmup=1) as prof:
        for _epoch in range(2):
            for _batch in prof:
                pass
            time.sleep(4 * SLEEP)  # between epochs (validation, checkpoint): not counted
    s = prof.stats
    assert (s.steps, s.images) == (5, 20)  # 2 x 3 batches, the first one warm-up
    assert s.seconds < 4 * SLEEP  # counted, it would be twice that


def test_knob_for_our_gpu_path_whose_decoder_is_the_limit(store, monkeypatch):
    """On our GPU path, a decode thread busier than it waits is the limit: the knob is
    smaller images (it read the loader's own stats; a rewrite had broken that call)."""
    from gpu_path_data import CUDA, DEVICE, use_stand_ins

    use_stand_ins(monkeypatch)
    dl = loader.DataLoader(store, batch_size=8, transform="eval", device=DEVICE,
                           decoder="nvjpeg" if CUDA else "tvcpu", num_workers=0)  # fmt: skip
    monkeypatch.setattr(dl, "stats", lambda: {"stage_busy_s": 2.0, "stage_wait_s": 1.0})
    assert knob(_stats(0.5, 0.1), dl).startswith(
        "smaller images: rebuild the store with `ingest build --max-size 512` (the GPU decoder"
    )

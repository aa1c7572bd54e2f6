"""loader.DataLoader: batches, determinism, exactly-once, resume, drop-in, failures, errors."""

from __future__ import annotations

import faulthandler
import gc
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref

import numpy as np
import pytest
import torch
import torch.utils.data
import torchvision.transforms as T
from fixtures import REPO, ParentOnly, collector_off, held_over_epochs, held_resources
from loader_data import NUM_SAMPLES, corrupt, make_store

import loader
from ingest import format as fmt
from loader import ring as loader_ring
from loader.bench.synth import make_image_folder
from loader.cpu.batches import PixelBatches
from loader.store import Store

B = 8  # 63 samples: 7 full batches and one of 7


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("dataloader"))


def make(store, **kwargs) -> loader.DataLoader:
    # A fixed seed: loaders built apart must agree (unseeded, each draws its own).
    args = {"batch_size": B, "transform": "train", "device": "cpu", "with_indices": True, "seed": 0}
    return loader.DataLoader(store, **{**args, **kwargs})


def epoch(dl) -> list[tuple]:
    return [tuple(t.clone() for t in batch) for batch in dl]


def same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(
        all(torch.equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=True)
    )


def indices(batches: list[tuple]) -> np.ndarray:
    return torch.cat([b[2] for b in batches]).numpy()


# -- batches ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_types_and_normalisation(store, dtype, channels_last):
    raw = make(store, transform="eval", dtype=torch.uint8)
    dl = make(store, transform="eval", dtype=dtype, channels_last=channels_last)
    (pixels, _, _), (images, labels, idx) = next(iter(raw)), next(iter(dl))
    assert images.shape == (B, 3, 224, 224) and images.dtype == dtype
    fmt_ = torch.channels_last if channels_last else torch.contiguous_format
    assert images.is_contiguous(memory_format=fmt_)
    assert labels.dtype == torch.int64 and idx.dtype == torch.int64
    assert labels.tolist() == Store(store).labels[idx.numpy()].tolist()
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    expect = pixels if dtype == torch.uint8 else ((pixels / 255.0 - mean) / std).to(dtype)
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}.get(dtype, 0)
    assert torch.allclose(images.float(), expect.float(), atol=tol, rtol=0)


def test_image_size_mean_std_and_last_batch(store):
    dl = loader.DataLoader(
        store,
        batch_size=B,
        transform="eval",
        image_size=(96, 128),
        mean=(0, 0, 0),
        std=(1, 1, 1),
        device="cpu",
    )
    batches = list(dl)
    assert len(dl) == len(batches) == 8 and [len(b[0]) for b in batches] == [B] * 7 + [7]
    images = batches[0][0]
    assert images.shape == (B, 3, 96, 128) and images.min() >= 0 and images.max() <= 1
    dropped = loader.DataLoader(store, batch_size=B, transform="eval", drop_last=True, device="cpu")
    assert len(dropped) == len(list(dropped)) == 7


def test_pin_memory_is_a_silent_no_op_without_cuda(store):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    images, _, _ = next(iter(make(store, pin_memory=True)))
    assert not images.is_pinned()


# -- order, determinism, exactly-once, resume -------------------------------------------


@pytest.mark.parametrize("batch_size", [B, 40])  # 40: each batch is split over the workers
def test_same_seed_same_batches_whatever_the_workers(store, batch_size):
    inline = epoch(make(store, batch_size=batch_size, shuffle=True, seed=3))
    for workers in (2, 3):
        got = epoch(make(store, batch_size=batch_size, shuffle=True, seed=3, num_workers=workers))
        assert same(inline, got)
    if batch_size != B:
        return
    other = epoch(make(store, shuffle=True, seed=4))
    assert not np.array_equal(indices(other), indices(inline))
    # Same order, other augmentation draws: seeds differ per epoch and step, not only order.
    a, b = make(store, seed=3), make(store, seed=4)
    first_a, first_b = next(iter(a)), next(iter(b))
    assert torch.equal(first_a[2], first_b[2]) and not torch.equal(first_a[0], first_b[0])


def test_stopping_early_then_iterating_again_restarts_the_epoch(store):
    for persistent in (False, True):
        dl = make(store, shuffle=True, num_workers=2, persistent_workers=persistent)
        full = epoch(make(store, shuffle=True))
        it = iter(dl)
        next(it)
        del it  # abandoned: its workers are stopped (or drained, when persistent)
        assert same(epoch(dl), full)
        assert (dl.worker_pids != []) == persistent
        dl.close()
        assert dl.worker_pids == []


def test_persistent_workers_carry_on_into_the_next_epoch(store):
    # The last batches' refills place the next epoch's first ones: three epochs are those
    # of a loader whose workers stop at each epoch's end, batch for batch and pixel for pixel.
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True)
    want = make(store, shuffle=True, num_workers=2)
    for e in range(3):
        assert same(epoch(dl), epoch(want))
        placed = dl._carry._pending.keys() | dl._carry._ready.keys()
        assert placed and min(placed) == len(dl) * (e + 1)  # the next epoch's first batch on
    stats = dl.stats()
    assert (stats["epochs_carried"], stats.get("carries_dropped", 0)) == (2, 0)
    assert (stats["batches"], stats["samples"]) == (3 * len(dl), 3 * NUM_SAMPLES)
    pids = dl.worker_pids
    dl.close()
    assert dl.worker_pids == [] and pids and dl._carry is None


def test_worker_nice_lowers_the_workers_priority_and_changes_no_batch(store):
    # Each worker adds worker_nice to the niceness it inherits; the training process keeps
    # its own, and the batches are those of workers at its priority.
    own = os.getpriority(os.PRIO_PROCESS, 0)
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True, worker_nice=7)
    want = make(store, shuffle=True, num_workers=2)
    assert same(epoch(dl), epoch(want))
    niceness = [os.getpriority(os.PRIO_PROCESS, pid) for pid in dl.worker_pids]
    assert niceness == [min(own + 7, 19)] * 2
    assert os.getpriority(os.PRIO_PROCESS, 0) == own and dl.worker_nice == 7
    dl.close()


def test_zero_workers_take_what_torch_refuses_and_change_nothing(store):
    # torch refuses persistent_workers=True and prefetch_factor without workers; taken
    # here (a loop that sets them from a flag still runs), they change no batch.
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        torch.utils.data.DataLoader(range(4), persistent_workers=True)
    dl = make(store, shuffle=True, persistent_workers=True, prefetch_factor=3)
    want = make(store, shuffle=True)
    for _ in range(2):
        assert same(epoch(dl), epoch(want))
    assert dl._carry is None and dl.stats().get("epochs_carried", 0) == 0


def test_a_loop_bounded_by_len_carries_on(store):
    # Every batch taken, StopIteration never asked for: the next iter() ends the iteration
    # as StopIteration would and takes over the next epoch's batches (placed meanwhile),
    # whether the loop kept its iterator (`next(it)` len(loader) times) or dropped it
    # (zip, islice: the loader holds an iteration once its last batch is out).
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True)
    want = make(store, shuffle=True, num_workers=2)
    it = iter(dl)
    for e in range(2):
        got = [tuple(t.clone() for t in next(it)) for _ in range(len(dl))]
        assert same(got, epoch(want)) and dl.epoch == e + 1
        again = iter(dl)
        assert again is it and dl.stats()["epochs_carried"] == e + 1
    del it, again  # epoch 2 left unread: closed, and read again from its start
    for e in range(2, 5):
        if e < 4:
            bounded = (batch for _, batch in zip(range(len(dl)), dl, strict=False))
        else:
            bounded = itertools.islice(dl, len(dl))
        got = [tuple(t.clone() for t in batch) for batch in bounded]
        del bounded
        assert same(got, epoch(want))
        # Every batch delivered: the next iteration reads the next epoch, and a checkpoint
        # says so as it does at a `for` loop's last batch (the epoch, all of it consumed).
        assert dl.epoch == e + 1
        assert (dl.state_dict()["epoch"], dl.state_dict()["consumed"]) == (e, NUM_SAMPLES)
    assert dl.stats()["epochs_carried"] == 4  # 1, 2, then 3 and 4 after the zip and islice
    assert same(epoch(dl), epoch(want))  # epoch 5, carried on from 4
    assert (dl.stats()["epochs_carried"], dl.stats().get("carries_dropped", 0)) == (5, 0)
    dl.close()


@pytest.mark.parametrize("how", ["set_epoch", "load_state_dict", "another-seed"])
def test_batches_placed_for_an_epoch_the_loop_does_not_take_are_dropped(store, how):
    drawn = {"seed": None} if how == "another-seed" else {}  # a saved seed then replaces it
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True, **drawn)
    want = make(store, shuffle=True, num_workers=2, seed=7 if drawn else 0)
    epoch(dl)
    pids = dl.worker_pids
    if how == "set_epoch":
        dl.set_epoch(3)
        want.set_epoch(3)
    elif how == "load_state_dict":  # epoch 1, after its first 3 batches
        state = {**dl.state_dict(), "consumed": 3 * B, "step": 3}
        dl.load_state_dict(state)
        want.load_state_dict(state)
    else:  # epoch 1 from its start, as guessed, but in another seed's order
        dl.load_state_dict({**dl.state_dict(), "seed": 7})
        want.set_epoch(1)
    assert same(epoch(dl), epoch(want))
    assert (dl.stats().get("epochs_carried", 0), dl.stats()["carries_dropped"]) == (0, 1)
    assert dl.worker_pids == pids  # drained, not stopped
    assert same(epoch(dl), epoch(want))  # and the next epoch follows on again
    assert dl.stats()["epochs_carried"] == 1
    dl.close()


def test_a_worker_that_dies_between_epochs_is_reported_and_replaced(store):
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True)
    want = make(store, shuffle=True, num_workers=2)
    assert same(epoch(dl), epoch(want))
    os.kill(dl.worker_pids[0], signal.SIGKILL)  # while the next epoch's batches are out
    with pytest.raises(RuntimeError, match=r"worker \d \(pid \d+\) died: killed by signal"):
        epoch(dl)
    assert dl.worker_pids == []  # stopped, not left half alive
    assert same(epoch(dl), epoch(want))  # the failed epoch again, whole, by new workers
    dl.close()


def test_resume_inside_an_epoch_that_was_carried_on(store):
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=True)
    epoch(dl)
    it = iter(dl)
    head = [tuple(t.clone() for t in next(it)) for _ in range(2)]
    state = dl.state_dict()
    assert (state["epoch"], state["consumed"], dl.stats()["epochs_carried"]) == (1, 2 * B, 1)
    resumed = make(store, shuffle=True)
    resumed.load_state_dict(state)
    whole = make(store, shuffle=True)
    whole.set_epoch(1)
    want = epoch(whole)
    assert same(head + epoch(resumed), want)
    del it  # left early: the epoch starts again from its start
    assert same(epoch(dl), want)
    dl.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("persistent", [True, False])
@pytest.mark.parametrize("abandon", [False, True], ids=["whole", "abandoned"])
def test_nothing_is_held_longer_epoch_after_epoch(store, persistent, abandon):
    """A descriptor, thread or process kept per epoch ends a long run (EMFILE at 1024
    descriptors): 20 epochs, whole or left after 2 batches as a bounded loop leaves
    them, hold exactly what the second held; a loader closed and dropped gives back all
    of it (closed, it keeps its ring's shared memory and its index for the next epoch)."""
    before = held_resources()
    dl = make(store, num_workers=2, persistent_workers=persistent)
    held = held_over_epochs(dl, 20, abandon)
    assert held[-1] == held[1], held
    dl.close()
    assert held_resources()[1:] == before[1:]  # no thread, no worker
    del dl
    gc.collect()
    assert held_resources() == before


def test_a_state_that_does_not_fit_changes_nothing(store):
    # Another store's checkpoint, with its own seed: refused before anything moves (the
    # drawn seed once yielded to it first, and the epoch under way started again).
    dl = make(store, shuffle=True, num_workers=2, seed=None)
    want = make(store, shuffle=True, seed=dl.seed)
    it = iter(dl)
    head = [tuple(t.clone() for t in next(it)) for _ in range(3)]
    before = dl.state_dict()
    with pytest.raises(
        ValueError,
        match="saved with a store of 1000 samples, and this loader reads with a store of 63",
    ):
        dl.load_state_dict({**before, "seed": 123, "num_samples": 1000})
    assert dl.state_dict() == before
    rest = [tuple(t.clone() for t in batch) for batch in it]  # the iteration goes on
    assert same(head + rest, epoch(want))
    dl.close()


def test_a_state_of_another_store_of_the_same_size_is_refused(store):
    """States record the store's build identity: another store of as many samples let a
    resume through, on other images and labels."""
    dl = make(store, shuffle=True, seed=5)
    state, build = dl.state_dict(), fmt.read_manifest(store)["build"]
    assert state["store"] == build
    assert json.loads(json.dumps(state)) == state  # still plain JSON
    with pytest.raises(ValueError, match=rf"^the state was saved reading another store \(build "
                       rf"{'0' * 32}\) than this loader's {store} \(build {build}\); load it "
                       r"into a loader of that store, or start afresh \(a store built again from "
                       r"files with other modification times is another build: drop the "
                       r"state's 'store' to resume\)$"):  # fmt: skip
        dl.load_state_dict({**state, "store": "0" * 32})
    dl.load_state_dict({k: v for k, v in state.items() if k != "store"})  # saved before it
    drawn = make(store, shuffle=True, seed=None)  # a drawn seed yields to a saved one
    with pytest.raises(ValueError, match=r"^state=NoneType is not a state dict; pass the output"):
        drawn.load_state_dict(None)  # it was a TypeError
    with pytest.raises(ValueError, match=r"^state\['seed'\]='x' is invalid: it must be an "
                       r"integer >= 0; the state dict is corrupt$"):  # fmt: skip
        drawn.load_state_dict({**state, "seed": "x"})  # it said "pass a non-negative seed"
    assert drawn.state_dict()["seed"] == drawn.seed != state["seed"]  # nothing changed
    for flag in (np.True_, 1, 0):  # what torch takes, the loader too
        assert make(store, drop_last=flag).drop_last is bool(flag)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_checkpoint_at_an_epochs_last_batch_resumes_with_the_next(store, persistent):
    # Saved inside the loop at the last batch: (epoch 0, all consumed), with or without
    # persistent workers. Resumed as a script resumes, set_epoch(saved epoch) first, then
    # the next: the rest of epoch 0 (nothing), then epoch 1 whole; or with plain loops
    # (the loader's own epochs), the same. Epoch 1 was once read as nothing where an
    # iterator's first task came after the plan had moved on to it.
    dl = make(store, shuffle=True, num_workers=2, persistent_workers=persistent)
    for _batch in dl:
        state = dl.state_dict()
    dl.close()
    assert (state["epoch"], state["consumed"], state["step"]) == (0, NUM_SAMPLES, len(dl))
    want = make(store, shuffle=True)
    epoch(want)
    want_1 = epoch(want)
    for follow_epochs in (True, False):
        resumed = make(store, shuffle=True, num_workers=2, persistent_workers=persistent)
        resumed.load_state_dict(state)
        got = []
        for e in range(2):
            if follow_epochs:
                resumed.set_epoch(e)
            got.append(epoch(resumed))
        assert got[0] == [] and same(got[1], want_1) and resumed.epoch == 2
        resumed.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_bounded_loop_holds_nothing_more_epoch_after_epoch(store):
    """zip-bounded epochs with persistent workers: the loader holds each one once its last
    batch is out (to carry on from it), and nothing more accumulates; a loader dropped
    while it holds one gives everything back."""
    before = held_resources()
    dl = make(store, num_workers=2, persistent_workers=True)
    held = []
    for _ in range(12):
        for _step, _batch in zip(range(len(dl)), dl, strict=False):
            pass
        held.append(held_resources())
    assert dl._read is not None and held[-1] == held[1], held
    assert dl.stats()["epochs_carried"] == 11
    del dl, _batch
    gc.collect()
    assert held_resources() == before


def test_a_loop_bounded_by_len_moves_on_to_the_next_epoch(store):
    """zip(range(len(dl)), dl) reads every batch but never sees StopIteration."""
    dl = make(store, shuffle=True)
    steps = range(len(dl))
    bounded = [indices([b for _, b in zip(steps, dl, strict=False)]) for _ in range(2)]
    assert dl.epoch == 2 and not np.array_equal(bounded[0], bounded[1])
    reference = make(store, shuffle=True)
    assert all(np.array_equal(indices(epoch(reference)), got) for got in bounded)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_failed_delivery_ends_the_iteration_not_the_epoch(store, num_workers):
    dl = make(store, num_workers=num_workers)
    it = iter(dl)
    head = [next(it)[2] for _ in range(2)]
    convert = dl._output.images
    dl._output.images = lambda pixels: (_ for _ in ()).throw(KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    dl._output.images = convert
    assert list(it) == [] and dl.worker_pids == []
    state = dl.state_dict()
    assert state["epoch"] == 0 and state["consumed"] == 2 * B  # the rest was never delivered
    resumed = make(store)
    resumed.load_state_dict(state)
    rest = indices(epoch(resumed)).tolist()
    assert torch.cat(head).tolist() + rest == list(range(NUM_SAMPLES))


def test_store_open_elsewhere_in_the_process(store):
    """LMDB refuses a second open of a shard in one process, also in a forked worker."""
    ds = loader.LMDBDataset(store)
    ds[0]  # the shards are now open in this process
    for workers in (0, 2):
        assert len(epoch(make(store, num_workers=workers))) == 8
    assert ds[1][1] == 0


def test_spawn_workers(store):
    inline = epoch(make(store, seed=2))[:2]
    dl = make(store, seed=2, num_workers=1, multiprocessing_context="spawn")
    it = iter(dl)
    assert same([tuple(t.clone() for t in next(it)) for _ in range(2)], inline)
    dl.close()


# -- drop-in for other datasets ----------------------------------------------------------


def test_any_other_dataset_gets_torchs_dataloader(store):
    ds = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    dl = loader.DataLoader(ds, 4, False, drop_last=True)
    assert type(dl) is torch.utils.data.DataLoader
    ref = torch.utils.data.DataLoader(ds, 4, False, drop_last=True)
    assert [b[1].tolist() for b in dl] == [b[1].tolist() for b in ref]
    # Nearest: not a recipe the loader runs itself (tests/loader/test_recipes.py), so torch's.
    nearest = T.InterpolationMode.NEAREST
    tf = T.Compose([T.Resize(64, interpolation=nearest), T.CenterCrop(64), T.ToTensor()])
    lmdb_ds = loader.LMDBDataset(store, transform=tf)
    dl = loader.DataLoader(lmdb_ds, batch_size=4, num_workers=1)
    assert type(dl) is torch.utils.data.DataLoader
    images, labels = next(iter(dl))
    assert images.shape == (4, 3, 64, 64) and labels.tolist() == [0, 0, 0, 0]


def test_store_options_are_ignored_with_one_warning_for_other_datasets():
    ds = torch.utils.data.TensorDataset(torch.arange(4.0))
    with pytest.warns(UserWarning) as caught:
        dl = loader.DataLoader(
            ds, batch_size=2, transform="train", device="cpu", seed=3, max_pixels=10**9
        )
    assert len(caught) == 1
    assert str(caught[0].message) == (
        "loader.DataLoader: transform=, device=, seed=, max_pixels= ignored: torch's "
        "DataLoader reads this "
        "dataset (a TensorDataset is not a store) and they apply only to the fast path"
    )
    assert caught[0].filename == __file__  # points at the caller's line
    assert type(dl) is torch.utils.data.DataLoader
    assert [b[0].tolist() for b in dl] == [[0.0, 1.0], [2.0, 3.0]]


def test_lmdb_dataset_without_transform_takes_the_fast_path(store):
    dl = loader.DataLoader(loader.LMDBDataset(store), batch_size=B, transform="eval", device="cpu")
    assert isinstance(dl, loader.DataLoader)
    assert next(iter(dl))[0].shape == (B, 3, 224, 224)


# -- failures -----------------------------------------------------------------------------


def _no_fault_handler(worker_id: int) -> None:
    faulthandler.disable()


@pytest.mark.parametrize(
    "sig, hint",
    [
        (signal.SIGKILL, r"often the kernel's out-of-memory killer"),
        (
            signal.SIGBUS,
            r"often shared memory running out: see `df /dev/shm`.*or a store "
            r"file damaged in place: check the store with `ingest verify`\)",
        ),
    ],
)
def test_killed_worker_raises_naming_it(store, sig, hint):
    # pytest's fault handler, inherited, would print the killed worker's stack
    dl = make(store, batch_size=2, num_workers=2, worker_init_fn=_no_fault_handler)
    it = iter(dl)
    next(it)
    victim = dl.worker_pids[0]
    os.kill(victim, sig)
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=rf"worker 0 \(pid {victim}\) died: killed by signal {sig.name} \({hint}",
    ):
        for _ in it:
            pass
    assert time.monotonic() - start < 10
    assert dl.worker_pids == []  # the others were stopped
    assert len(epoch(dl)) == 32  # and a new iteration starts afresh


def test_a_batch_is_delivered_when_its_refill_finds_a_dead_worker(store):
    dl = make(store, num_workers=2)
    it = iter(dl)
    got = [next(it)[2]]
    convert = dl._output.images

    def kill_workers_then_convert(pixels):  # they die while the batch is being copied out
        for pid in dl.worker_pids:
            os.kill(pid, signal.SIGKILL)
        ended(dl.worker_pids)
        return convert(pixels)

    dl._output.images = kill_workers_then_convert
    got.append(next(it)[2])
    dl._output.images = convert
    with pytest.raises(RuntimeError, match=r"worker \d \(pid \d+\) died: killed by signal SIGKILL"):
        next(it)
    assert dl.state_dict()["consumed"] == len(torch.cat(got)) == 2 * B  # nothing lost


def alive(pid: int) -> bool:
    """The process runs (a zombie has closed its pipes; a reaped one is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def ended(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process of ``pids`` ends within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_persistent_workers_stop_at_once_when_a_batch_fails(store, monkeypatch):
    fill = PixelBatches.fill_rows

    def fail_on_sample_20(self, slot, lo, indices, *args):
        if 20 in indices.tolist():
            raise OSError("disk gone")
        return fill(self, slot, lo, indices, *args)

    monkeypatch.setattr(PixelBatches, "fill_rows", fail_on_sample_20)  # inherited by the fork
    dl = make(store, num_workers=2, persistent_workers=True)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker \d failed on batch 2:(.|\n)*disk gone"):
        epoch(dl)
    assert time.monotonic() - start < 10  # not a wait for the batch that will never come
    assert dl.worker_pids == []


def test_interpreter_exits_promptly_with_a_live_persistent_iteration(store):
    script = (
        "import loader, sys\n"
        "dl = loader.DataLoader(sys.argv[1], batch_size=8, transform='eval', device='cpu',"
        " num_workers=2, persistent_workers=True)\n"
        "it = iter(dl)\n"
        "next(it)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", script, str(store)], env=env, check=True, timeout=60)
    assert time.monotonic() - start < 20  # was 30 s more: draining workers already stopped


def test_worker_exception_is_raised_in_the_loop(store):
    def broken_init(worker_id):
        raise OSError(f"no GPU for worker {worker_id}")

    with pytest.raises(RuntimeError, match=r"worker \d failed while starting:(.|\n)*no GPU"):
        next(iter(make(store, num_workers=2, worker_init_fn=broken_init)))


def test_a_worker_never_frees_what_it_inherits(store):
    """As a CUDA tensor held by the training process would abort a forked worker that
    garbage-collects it (seen on the H200): every sample still arrives."""
    with collector_off():  # the cycle stays uncollected until the workers are forked
        ParentOnly()
        dl = make(store, num_workers=2, worker_init_fn=lambda _: gc.collect())
        seen = sorted(i for _, _, indices in dl for i in indices.tolist())
    assert seen == list(range(NUM_SAMPLES))


def test_closing_after_a_failure_found_while_refilling_does_not_wait(store, monkeypatch):
    fill = PixelBatches.fill_rows

    def failing(self, slot, lo, indices, *args):
        if 8 in indices.tolist():
            time.sleep(0.3)  # batch 1: slow, so batch 2's error arrives after it
        if 16 in indices.tolist():
            raise OSError("disk gone")  # batch 2
        return fill(self, slot, lo, indices, *args)

    monkeypatch.setattr(PixelBatches, "fill_rows", failing)
    dl = make(store, num_workers=1, prefetch_factor=4, persistent_workers=True)
    it = iter(dl)
    next(it)
    time.sleep(1.0)  # the worker has sent batch 1, then batch 2's error
    next(it)  # batch 1; the refill after it reads the error
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 5  # was 30 s: a drain waiting for batch 2
    monkeypatch.setattr(PixelBatches, "fill_rows", fill)
    assert sorted(i for *_, ix in dl for i in ix.tolist()) == list(range(NUM_SAMPLES))
    dl.close()


def test_too_little_shared_memory_is_said_before_anything_breaks(store, monkeypatch):
    """A full /dev/shm kills whoever touches the missing pages (SIGBUS), maybe hours in."""
    monkeypatch.setattr(loader_ring, "shm_free", lambda: 4 << 20)
    with pytest.raises(
        RuntimeError,
        match=r"batch ring needs [\d,]+ MiB of shared memory and "
        r"/dev/shm has 4 MiB free: give it more \(in Docker, `--shm-size`\)",
    ):
        make(store, num_workers=2, batch_size=64)
    assert len(epoch(make(store, num_workers=0, batch_size=64))) == 1  # no ring to share
    dl = make(store, num_workers=2, batch_size=2)  # a ring that fits
    need = loader_ring.ring_bytes(dl._producer.buffers(), dl._ring.slots)
    assert need == sum(t.nbytes for t in dl._ring.tensors.values()) <= 4 << 20


def test_timeout(store):
    def slow_init(worker_id):
        time.sleep(30)

    dl = make(store, num_workers=1, worker_init_fn=slow_init, timeout=0.5)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 seconds"):
        next(iter(dl))
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_corrupt_record_is_replaced_counted_and_logged_once(store, tmp_path, caplog, num_workers):
    path, damaged = corrupt(store, tmp_path, 17)
    dl = make(damaged, num_workers=num_workers)
    reference = epoch(make(damaged))  # another loader: it logs on its own
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="loader"):
        batches = epoch(dl)
        again = epoch(dl)
    assert len(batches) == len(again) == 8
    assert same(batches, reference)  # the replacement is reproducible
    got = indices(batches)
    assert len(got) == NUM_SAMPLES and 17 not in got  # sample 17 was replaced
    assert list(dl.bad_samples) == [17] and dl.bad_samples[17].startswith(path)
    assert dl.num_replaced == 2  # once per epoch
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "sample 17" in warnings[0] and path in warnings[0]
    assert "(CRC-32 mismatch); check the store with `ingest verify" in warnings[0]
    assert warnings[0].count("ingest verify") == 1  # the reason's advice, not twice


# -- errors users make --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 0}, r"batch_size=0 is invalid: it must be an integer >= 1"),
        ({"num_workers": -1}, r"num_workers=-1 is invalid.*use num_workers=0"),
        ({"transform": "training"}, r"transform='training' is not a built-in transform; use one"),
        ({"transform": None}, r"transform= is required when reading a store"),
        ({"dtype": torch.int32}, r"dtype=torch.int32 is not supported; use one of float32"),
        ({"device": "mps"}, r"device='mps' is not supported; use 'cpu' or a CUDA device"),
        ({"decoder": "pil"}, r"decoder='pil' is unknown; known decoders: auto, cpu, dali, nvjpeg"),
        ({"sampler": [0, 1]}, r"sampler=list cannot be used when reading a store: .* follows only"),
        ({"prefetch_factor": 0}, r"prefetch_factor=0 is invalid"),
        ({"drop_last": "no"}, r"drop_last='no' is invalid: pass True or False"),  # was True
        ({"channels_last": "no"}, r"channels_last='no' is invalid: pass True or False"),
        ({"with_indices": "yes"}, r"with_indices='yes' is invalid: pass True or False"),
        ({"worker_nice": -1}, r"worker_nice=-1 is invalid: it must be an integer >= 0; 0 runs"),
        ({"worker_nice": 20}, r"worker_nice=20 is invalid: it must be at most 19; 0 runs"),
        ({"worker_nice": True}, r"worker_nice=True is invalid: it must be an integer >= 0"),
    ],
)
def test_argument_errors(store, kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(store, **kwargs)


def test_cuda_device_without_cuda(store):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"device='cuda' asks for CUDA, but .* pass device='cpu'"):
        make(store, device="cuda")


def test_not_a_store(tmp_path, store):
    with pytest.raises(ValueError, match=r"no such store directory; build one with `ingest build"):
        make(tmp_path / "missing")
    partial = tmp_path / "partial"
    shutil.copytree(store, partial)
    (partial / fmt.MANIFEST).unlink()
    with pytest.raises(ValueError, match=r"not a complete store, manifest.json is missing$"):
        make(partial)
    # The likeliest slip when swapping in a store: the image folder it was made from.
    folder = tmp_path / "train"
    make_image_folder(folder, 2, 1, short_side=(48, 56))
    with pytest.raises(ValueError) as raised:
        make(folder)
    assert str(raised.value) == (
        f"{folder}: not a complete store, manifest.json is missing (it is an image folder: "
        f"convert it once with `ingest build {folder} {tmp_path / 'train.lmdb'}` and give that "
        "store instead)"
    )
    (tmp_path / "notes.txt").write_text("a file")
    with pytest.raises(ValueError, match=r"notes.txt: not a directory, where a store is the"):
        make(tmp_path / "notes.txt")


def test_stats_of_the_cpu_path(store):
    dl = make(store, num_workers=2)
    epoch(dl)
    stats = dl.stats()
    assert stats["decoder"] == "cpu"
    assert stats["samples"] == stats["cpu_decoded"] == NUM_SAMPLES and stats["batches"] == 8
    assert stats["cpu_decode_s"] > 0 and stats["wait_s"] >= 0  # worker time was counted


def test_a_loader_let_go_after_an_epoch_read_to_its_end_is_freed_at_once(store):
    """With persistent workers the loader keeps the iterator of an epoch read to its end
    (its workers go on with the next epoch's first batches): the two held each other, so
    the loader, its workers and their shared memory outlived the training code's last
    reference to them, until a full collection. Freed at once now; the workers end."""
    with collector_off():
        dl = make(store, num_workers=2, persistent_workers=True)
        it = iter(dl)
        assert sorted(indices(list(it)).tolist()) == list(range(NUM_SAMPLES))
        assert dl._carry is it  # parked, on into the next epoch
        pids = dl.worker_pids
        refs = [weakref.ref(dl), weakref.ref(it)]
        del dl, it
        assert [r() for r in refs] == [None, None]
        assert len(pids) == 2 and ended(pids)


def test_an_iterator_kept_after_its_loader_was_let_go_ends_quietly(store):
    dl = make(store, num_workers=2, persistent_workers=True)
    it = iter(dl)
    assert len(list(it)) == len(dl)  # parked: the loader alone held it
    del dl
    it.close()  # nothing to do, and no error
    with pytest.raises(StopIteration):
        next(it)


def test_an_iterator_read_whole_by_a_bounded_loop_closes_after_its_loader_went(store):
    """Only the iterator kept, read to its last batch by a loop bounded by its length: it
    let go of the loader (then freed), and closing it is no error."""
    with collector_off():
        it = iter(make(store, num_workers=2, persistent_workers=True))
        got = [i for _, _, idx in itertools.islice(it, len(it)) for i in idx.tolist()]
        assert sorted(got) == list(range(NUM_SAMPLES)) and it._loader_ref() is None
        it.close()
        with pytest.raises(StopIteration):
            next(it)


def test_a_loader_let_go_after_a_loop_bounded_by_its_length_is_freed_at_once(store):
    """A loop bounded by ``len(loader)`` (``zip``) reads every batch and never asks past
    the last: the loader keeps the iterator until the next iteration ends it; the two no
    longer hold each other."""
    with collector_off():
        dl = make(store, num_workers=2, persistent_workers=True)
        seen = [i for _, (_, _, idx) in zip(range(len(dl)), dl, strict=False) for i in idx.tolist()]
        assert sorted(seen) == list(range(NUM_SAMPLES)) and dl._read is not None
        pids = dl.worker_pids
        ref = weakref.ref(dl)
        del dl
        assert ref() is None
        assert len(pids) == 2 and ended(pids)


def test_a_loop_over_a_loader_only_it_holds_reads_every_sample_once(store):
    """``for batch in DataLoader(...)``: the loop holds only the iterator, which lets go of
    the loader with the last batch; the loop's next ask ends it."""
    with collector_off():
        for _ in range(2):
            got = [i for _, _, idx in make(store, num_workers=2, persistent_workers=True)
                   for i in idx.tolist()]  # fmt: skip
            assert sorted(got) == list(range(NUM_SAMPLES))

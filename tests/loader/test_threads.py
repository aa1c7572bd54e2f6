"""One DataLoader used from two threads at once (issue 40): as torch's, one thread at a time.

The thread whose iteration is under way keeps it, whole and in order; another thread's
``iter()``, ``set_epoch()`` or ``load_state_dict()`` is refused in one line; ``next()`` on
one iterator from two threads hands each batch to one of them; ``close()`` from another
thread stops the iteration with a message that says so.
"""

from __future__ import annotations

import re
import sys
import threading
import time

import pytest
from loader_data import NUM_SAMPLES, make_store

import loader

B = 8
JOIN_S = 60.0  # no test may hang: every join is bounded, and then checked
REFUSED = (
    r"^{call} in thread '{here}': this DataLoader is being iterated in thread '{owner}'; use "
    r"it from one thread at a time \(as torch's DataLoader\): end that iteration first \(read "
    r"it to its end, or close\(\)\), or make one DataLoader per thread$"
)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("threads"))


def make(store, **kwargs) -> loader.DataLoader:
    args = {"batch_size": B, "transform": "train", "device": "cpu", "with_indices": True}
    return loader.DataLoader(store, **{**args, "seed": 0, "shuffle": True, **kwargs})


def refused(call: str, here: str, owner: str) -> str:
    return REFUSED.format(call=re.escape(call), here=here, owner=owner)


def once_each(batches: list[list[int]]) -> bool:
    """Whether ``batches`` (of sample indices) hold every sample exactly once."""
    return sorted(i for batch in batches for i in batch) == list(range(NUM_SAMPLES))


def start(name: str, target) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def join(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a thread hung"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_threads_iterating_one_loader_one_is_refused(store, num_workers):
    # Both start a `for` loop at once; the first to reach iter() owns the epoch, and holds
    # it until the other's attempt is over: the other's iter() raises, the owner's epoch
    # is whole (the order of a loader read alone).
    dl = make(store, num_workers=num_workers)
    want = [b[2].tolist() for b in make(store, num_workers=num_workers)]
    go, tried = threading.Barrier(2), threading.Barrier(2, timeout=JOIN_S)
    got: dict[str, list] = {}
    errors: dict[str, str] = {}

    def loop() -> None:
        name = threading.current_thread().name
        go.wait(JOIN_S)
        try:
            it = iter(dl)
        except RuntimeError as e:
            errors[name] = str(e)
            tried.wait()
            return
        tried.wait()  # the other has tried meanwhile
        got[name] = [batch[2].tolist() for batch in it]

    join(start("A", loop), start("B", loop))
    assert len(got) == 1 and len(errors) == 1, (got.keys(), errors)
    (owner, batches), (other, error) = next(iter(got.items())), next(iter(errors.items()))
    assert batches == want and once_each(batches)
    assert re.match(refused("iter()", other, owner), error), error
    assert dl.epoch == 1  # the owner's epoch, read to its end
    dl.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_another_thread_may_not_move_an_iteration_under_way(store, num_workers):
    # set_epoch() and load_state_dict() end the iteration under way: from another thread,
    # refused, and the owner's epoch goes on untouched.
    dl = make(store, num_workers=num_workers)
    want = [b[2].tolist() for b in make(store, num_workers=num_workers)]
    it = iter(dl)
    got = [next(it)[2].tolist()]
    state = dl.state_dict()
    errors: list[str] = []

    def meddle() -> None:
        for call, args in ((dl.set_epoch, (3,)), (dl.load_state_dict, (state,)), (iter, (dl,))):
            try:
                call(*args)
            except RuntimeError as e:
                errors.append(str(e))

    join(start("meddler", meddle))
    got += [batch[2].tolist() for batch in it]
    assert got == want and once_each(got)
    here = threading.current_thread().name
    calls = ("set_epoch()", "load_state_dict()", "iter()")
    assert len(errors) == 3
    for call, error in zip(calls, errors, strict=True):
        assert re.match(refused(call, "meddler", here), error), error
    dl.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_next_on_one_iterator_from_two_threads_hands_each_batch_once(store, num_workers):
    # Both threads take batches from the same iterator as fast as they can: each batch goes
    # to exactly one of them, whole, and together they get the epoch, each sample once.
    dl = make(store, num_workers=num_workers)
    it = iter(dl)
    go = threading.Barrier(2)
    got: dict[str, list] = {"A": [], "B": []}
    errors: list[BaseException] = []

    def take() -> None:
        mine = got[threading.current_thread().name]
        go.wait(JOIN_S)
        try:
            for images, labels, idx in it:
                assert images.shape[0] == labels.shape[0] == idx.shape[0]
                mine.append(idx.tolist())
        except BaseException as e:
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        join(start("A", take), start("B", take))
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    batches = got["A"] + got["B"]
    assert len(batches) == len(dl) and once_each(batches)
    assert dl.epoch == 1
    dl.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_thread_that_ended_gives_its_iteration_up(store, num_workers):
    # An iteration left unfinished by a thread that has ended is no thread's: another thread
    # iterates as the first would have again (a stopped epoch restarts), and the next.
    dl = make(store, num_workers=num_workers)
    want = [b[2].tolist() for b in make(store, num_workers=num_workers)]
    kept: list = []  # the first thread's iterator outlives it, one batch taken

    def first() -> None:
        it = iter(dl)
        next(it)
        kept.append(it)

    join(start("first", first))
    got: list = []
    join(start("second", lambda: got.extend(b[2].tolist() for b in dl)))
    assert got == want and dl.epoch == 1
    got.clear()
    join(start("third", lambda: got.extend(b[2].tolist() for b in dl)))
    assert len(got) == len(dl) and once_each(got) and dl.epoch == 2
    with pytest.raises(RuntimeError, match=r"^this iterator was ended by a new iteration; "):
        next(kept[0])
    dl.close()


def slow_start(worker_id: int) -> None:
    time.sleep(3.0)


def test_close_from_another_thread_stops_the_iteration_saying_so(store):
    # The owner waits for its first batch (the workers still starting) when another thread
    # closes the loader: the owner's next() says the workers were stopped (not that one
    # died), and the loader then reads a whole epoch again.
    dl = make(store, num_workers=2, worker_init_fn=slow_start)
    waiting = threading.Event()
    errors: list[str] = []

    def owner() -> None:
        it = iter(dl)
        waiting.set()
        try:
            next(it)
        except RuntimeError as e:
            errors.append(str(e))

    thread = start("owner", owner)
    assert waiting.wait(JOIN_S)
    time.sleep(0.5)  # inside next(), waiting for the workers
    t0 = time.monotonic()
    dl.close()
    join(thread)
    assert time.monotonic() - t0 < 2.5  # stopped at once, not drained nor waited for
    assert errors == [
        "the DataLoader's workers were stopped (close(), or the interpreter is exiting); "
        "start a new iteration"
    ]
    assert dl.worker_pids == []
    dl.worker_init_fn = None
    assert once_each([b[2].tolist() for b in dl])
    dl.close()

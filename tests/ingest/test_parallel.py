"""ForkPool: results with their keys, task failures surfaced, workers never left behind."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from fixtures import REPO, ParentOnly

from ingest.parallel import (
    ForkPool,
    InlinePool,
    WorkerDied,
    WorkerError,
    inherited_objects_frozen,
    ordered,
)


def _payload(i: int) -> tuple[list, bytes]:
    # Up to 200 KB: larger than a pipe's buffer, so a result spans many reads.
    return [i, f"item-{i}"], bytes([i % 251]) * (i * 2000)


def _fails(i: int) -> None:
    raise ValueError(f"boom {i}")


class _Unpicklable(Exception):
    def __init__(self, a: int, b: int) -> None:  # pickle rebuilds it with one argument
        super().__init__(f"{a} and {b}")


def _fails_oddly(i: int) -> None:
    raise _Unpicklable(i, i + 1)


def _dies(i: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _children() -> set[int]:
    """Live (not zombie) child processes of this one, from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[1]) == os.getpid():
            found.add(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def no_workers_left():
    """Fails the test if it leaves a child process behind."""
    before = _children()
    yield
    assert _children() == before


def _run_all(pool, fn, items: list) -> dict:
    todo, done = list(items), {}
    while todo or pool.busy:
        while pool.idle and todo:
            i = todo.pop()
            pool.submit(i, fn, i)
        done.update(pool.wait())
    return done


@pytest.mark.parametrize("workers", [1, 2, 5])
def test_every_result_comes_back_with_its_key(workers: int, no_workers_left):
    with ForkPool(workers) as pool:
        assert (pool.idle, pool.busy) == (workers, 0)
        got = _run_all(pool, _payload, list(range(101)))
    assert got == {i: _payload(i) for i in range(101)}


@pytest.mark.parametrize("workers", [1, 3])
def test_ordered_gives_the_results_in_order(workers: int, no_workers_left):
    with ForkPool(workers) if workers > 1 else InlinePool() as pool:
        got = list(ordered(pool, _payload, [(i,) for i in range(40)]))
        assert pool.busy == 0
    assert got == [_payload(i) for i in range(40)]


def test_the_inline_pool_runs_tasks_in_this_process(no_workers_left):
    with InlinePool() as pool:
        assert _run_all(pool, _payload, list(range(20))) == {i: _payload(i) for i in range(20)}


@pytest.mark.parametrize(
    ("task", "error", "message"),
    [
        (_fails, ValueError, r"^boom 37$"),  # raised as it is
        # an exception that cannot travel back comes with the worker's traceback
        (_fails_oddly, WorkerError,
         r"^ingest worker 1 \(pid \d+\) failed:\n(.|\n)*_Unpicklable: 37 and 38\n$"),
        # a killed worker is reported, not waited for
        (_dies, WorkerDied, r"^ingest worker 1 \(pid \d+\) died: killed by signal SIGKILL$"),
    ],
)  # fmt: skip
def test_a_failed_task_is_raised_by_wait(task, error, message, no_workers_left):
    with ForkPool(2) as pool:
        pool.submit("a", task, 37)
        with pytest.raises(error, match=message):
            pool.wait()


def test_a_worker_killed_while_idle_is_reported_at_the_next_task(no_workers_left):
    """Sending a task to a worker the out-of-memory killer took while it was idle raised a
    BrokenPipeError, which the command then took for its reader gone (exit 141, silent)."""
    with ForkPool(1) as pool:
        pid = pool._workers[0][0]
        os.kill(pid, signal.SIGKILL)
        while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
            time.sleep(0.01)  # dead, not yet reaped: its end of the pipe is closed
        with pytest.raises(WorkerDied, match=rf"^ingest worker 0 \(pid {pid}\) died: killed "
                           r"by signal SIGKILL$"):  # fmt: skip
            pool.submit("a", time.sleep, 0)


def test_closing_stops_a_worker_in_the_middle_of_a_task(no_workers_left):
    pool = ForkPool(2)
    pool.submit("a", time.sleep, 60)
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 5


def test_workers_die_with_the_parent_even_of_kill_9(tmp_path):
    script = (
        "import sys, time\n"
        "from ingest.parallel import ForkPool\n"
        "pool = ForkPool(2)\n"
        "pool.submit('a', time.sleep, 60)\n"
        "print(*(pid for pid, _ in pool._workers), flush=True)\n"
        "time.sleep(60)\n"
    )
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    killer = threading.Timer(30, proc.kill)  # never hang the suite
    killer.start()
    try:
        workers = [int(pid) for pid in proc.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
        proc.kill()
        proc.wait()
    finally:
        killer.cancel()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(_alive(pid) for pid in workers)


def _collect(_: int) -> int:
    return gc.collect() >= 0


def test_a_worker_never_finalises_what_it_inherits(no_workers_left):
    gc.collect()
    gc.disable()  # keep the cycle uncollected until the workers are forked
    try:
        ParentOnly()
        with ForkPool(2) as pool:
            got = _run_all(pool, _collect, list(range(4)))
    finally:
        gc.enable()
    assert got == {i: True for i in range(4)}


@pytest.fixture
def nothing_frozen():
    """Freezes counted from none: the suite's own (conftest) is undone for this test."""
    gc.unfreeze()


def test_the_parents_generations_are_left_alone(monkeypatch, nothing_frozen):
    """Nothing of the parent is frozen for good (its cycles are still collected), and a
    freeze of the caller's own stays as it was."""
    with inherited_objects_frozen():
        assert not gc.isenabled()  # nothing collected between a fork and its freeze
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.freeze()  # a training script's, against copy-on-write in its own workers
    calls = []  # the parent's freezes and unfreezes (a forked worker records in its copy)
    for name in ("freeze", "unfreeze"):
        real = getattr(gc, name)
        monkeypatch.setattr(gc, name, lambda real=real, name=name: calls.append(name) or real())
    try:
        frozen = gc.get_freeze_count()
        with ForkPool(2) as pool:
            assert _run_all(pool, _collect, [0, 1]) == {0: True, 1: True}
        assert calls == []
        # Frozen objects still die when their last reference goes (other threads of the
        # suite may drop some meanwhile), but none is added and the freeze is not undone.
        assert frozen * 0.99 <= gc.get_freeze_count() <= frozen
    finally:
        monkeypatch.undo()
        gc.unfreeze()

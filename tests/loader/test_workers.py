"""WorkerPool: which worker gets a task, and that every result reaches the caller."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time

from loader.ring import Ring
from loader.workers import WorkerPool


class Sleeper:
    """A producer whose task only takes time: ``fill(views, seconds)``."""

    def fill(self, views, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def results(pool: WorkerPool, count: int, timeout: float = 10.0) -> list[tuple]:
    got, deadline = [], time.monotonic() + timeout
    while len(got) < count and time.monotonic() < deadline:
        got += pool.receive(0.1)
    return got


def test_a_finished_worker_counts_as_idle_before_its_result_is_read():
    ring = Ring({"x": ((1,), "uint8")}, slots=3, shared=True)
    pool = WorkerPool(Sleeper(), ring, 2, mp.get_context("fork"))
    try:
        pool.submit((0, 0, (2.0,)))  # worker 0: busy for 2 s
        pool.submit((1, 1, (0.0,)))  # worker 1: done at once
        assert pool._conns[1].poll(10)  # its result has arrived, not yet read
        pool.submit((2, 2, (0.0,)))  # goes to worker 1, idle, not to worker 0 (a tie)
        assert pool.outstanding == [1, 1]
        got = results(pool, 3)
        assert sorted((step, slot, report) for step, slot, report in got) == [
            (0, 0, 2.0),
            (1, 1, 0.0),
            (2, 2, 0.0),
        ]
        assert pool.outstanding == [0, 0]
    finally:
        pool.close(graceful=False)


def test_two_threads_wait_on_the_pool_at_once():
    """A loop's thread may drain the pool (closing an iteration) while the prefetch thread
    waits on it: both wake for a result, one reads it, and the other neither breaks the
    pipe's framing nor waits in it for a message that will not come."""
    ring = Ring({"x": ((1,), "uint8")}, slots=4, shared=True)
    pool = WorkerPool(Sleeper(), ring, 2, mp.get_context("fork"))
    got, errors = [], []

    def wait_for_results() -> None:
        try:
            deadline = time.monotonic() + 5
            while len(got) < 2 and time.monotonic() < deadline:
                got.extend(pool.receive(0.2))
        except Exception as e:  # a pipe read by both: its framing broken
            errors.append(e)

    try:
        threads = [threading.Thread(target=wait_for_results) for _ in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.3)  # both are in their wait
        pool.submit((0, 0, (0.0,)))  # one result a worker, then nothing more
        pool.submit((1, 1, (0.5,)))
        for t in threads:
            t.join(10)
        assert not any(t.is_alive() for t in threads)  # neither waits in a read pipe
        assert errors == []
        assert sorted(step for step, _, _ in got) == [0, 1]
    finally:
        pool.close(graceful=False)

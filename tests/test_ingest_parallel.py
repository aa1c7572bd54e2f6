"""ordered_map: results in item order, worker failures surfaced, workers never left behind."""

from __future__ import annotations

import os
import signal

import pytest

from ingest.parallel import ordered_map


def _payload(i: int) -> tuple[list, bytes]:
    # Sizes up to 200 KB: larger than a pipe's buffer, so frames span many reads.
    return [i, f"item-{i}"], bytes([i % 251]) * (i * 2000)


def _fails_at_37(i: int) -> tuple[list, bytes]:
    if i == 37:
        raise ValueError(f"boom {i}")
    return [i], b""


def _dies_at_50(i: int) -> tuple[list, bytes]:
    if i == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    return [i], b"x"


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


@pytest.fixture
def no_workers_left():
    """Fails the test if it leaves a child process behind."""
    before = _children()
    yield
    assert _children() == before


@pytest.mark.parametrize(("workers", "chunk"), [(1, 1), (2, 16), (3, 4), (5, 7)])
def test_results_come_back_in_item_order(workers: int, chunk: int, no_workers_left):
    items = list(range(101))
    got = list(ordered_map(_payload, items, workers, chunk=chunk))
    assert got == [_payload(i) for i in items]


def test_an_exception_in_a_worker_is_raised_with_its_traceback(no_workers_left):
    results = ordered_map(_fails_at_37, list(range(100)), 3, chunk=4)
    got = []
    with pytest.raises(RuntimeError, match=r"ingest worker 0 \(pid \d+\) failed:(.|\n)*boom 37"):
        for header, _ in results:
            got.append(header[0])
    assert got == list(range(37))  # every item before the failing one was delivered


def test_a_killed_worker_is_reported_not_waited_for(no_workers_left):
    died = r"ingest worker 0 \(pid \d+\) died: killed by signal SIGKILL"
    with pytest.raises(RuntimeError, match=died):
        list(ordered_map(_dies_at_50, list(range(200)), 2, chunk=25))


def test_abandoning_the_iterator_stops_the_workers(no_workers_left):
    results = ordered_map(_payload, list(range(100)), 2, chunk=4)
    assert next(results)[0] == [0, "item-0"]
    results.close()

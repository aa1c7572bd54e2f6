"""Ring: a slot's views are made once and show what the workers write after."""

from __future__ import annotations

import multiprocessing as mp

from loader.ring import Ring


def _write(tensors, slot: int, value: int) -> None:
    tensors["x"][slot].fill_(value)


def test_a_slots_views_are_made_once_and_show_later_writes():
    ring = Ring({"x": ((4,), "int64"), "y": ((2, 3), "uint8")}, slots=2, shared=True)
    ring.tensors["x"].zero_()
    first = ring.slot(1)
    arrays = first.arrays
    assert ring.slot(1) is first and first.arrays is arrays  # no new views a batch
    assert set(arrays) == {"x", "y"} and arrays["y"].shape == (2, 3)
    worker = mp.get_context("fork").Process(target=_write, args=(ring.tensors, 1, 7))
    worker.start()
    worker.join(10)
    assert worker.exitcode == 0
    assert arrays["x"].tolist() == [7, 7, 7, 7]  # the views made before, read after
    assert ring.slot(0).arrays["x"].tolist() == [0, 0, 0, 0]  # the other slot's own memory

"""Routing (``loader.gpu.tuning.routing``): each batch's way, kept by its seed until it starts."""

from __future__ import annotations

from loader.gpu.tuning.routing import _MAX_PLANNED, Routing


class Alternating:  # a picker that gives its ways in turn
    def __init__(self, ways):
        self.ways, self.k, self.way, self.forgotten = ways, 0, ways[0], 0

    def next(self):
        self.k += 1
        return self.ways[(self.k - 1) % len(self.ways)]

    def forget(self):
        self.forgotten += 1


def test_each_batch_starts_with_the_way_it_was_planned_with_in_any_order():
    routing = Routing(("gpu", "gpu+cpu"), share=0.4, auto=True)
    routing.picker = Alternating(("gpu", "gpu+cpu"))
    shares = [routing.plan(seed) for seed in (10, 11, 12, 13)]
    assert shares == [0.0, 0.4, 0.0, 0.4]  # with "auto", only "+cpu" takes the share
    assert [routing.started(s) for s in (13, 10, 12)] == ["gpu+cpu", "gpu", "gpu"]
    assert routing.pending == 1
    routing.forget()  # the iteration closed: 11 never starts
    assert routing.pending == 0 and routing.picker.forgotten == 1
    assert routing.started(11) == "gpu"  # unknown: the way kept


def test_a_fixed_share_is_every_ways_and_a_fixed_way_every_batchs():
    routing = Routing(("engines", "cuda"), share=0.25)
    assert routing.picker is not None and routing.kept() == "engines"
    routing.fix("cuda")
    assert routing.picker is None
    assert [routing.plan(s) for s in range(3)] == [0.25] * 3
    assert [routing.started(s) for s in range(3)] == ["cuda"] * 3
    assert Routing().picker is None and Routing().plan(0) == 0.0  # one way: no picker


def test_ways_of_batches_dropped_unstarted_are_let_go_past_the_cap():
    routing = Routing(("gpu",))
    for seed in range(_MAX_PLANNED + 10):
        routing.plan(seed)
    assert routing.pending == _MAX_PLANNED
    routing.fix("other")
    assert routing.started(0) == "other"  # the oldest let go: the way kept
    assert routing.started(_MAX_PLANNED + 9) == "gpu"

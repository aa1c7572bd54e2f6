"""StepTables: a batch's recipe draws and kernels' tables, made by a worker into its slot, are
exactly what the stage would make from the batch seed; the loader's stage reads them there."""

from __future__ import annotations

import numpy as np
import pytest

from loader.augment import Transform
from loader.gpu.step_tables import StepTables
from loader.ops.color import ColorJitter
from loader.ops.erasing import RandomErasing
from loader.ops.timm_augment import auto_augment, rand_augment

HPARAMS = {"translate_const": 10, "img_mean": (124, 116, 104)}


def _spec(erasing=True) -> Transform:
    steps = (
        rand_augment("rand-m9-mstd0.5-inc1", HPARAMS),
        ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), (-0.1, 0.1)),
        auto_augment("original", HPARAMS),
    )
    return Transform(
        "train", (24, 20), steps=steps, erasing=RandomErasing(0.5) if erasing else None
    )


def _slot(tables: StepTables, b: int) -> dict[str, np.ndarray]:
    return {name: np.full(shape, 7, dtype) for name, (shape, dtype) in tables.buffers(b).items()}


@pytest.mark.parametrize("n", [8, 5])
def test_tables_read_from_a_slot_are_the_ones_made_from_the_seed(n):
    tables = StepTables(_spec())
    assert tables.layers == [2, 0, 2] and tables.widths == [6, 8, 7]
    slot = _slot(tables, 8)
    tables.fill(slot, 1234, n)
    got, want = tables.read(slot, n), tables.make(1234, n)
    assert len(got.params) == 3
    for g, w in zip(got.params, want.params, strict=True):
        assert g.shape == w.shape == (n, w.shape[1]) and np.array_equal(g, w, equal_nan=True)
    assert got.layers.shape == (4, n, 12) and np.array_equal(got.layers, want.layers)
    assert got.luts.shape == (4, n, 256) and np.array_equal(got.luts, want.luts)
    assert np.array_equal(got.rows, want.rows) and got.noise == want.noise
    assert got.boxes[:, 3].any() and not got.boxes[:, 3].all()  # some erased, some not (p=0.5)
    assert not np.array_equal(tables.make(1235, n).layers, want.layers)  # the seed decides


def test_a_recipe_without_fused_steps_or_erasing_has_no_layers_nor_boxes():
    spec = Transform("train", (24, 20), steps=(ColorJitter((0.6, 1.4), None, None, None),))
    tables = StepTables(spec)
    assert tables.layers == [0]
    made = tables.make(3, 4)
    assert made.layers.shape == (0, 4, 12) and made.luts.shape == (0, 4, 256)
    assert not made.rows[:, :4].any()
    slot = _slot(tables, 4)
    tables.fill(slot, 3, 4)
    got = tables.read(slot, 4)
    assert np.array_equal(got.params[0], made.params[0], equal_nan=True)
    assert got.layers.shape == (0, 4, 12)

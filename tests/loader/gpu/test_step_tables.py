"""StepTables: a batch's recipe draws and kernels' tables, made by a worker into its slot, are
exactly what the stage would make from the batch seed; the loader's stage reads them there
and makes none itself, with a batch split over workers."""

from __future__ import annotations

import gpu_path_data  # noqa: F401  (before Triton: its interpreter where there is no CUDA)
import numpy as np
import pytest
import torch
from gpu_path_data import DEVICE, SIZE, make_small_store, use_stand_ins

import loader.gpu.normalise
import loader.gpu.slots
import loader.gpu.step_tables
import loader.gpu.steps
import loader.plan.tasks
from loader.augment import Transform
from loader.gpu import fused_layers
from loader.gpu.step_tables import StepTables
from loader.gpu.steps import BatchSteps
from loader.ops.color import ColorJitter
from loader.ops.draws import draw
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


def test_the_stage_takes_a_split_batchs_tables_from_its_first_chunks_worker(tmp_path, monkeypatch):
    # Batches of 8 in chunks of 4 over 2 workers; the fused layers (of two timm steps, a
    # plain step between them) and the last launch run (under Triton's interpreter without
    # CUDA). The stage makes no draw nor table: each batch is the plain crop through the
    # steps of its seed's draws, one by one.
    from gpu_checks import TRAIN, batch_seeds, epoch, flat, make  # (needs Triton)

    use_stand_ins(monkeypatch)
    store = make_small_store(tmp_path)
    monkeypatch.setattr(loader.gpu.slots, "_MIN_GATHER_CHUNK", 1)
    monkeypatch.setattr(loader.plan.tasks, "MIN_CHUNK", 1)
    monkeypatch.setattr(BatchSteps, "fused", True)
    monkeypatch.setattr(BatchSteps, "fuse_layers", True)
    steps = (
        rand_augment("rand-m9-mstd0.5-inc1", HPARAMS),
        ColorJitter((0.6, 1.4), None, None),
        auto_augment("original", HPARAMS),
    )
    spec = Transform("train", (SIZE, SIZE), steps=steps, erasing=RandomErasing(0.5, fill="pixel"))
    dl = make(store, transform=spec, dtype=torch.float16)  # (its layout drawn once, here)
    calls = []
    for module, name in (
        (loader.gpu.step_tables, "draw"),
        (loader.gpu.step_tables, "erase_rows"),
        (loader.gpu.normalise, "erase_rows"),
        (fused_layers, "layer_table"),
        (fused_layers, "run_layer"),
        (loader.gpu.steps, "normalise_erase"),
    ):
        real = getattr(module, name)
        spy = lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)  # noqa: E731
        monkeypatch.setattr(module, name, spy)
    got = epoch(dl)
    assert len(got) == 3  # (the workers' calls are theirs: only launches here)
    assert sorted(calls) == ["normalise_erase"] * 3 + ["run_layer"] * 3 * 4  # 4 layers a batch
    plain = epoch(make(store, transform=TRAIN, dtype=torch.uint8))
    seeds = batch_seeds(len(plain))
    want = [_steps_one_by_one(spec, b[0], seed) for b, seed in zip(plain, seeds, strict=True)]
    assert torch.equal(flat(got, 2), flat(plain, 2))
    assert torch.equal(flat(got, 0), torch.cat(want))
    unstepped = Transform("train", (SIZE, SIZE), erasing=spec.erasing)
    base = [_steps_one_by_one(unstepped, b[0], seed) for b, seed in zip(plain, seeds, strict=True)]
    assert not torch.equal(flat(got, 0), torch.cat(base))  # the steps changed pixels


def _steps_one_by_one(spec: Transform, x: torch.Tensor, seed: int) -> torch.Tensor:
    """``x`` through ``spec``'s steps as drawn from ``seed``, each alone (timm's fused, the
    others' torch ops), then normalised, cast and erased by the last launch."""
    draws = draw(spec, seed, len(x))
    x = x.to(DEVICE)  # (the delivered batches come back on the CPU)
    for step, params in zip(spec.steps, draws.params, strict=True):
        fused = fused_layers.fusable(step)
        x = fused_layers.apply(step, x, params) if fused else step.apply(x, params)
    scale = torch.tensor(1.0 / (255.0 * np.asarray(spec.std))).float().view(1, 3, 1, 1)
    bias = torch.tensor(-np.asarray(spec.mean) / np.asarray(spec.std)).float().view(1, 3, 1, 1)
    table = loader.gpu.normalise.levels(scale.to(DEVICE), bias.to(DEVICE))
    return loader.gpu.normalise.normalise_erase(
        x, table, torch.float16, torch.contiguous_format, spec.erasing, draws.boxes, draws.noise
    ).cpu()

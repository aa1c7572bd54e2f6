"""The GPU path's fused auto-augmentation layers (``loader.gpu.fused_layers``) against the
torch ops they stand for (``loader.ops.timm_augment``: the CPU path's, checked against
timm's PIL ops in tests/loader/ops): the same draws, the same pixels but for the rounding
of a fused multiply-add, at most 1 level on at most 0.01% of a batch's pixels, the
channels-last input and the exact quarter turns exact. Without CUDA, Triton's interpreter
runs the kernels on small batches.
"""

from __future__ import annotations

import gpu_path_data  # noqa: F401  (before Triton: its interpreter where there is no CUDA)
import numpy as np
import pytest
import torch
from gpu_path_data import CUDA, DEVICE
from loader_data import photo_batch

from loader.gpu import fused_layers
from loader.ops.color import ColorJitter
from loader.ops.timm_augment import auto_augment, rand_augment

N, H, W = (64, 224, 200) if CUDA else (16, 36, 40)
HPARAMS = {"translate_const": 10 if not CUDA else 100, "img_mean": (124, 116, 104)}
SPECS = [
    ("rand", "rand-m9-mstd0.5-inc1"),  # timm's ResNet strikes back, DeiT
    ("rand", "rand-m15-n3-mstd101"),  # uniform magnitudes: every level, larger warps
    ("rand", "rand-m0-n2"),  # level 0: rotations of 0 degrees (the exact-turn path)
    ("auto", "original"),
    ("auto", "v0r"),
]


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    square = photo_batch(N, max(H, W) + 4)
    return square[:, :, 2 : 2 + H, 1 : 1 + W].contiguous().to(DEVICE)


def _step(kind: str, spec: str):
    return (rand_augment if kind == "rand" else auto_augment)(spec, HPARAMS)


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.int() - want.int()).abs()
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert diff.max().item() <= 1, f"{diff.max().item()} levels off"
    assert (diff > 0).float().mean().item() <= 1e-4, f"{(diff > 0).sum().item()} pixels off"


@pytest.mark.parametrize("kind,spec", SPECS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_fused_layer_gives_the_torch_ops_pixels(batch, kind, spec, seed):
    step = _step(kind, spec)
    params = step.draw(np.random.default_rng(seed), len(batch))
    _within_rounding(fused_layers.apply(step, batch, params), step.apply(batch, params))


def test_channels_last_input_gives_the_same_pixels(batch):
    step = _step("rand", "rand-m9-mstd0.5-inc1")
    params = step.draw(np.random.default_rng(7), len(batch))
    want = fused_layers.apply(step, batch, params)
    got = fused_layers.apply(step, batch.contiguous(memory_format=torch.channels_last), params)
    assert torch.equal(got, want)


def test_exact_turns_are_transpositions(batch):
    square = batch[:, :, :32, :32].contiguous()
    n = len(square)
    names = np.array(["Rotate"] * n)
    for k, angle in ((1, 90.0), (2, 180.0), (3, 270.0), (0, 360.0)):
        table, host = fused_layers.layer_table(names, names, np.full(n, angle), np.zeros(n), 32, 32)
        got = fused_layers.run_layer(square, table, host, (1, 2, 3))
        assert torch.equal(got, torch.rot90(square, k, (-2, -1))), angle
    table, host = fused_layers.layer_table(names, names, np.full(n, 180.0), np.zeros(n), H, W)
    assert torch.equal(fused_layers.run_layer(batch, table, host, (1, 2, 3)), batch.flip(-1, -2))


def test_only_timms_policies_on_uint8_rgb_batches_are_fused(batch):
    step = _step("rand", "rand-m9-mstd0.5-inc1")
    assert fused_layers.handles(step, batch)
    assert not fused_layers.handles(step, batch.float())
    assert not fused_layers.handles(step, batch[:, :1])
    assert not fused_layers.handles(ColorJitter((0.6, 1.4), None, None, None), batch)

"""Batched ColorJitter and RandomGrayscale against torchvision's tensor functions, sample by
sample with the same factors: at most 1 uint8 level apart (float rounding of the blends and
of the HSV rotation), and the draws' ranges and orders."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from loader_data import photo_batch

from loader.ops import color
from loader.ops.color import ColorJitter, RandomGrayscale

N = 12


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return photo_batch(N, 48)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.02, (diff.max(), diff.float().mean())


@pytest.mark.parametrize(
    "step, reference, low, high",
    [
        (color.brightness, F.adjust_brightness, 0.4, 1.6),
        (color.contrast, F.adjust_contrast, 0.4, 1.6),
        (color.saturation, F.adjust_saturation, 0.0, 2.0),
        (color.hue, F.adjust_hue, -0.5, 0.5),
        (color.hue_torch, F.adjust_hue, -0.5, 0.5),
    ],
    ids=["brightness", "contrast", "saturation", "hue", "hue-batched-torch"],
)
def test_each_step_is_torchvisions_per_sample(batch, step, reference, low, high):
    factors = torch.linspace(low, high, N)
    got = step(batch, factors)
    assert got.dtype == torch.uint8 and got.shape == batch.shape
    for k in range(N):
        _close(got[k], reference(batch[k], float(factors[k])))


def test_gray_is_torchvisions(batch):
    got = color.grayscale(batch)
    for k in range(N):
        assert torch.equal(got[k], F.rgb_to_grayscale(batch[k], num_output_channels=3))


def test_jitter_takes_each_samples_order_and_factors(batch):
    jitter = ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), (-0.1, 0.1))
    params = jitter.draw(np.random.default_rng(3), N)
    got = jitter.apply(batch, params)
    steps = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
    for k in range(N):
        want = batch[k]
        for step in params[k, :4].astype(int):
            want = steps[step](want, float(np.float32(params[k, 4 + step])))
        _close(got[k], want)


def test_jitter_draws_uniform_factors_in_their_ranges_and_every_order():
    jitter = ColorJitter(brightness=(0.5, 1.5), hue=(-0.2, 0.2))
    params = jitter.draw(np.random.default_rng(0), 20000)
    orders = {tuple(row) for row in params[:, :4].astype(int)}
    assert len(orders) == 24  # every permutation of the four steps
    b, c, s, h = params[:, 4:].T
    assert np.isnan(c).all() and np.isnan(s).all()
    assert b.min() >= 0.5 and b.max() < 1.5 and abs(b.mean() - 1.0) < 0.01
    assert h.min() >= -0.2 and h.max() < 0.2 and abs(h.mean()) < 0.005
    again = jitter.draw(np.random.default_rng(0), 20000)
    assert np.array_equal(params, again, equal_nan=True)  # the seed decides


def test_grayscale_takes_its_share(batch):
    gray = RandomGrayscale(0.5)
    params = gray.draw(np.random.default_rng(1), N)
    got = gray.apply(batch, params)
    for k in range(N):
        want = F.rgb_to_grayscale(batch[k], 3) if params[k, 0] else batch[k]
        assert torch.equal(got[k], want)
    share = gray.draw(np.random.default_rng(2), 20000)[:, 0].mean()
    assert abs(share - 0.5) < 0.02

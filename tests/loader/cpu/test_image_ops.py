"""The workers' OpenCV ops (``loader.cpu.image_ops``, through ``image_steps``) against the
batched torch ops they stand in for, which tests/loader/ops/test_autoaugment.py holds to
torchvision's: every op with nearest warps pixel for pixel, at several bins (20: a shear's
rows fall on ties) and both signs, on square and oblong photographs and a flat gray
image; bilinear warps (without a fill; with one the torch ops are kept) within a level on
1e-3 of the pixels. Then the nearest pixels bit for bit against ``grid_sample``'s, whole
policies' draws, the steps that keep the torch ops, and tiny images.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as nnf
from loader_data import assert_within_rounding, photo_batch

from loader.cpu import image_steps
from loader.ops import geometry
from loader.ops.autoaugment import OPS, AutoAugment, RandAugment, TrivialAugmentWide
from loader.ops.autoaugment_batch import WARPS, matrices
from loader.ops.color import ColorJitter
from loader.ops.timm_augment import rand_augment

N = 12
FILL = (124, 116, 104)


@pytest.fixture(scope="module", params=[(48, 48), (40, 56)], ids=["square", "oblong"])
def batch(request) -> torch.Tensor:
    h, w = request.param
    return photo_batch(N, 64)[..., :h, :w].contiguous()


def _images(step, batch: torch.Tensor, params: np.ndarray) -> torch.Tensor:
    """``batch`` through ``step`` image by image, as a worker runs it (HWC in place)."""
    out = batch.permute(0, 2, 3, 1).contiguous().clone()  # never a view of ``batch``
    for k in range(len(out)):
        image_steps.apply([step], out[k].numpy(), [params[k]])
    return out.permute(0, 3, 1, 2)


@pytest.mark.parametrize("fill", [None, FILL], ids=["no-fill", "fill"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("at", [0, 9, 20, 30])
@pytest.mark.parametrize("name", OPS)
def test_each_op_is_the_torch_ops(batch, name, at, sign, fill):
    step = RandAugment(1, at, 31, "nearest", fill)
    params = np.tile([OPS.index(name), at, sign], (N, 1)).astype(np.float64)
    got, want = _images(step, batch, params), step.apply(batch, params)
    assert got.dtype == torch.uint8 and got.shape == batch.shape
    assert torch.equal(got, want), (got != want).any(1).float().mean()


@pytest.mark.parametrize("size", [(40, 56), (224, 224), (7, 300)])
def test_the_nearest_pixels_are_grid_samples_picks(size):
    h, w = size
    index = torch.arange(1, h * w + 1, dtype=torch.float32).view(1, 1, h, w)  # 0: outside
    for name in WARPS:
        for m in (0.2, -0.3, 0.033, 0.99 * 7 / 30, 5.0, -17.0, 30.0, 135.0, 0.09):
            inverse = matrices(name, np.array([m]), h, w)
            at = geometry.grid(inverse, h, w, "cpu")
            picked = nnf.grid_sample(index, at, mode="nearest", align_corners=False)[0, 0]
            xs, ys = geometry.nearest_pixels(inverse[0], h, w)
            inside = (xs >= 0) & (xs < w) & (ys >= 0) & (ys < h)
            mine = np.where(inside, ys * w + xs + 1, 0)
            assert np.array_equal(mine, picked.numpy()), (name, m, (mine != picked.numpy()).sum())


@pytest.mark.parametrize("name", WARPS)
def test_bilinear_warps_are_the_torch_ops_within_a_level(batch, name):
    step = TrivialAugmentWide(31, "bilinear")
    params = np.stack(
        [np.full(N, OPS.index(name)), np.arange(N) * 2 + 7, (-1.0) ** np.arange(N)], 1
    )
    assert_within_rounding(_images(step, batch, params), step.apply(batch, params))


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize(
    "step",
    [
        RandAugment(2, 9),
        RandAugment(3, 20, fill=FILL),
        TrivialAugmentWide(),
        AutoAugment("imagenet"),
    ],
    ids=["rand", "rand-fill", "wide", "imagenet"],
)
def test_a_policys_draws_are_the_torch_ops(batch, step, mode):
    import dataclasses

    step = dataclasses.replace(step, interpolation=mode)
    assert image_steps.runs_here(step) == (mode == "nearest" or step.fill is None)
    params = step.draw(np.random.default_rng(3), N)
    got, want = _images(step, batch, params), step.apply(batch, params)
    if mode == "nearest":
        assert torch.equal(got, want)
    else:
        diff = (got.int() - want.int()).abs()
        assert float((diff > 0).float().mean()) < 1e-3, float((diff > 0).float().mean())


@pytest.mark.parametrize(
    "step",
    [
        RandAugment(2, 9, interpolation="bicubic"),
        RandAugment(2, 9, interpolation="bilinear", fill=FILL),
        ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), (-0.1, 0.1)),
        rand_augment("rand-m9-mstd0.5-inc1"),
    ],
    ids=["bicubic", "bilinear-fill", "color-jitter", "timm"],
)
def test_other_steps_keep_their_torch_ops(batch, step):
    assert not image_steps.runs_here(step)
    params = step.draw(np.random.default_rng(4), N)
    assert torch.equal(_images(step, batch, params), step.apply(batch, params))


def test_tiny_images(batch):
    step = RandAugment(1, 9)
    for h, w in [(1, 1), (1, 5), (2, 7), (3, 3)]:
        tiny = batch[:, :, :h, :w].contiguous()
        for name in OPS:
            params = np.tile([OPS.index(name), 9, -1.0], (N, 1)).astype(np.float64)
            got, want = _images(step, tiny, params), step.apply(tiny, params)
            assert torch.equal(got, want), (name, h, w)

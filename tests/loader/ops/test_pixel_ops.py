"""The batched warps and tone ops against torchvision's tensor functions (v2), sample by
sample with the same arguments: the warps (nearest and bilinear, with and without a fill),
posterize, solarize, autocontrast, equalize and invert equal pixel for pixel; sharpness
within 1 level on at most 0.1% of the pixels (float rounding of the blend; measured equal).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.v2.functional as F
from loader_data import photo_batch

from loader.ops import geometry, tone

N, SIZE = 12, 48
FILL = (124.0, 116.0, 104.0)
MODES = ("nearest", "bilinear")


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return photo_batch(N, SIZE)


def _each(got: torch.Tensor, want, max_diff: int = 0, share: float = 0.0) -> None:
    """Each sample ``k`` of ``got`` against ``want(k)``: at most ``max_diff`` levels apart,
    on at most a ``share`` of the pixels."""
    assert got.dtype == torch.uint8
    diff = torch.stack([(got[k].int() - want(k).int()).abs() for k in range(len(got))])
    assert diff.max() <= max_diff and (diff > 0).float().mean() <= share, (
        diff.max(),
        (diff > 0).float().mean(),
    )


def _mode(mode: str):
    return F.InterpolationMode(mode)


@pytest.mark.parametrize("fill", [None, FILL], ids=["no-fill", "fill"])
@pytest.mark.parametrize("mode", MODES)
def test_rotation_is_torchvisions(batch, mode, fill):
    angle = np.random.default_rng(0).uniform(-135, 135, N)
    angle[:4] = (90.0, -90.0, 180.0, 0.0)  # the transposed fast paths
    got = geometry.rotate(batch, angle, mode, fill)
    tv_fill = None if fill is None else list(fill)
    _each(got, lambda k: F.rotate(batch[k], float(angle[k]), _mode(mode), fill=tv_fill))


@pytest.mark.parametrize("fill", [None, FILL], ids=["no-fill", "fill"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("axis", [0, 1], ids=["x", "y"])
def test_shear_about_the_corner_is_torchvisions(batch, mode, fill, axis):
    degrees = np.degrees(np.arctan(np.random.default_rng(1).uniform(-0.99, 0.99, N)))
    shear = (degrees, 0.0) if axis == 0 else (0.0, degrees)
    corner = (-0.5 * SIZE, -0.5 * SIZE)
    got = geometry.warp(batch, geometry.inverse_matrices(shear=shear, center=corner), mode, fill)

    def want(k):
        sh = [float(degrees[k]), 0.0] if axis == 0 else [0.0, float(degrees[k])]
        tv_fill = None if fill is None else list(fill)
        return F.affine(batch[k], 0.0, [0, 0], 1.0, sh, _mode(mode), tv_fill, center=[0, 0])

    _each(got, want)


@pytest.mark.parametrize("fill", [None, FILL], ids=["no-fill", "fill"])
@pytest.mark.parametrize("mode", MODES)
def test_translation_is_torchvisions(batch, mode, fill):
    shift = np.trunc(np.random.default_rng(2).uniform(-40, 40, (2, N)))
    matrices = geometry.inverse_matrices(translate=(shift[0], shift[1]))
    got = geometry.warp(batch, matrices, mode, fill)

    def want(k):
        move = [int(shift[0, k]), int(shift[1, k])]
        tv_fill = None if fill is None else list(fill)
        return F.affine(batch[k], 0.0, move, 1.0, [0.0, 0.0], _mode(mode), tv_fill)

    _each(got, want)


def test_a_pil_warp_fills_where_a_pixel_centre_maps_outside(batch):
    shift = np.full(N, 10.0)  # PIL's data: the image moves 10 pixels left
    data = np.stack([np.ones(N), 0 * shift, shift, 0 * shift, np.ones(N), 0 * shift], 1)
    matrices = geometry.from_pil(data, SIZE, SIZE)
    for mode in ("nearest", "bilinear", "bicubic"):
        got = geometry.warp(batch, matrices, mode, (1, 2, 3), edge="pil")
        assert torch.equal(got[..., :-10], batch[..., 10:])  # whole-pixel shifts are exact
        want = torch.tensor([1, 2, 3], dtype=torch.uint8).view(1, 3, 1, 1)
        assert (got[..., -10:] == want).all()


def test_sharpness_is_torchvisions(batch):
    factor = torch.linspace(0.0, 2.0, N)
    got = tone.sharpness(batch, factor)
    _each(got, lambda k: F.adjust_sharpness(batch[k], float(factor[k])), 1, 1e-3)


def test_posterize_solarize_invert_are_torchvisions(batch):
    bits = torch.arange(N) % 9
    _each(tone.posterize(batch, bits), lambda k: F.posterize(batch[k], int(bits[k])))
    threshold = torch.linspace(0.0, 255.0, N)
    got = tone.solarize(batch, threshold)
    _each(got, lambda k: F.solarize(batch[k], float(threshold[k])))
    _each(tone.invert(batch), lambda k: F.invert(batch[k]))


def test_autocontrast_and_equalize_are_torchvisions(batch):
    # the last sample is flat (autocontrast keeps it; equalize's step is 0)
    low_contrast = (batch // 4 + 60).to(torch.uint8)
    for x in (batch, low_contrast):
        _each(tone.autocontrast(x), lambda k, x=x: F.autocontrast(x[k]))
        _each(tone.equalize(x), lambda k, x=x: F.equalize(x[k]))


def test_the_ops_take_strided_batches(batch):
    """A channels-last batch (a worker's HWC image) and a cropped slice give the same."""
    wider = torch.cat([batch[..., :5], batch], 3)
    strided = [batch.contiguous(memory_format=torch.channels_last), wider[..., 5:]]
    angle = np.linspace(-30, 30, N)
    for x in strided:
        want = geometry.rotate(batch, angle, "bilinear")
        assert torch.equal(geometry.rotate(x, angle, "bilinear"), want)
        assert torch.equal(tone.equalize(x), tone.equalize(batch))
        assert torch.equal(tone.autocontrast_pil(x), tone.autocontrast_pil(batch))
        factor = torch.full((N,), 1.7)
        assert torch.equal(tone.sharpness(x, factor), tone.sharpness(batch, factor))

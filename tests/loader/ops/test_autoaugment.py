"""torchvision's RandAugment, TrivialAugmentWide and AutoAugment, batched: each sample's ops
replayed through torchvision v2's own op code (``_apply_image_or_video_transform``, its
magnitude spaces) give the same pixels: exactly where a sample drew no blend
(Brightness, Color, Contrast, Sharpness); with one, within 1 level a blend, which a later
threshold op may flip (mean abs difference measured 0.0008 a batch, 0.014 a sample; bounds
0.01 and 0.1). Then the draws (op, bin, sign and sub-policy frequencies), the seed, one
image at a time, strides, CUDA against the CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms.v2 as v2
from loader_data import assert_within_rounding, photo_batch

from loader.ops import policies
from loader.ops.autoaugment import OPS, AutoAugment, RandAugment, TrivialAugmentWide, magnitudes

N, SIZE = 24, 48
BLENDS = {OPS.index(name) for name in ("Brightness", "Color", "Contrast", "Sharpness")}


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return photo_batch(N, SIZE)


def _pair(kind: str, mode: str, fill):
    """(ours, torchvision's, magnitude bins, layers) of ``kind``."""
    tv_args = {"interpolation": v2.InterpolationMode(mode), "fill": fill}
    if kind == "rand":
        return RandAugment(2, 9, 31, mode, fill), v2.RandAugment(2, 9, 31, **tv_args), 31, 2
    if kind == "wide":
        return TrivialAugmentWide(31, mode, fill), v2.TrivialAugmentWide(31, **tv_args), 31, 1
    ours = AutoAugment(kind, mode, fill)
    return ours, v2.AutoAugment(v2.AutoAugmentPolicy(kind), **tv_args), 10, 2


def _replay(tv, bins: int, image: torch.Tensor, row: np.ndarray, layers: int) -> torch.Tensor:
    """One sample's ops by torchvision's code, its magnitude from torchvision's space."""
    h, w = image.shape[-2:]
    for op, at, sign in row[: 3 * layers].reshape(layers, 3):
        if op < 0:
            continue
        name = OPS[int(op)]
        space, signed = tv._AUGMENTATION_SPACE[name]
        values = space(bins, h, w)
        magnitude = 0.0 if values is None else float(values[int(at)])
        magnitude = -magnitude if signed and sign < 0 else magnitude
        image = tv._apply_image_or_video_transform(
            image, name, magnitude, tv.interpolation, tv._fill
        )
    return image


@pytest.mark.parametrize("fill", [None, (124, 116, 104)], ids=["no-fill", "fill"])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("kind", ["rand", "wide", "imagenet", "cifar10", "svhn"])
def test_each_sample_is_torchvisions_replay(batch, kind, mode, fill):
    ours, tv, bins, layers = _pair(kind, mode, fill)
    params = ours.draw(np.random.default_rng(7), N)
    got = ours.apply(batch, params)
    assert got.dtype == torch.uint8 and got.shape == batch.shape
    diffs = []
    for k in range(N):
        diff = (got[k].int() - _replay(tv, bins, batch[k], params[k], layers).int()).abs()
        blended = BLENDS & set(params[k, : 3 * layers : 3].astype(int).tolist())
        assert blended or diff.max() == 0, (k, params[k])
        assert diff.float().mean() < 0.1, (k, params[k])
        diffs.append(diff.float().mean())
    assert torch.stack(diffs).mean() < 0.01


def test_the_spaces_and_policies_are_torchvisions():
    for wide, cls, bins in ((False, v2.RandAugment, 31), (False, v2.AutoAugment, 10)):
        for name, (space, _) in cls._AUGMENTATION_SPACE.items():
            values = space(bins, 40, 56)
            if values is not None:
                assert np.array_equal(magnitudes(wide, bins, 40, 56)[OPS.index(name)], values)
    for name, (space, _) in v2.TrivialAugmentWide._AUGMENTATION_SPACE.items():
        if space(31, 40, 56) is not None:
            assert np.array_equal(magnitudes(True, 31, 40, 56)[OPS.index(name)], space(31, 0, 0))
    for name in ("imagenet", "cifar10", "svhn"):
        want = v2.AutoAugment(v2.AutoAugmentPolicy(name))._policies
        assert [tuple(sub) for sub in want] == list(policies.TORCHVISION[name])


def _signs_balance(params: np.ndarray, layers: int) -> None:
    cells = params[:, : 3 * layers].reshape(-1, 3)
    signed = np.isin(cells[:, 0], [OPS.index(n) for n in OPS[1:10]])
    assert abs((cells[signed, 2] < 0).mean() - 0.5) < 0.01
    assert (cells[~signed, 2] == 1).all()


def test_rand_augment_draws_uniform_ops_at_its_bin_with_random_signs():
    params = RandAugment(3, 13).draw(np.random.default_rng(0), 20000)
    assert params.shape == (20000, 9)
    ops = params[:, 0::3]
    counts = np.bincount(ops.astype(int).ravel(), minlength=15)
    assert counts[14] == 0 and np.abs(counts[:14] / ops.size - 1 / 14).max() < 0.005
    assert (params[:, 1::3] == 13).all()
    _signs_balance(params, 3)


def test_trivial_augment_draws_uniform_bins():
    params = TrivialAugmentWide(num_magnitude_bins=11).draw(np.random.default_rng(1), 22000)
    assert np.abs(np.bincount(params[:, 1].astype(int)) / 22000 - 1 / 11).max() < 0.01
    assert np.abs(np.bincount(params[:, 0].astype(int)) / 22000 - 1 / 14).max() < 0.01
    _signs_balance(params, 1)


def test_auto_augment_takes_each_op_with_its_probability():
    step = AutoAugment("cifar10")
    params = step.draw(np.random.default_rng(2), 50000)
    sub = params[:, 6].astype(int)
    assert np.abs(np.bincount(sub, minlength=25) / 50000 - 1 / 25).max() < 0.005
    for s, ops in enumerate(policies.TORCHVISION["cifar10"]):
        mine = params[sub == s]
        for slot, (name, prob, at) in enumerate(ops):
            taken = mine[:, 3 * slot] >= 0
            assert abs(taken.mean() - prob) < 4 * np.sqrt(prob * (1 - prob) / len(mine)) + 1e-9
            assert (mine[taken, 3 * slot] == OPS.index(name)).all()
            assert (mine[:, 3 * slot + 1] == (at or 0)).all()
    _signs_balance(params, 2)


@pytest.mark.parametrize("step", [RandAugment(), TrivialAugmentWide(), AutoAugment()])
def test_the_seed_decides(step):
    a, b = step.draw(np.random.default_rng(5), 64), step.draw(np.random.default_rng(5), 64)
    assert np.array_equal(a, b) and not np.array_equal(a, step.draw(np.random.default_rng(6), 64))


@pytest.mark.parametrize(
    "step",
    [RandAugment(4, 20, interpolation="bilinear", fill=9), TrivialAugmentWide(fill=(1, 2, 3)),
     RandAugment(), RandAugment(3, 0), AutoAugment(), AutoAugment("svhn")],
)  # fmt: skip
def test_a_batch_is_its_images_one_by_one_whatever_their_strides(batch, step):
    """A batch runs its warps together and its LUT ops together; one image op by op: the
    same pixels (magnitude 0: rotations by exactly 0 degrees), square or not."""
    params = step.draw(np.random.default_rng(3), N)
    before = batch.clone()
    got = step.apply(batch, params)
    assert torch.equal(batch, before)  # the input is left as it was
    wider = torch.cat([batch[..., :3], batch], 3)
    for x in (batch.contiguous(memory_format=torch.channels_last), wider[..., 3:]):
        assert torch.equal(step.apply(x, params), got)
    for k in range(N):
        hwc = batch[k].permute(1, 2, 0).contiguous()  # as a worker sees its image
        one = step.apply(hwc.permute(2, 0, 1).unsqueeze(0), params[k : k + 1])
        assert torch.equal(one[0], got[k])
    wide = batch[:, :, : batch.shape[2] - 8]
    got = step.apply(wide, params)
    for k in range(N):
        assert torch.equal(step.apply(wide[k : k + 1], params[k : k + 1])[0], got[k])


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="magnitude=31 is not a bin"):
        RandAugment(magnitude=31)
    with pytest.raises(ValueError, match="num_ops=-1"):
        RandAugment(num_ops=-1)
    with pytest.raises(ValueError, match="num_magnitude_bins=1"):
        TrivialAugmentWide(num_magnitude_bins=1)
    with pytest.raises(ValueError, match="policy='mnist'"):
        AutoAugment("mnist")
    with pytest.raises(ValueError, match="interpolation='lanczos'"):
        RandAugment(interpolation="lanczos")
    with pytest.raises(ValueError, match="not 1 or 3 numbers"):
        RandAugment(fill=(1, 2))
    assert RandAugment(interpolation=v2.InterpolationMode.BILINEAR, fill=5).fill == (5.0,) * 3
    assert AutoAugment(v2.AutoAugmentPolicy.SVHN).policy == "svhn"
    assert RandAugment(num_ops=0).apply(
        torch.zeros(2, 3, 4, 4, dtype=torch.uint8), np.zeros((2, 0))
    ).shape == (2, 3, 4, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["rand", "wide", "imagenet"])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_cuda_applies_what_the_cpu_applies(batch, kind, mode):
    """The same code on CUDA: the same pixels, but for float rounding (its own grid and
    blend kernels) on a handful of them."""
    step = _pair(kind, mode, (124, 116, 104))[0]
    params = step.draw(np.random.default_rng(8), N)
    got = step.apply(batch.cuda(), params)
    assert got.is_cuda and got.dtype == torch.uint8
    assert_within_rounding(got, step.apply(batch, params))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warps_on_cuda_ignore_tf32(batch, monkeypatch):
    """timm's train.py allows TF32 matmuls; the warps' grids are made in float64 there, so
    the pixels are those of full float32 precision (TF32 moved samples by ~0.05 pixel:
    up to 190 levels at the fill's edge)."""
    step = RandAugment(2, 9, interpolation="bilinear", fill=(124, 116, 104))
    params = step.draw(np.random.default_rng(8), N)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    exact = step.apply(batch.cuda(), params)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", True)
    assert torch.equal(step.apply(batch.cuda(), params), exact)

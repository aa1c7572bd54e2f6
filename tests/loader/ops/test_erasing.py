"""Batched RandomErasing: each sample's box is filled exactly as torchvision's ``erase``
fills it, the rest left as it was; the boxes drawn as torchvision draws them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as F

from loader.ops.erasing import RandomErasing

N, H, W = 16, 24, 32


@pytest.fixture
def batch() -> torch.Tensor:
    return torch.randn(N, 3, H, W, generator=torch.Generator().manual_seed(0))


def test_a_constant_fill_is_torchvisions_erase(batch):
    erasing = RandomErasing(p=0.7, value=(0.5, -1.0, 2.0))
    boxes = erasing.draw(np.random.default_rng(4), N, (H, W))
    got = erasing.apply(batch, boxes)
    assert 0 < (boxes[:, 2] > 0).sum() < N
    for k, (top, left, h, w) in enumerate(boxes.tolist()):
        value = torch.tensor([0.5, -1.0, 2.0]).view(3, 1, 1)
        want = F.erase(batch[k], top, left, h, w, value) if h else batch[k]
        assert torch.equal(got[k], want)


@pytest.mark.parametrize("fill", ["pixel", "channel"])
def test_noise_fills_only_the_box_and_is_the_seeds(batch, fill):
    erasing = RandomErasing(p=1.0, fill=fill)
    boxes = erasing.draw(np.random.default_rng(5), N, (H, W))
    got = erasing.apply(batch, boxes, seed=9)
    assert torch.equal(got, erasing.apply(batch, boxes, seed=9))
    for k, (top, left, h, w) in enumerate(boxes.tolist()):
        inside = torch.zeros(H, W, dtype=torch.bool)
        inside[top : top + h, left : left + w] = True
        assert torch.equal(got[k][:, ~inside], batch[k][:, ~inside])
        box = got[k][:, inside]
        assert not torch.equal(box, batch[k][:, inside])
        if fill == "channel":  # one value a channel
            assert torch.equal(box, box[:, :1].expand_as(box))

    # The same values filled batch-wise (the GPU path's way) as box by box (the CPU's), a
    # sample's whatever the others; another seed, other values.
    assert torch.equal(erasing.apply(batch, boxes, seed=9, by_box=False), got)
    alone = erasing.apply(batch[3:4], boxes[3:4], seed=9)  # sample 0 of its own batch
    assert not torch.equal(alone[0], got[3])  # the key is the seed's and the row's
    assert not torch.equal(erasing.apply(batch, boxes, seed=10), got)


def test_the_noise_is_standard_normal_and_a_function_of_its_coordinates():
    from loader.ops import noise

    key = torch.from_numpy(noise.keys(123, np.arange(4)))
    ys, xs = torch.arange(200), torch.arange(300)
    values = noise.normal(key, 3, ys, xs, (200, 300))
    assert values.shape == (4, 3, 200, 300) and values.dtype == torch.float32
    flat = values.double().flatten()
    assert abs(flat.mean()) < 0.005 and abs(flat.std() - 1.0) < 0.005  # 720,000 values
    assert abs((flat.abs() < 1.0).double().mean() - 0.6827) < 0.003
    window = noise.normal(key[2:3], 3, ys[50:60], xs[7:9], (200, 300))
    assert torch.equal(window[0], values[2, :, 50:60, 7:9])
    corr = torch.corrcoef(torch.stack([values[0].flatten(), values[1].flatten()]))[0, 1]
    assert abs(corr) < 0.01


def test_boxes_are_drawn_as_torchvision_draws_them():
    # Same distribution: the share of the area, its aspect and its place, over many draws.
    erasing = RandomErasing(p=1.0, scale=(0.02, 0.33), ratio=(0.3, 3.3))
    ours = erasing.draw(np.random.default_rng(0), 4000, (H, W))
    torch.manual_seed(0)
    image = torch.zeros(3, H, W)
    theirs = []
    for _ in range(4000):
        top, left, h, w, _v = T.RandomErasing.get_params(
            image, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=[0.0]
        )
        theirs.append((top, left, h, w) if (h, w) != (H, W) else (0, 0, 0, 0))  # none
    theirs = np.array(theirs)
    area_ours, area_theirs = (a[:, 2] * a[:, 3] / (H * W) for a in (ours, theirs))
    assert abs(area_ours.mean() - area_theirs.mean()) < 0.01
    assert abs((ours[:, 2] == 0).mean() - (theirs[:, 2] == 0).mean()) < 0.02
    assert abs(ours[:, 0].mean() - theirs[:, 0].mean()) < 0.5
    assert abs(ours[:, 1].mean() - theirs[:, 1].mean()) < 0.5


def test_p_zero_leaves_the_batch(batch):
    erasing = RandomErasing(p=0.0)
    assert erasing.apply(batch, erasing.draw(np.random.default_rng(0), N, (H, W))) is batch
    with pytest.raises(ValueError, match="fill='noise' is unknown; known: const, channel, pixel"):
        RandomErasing(fill="noise")

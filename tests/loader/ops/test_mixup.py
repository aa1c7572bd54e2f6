"""Mixup / CutMix with timm's semantics: the blend and the pasted box against the batch
reversed, lambda corrected to the box's area, smoothed one-hot targets mixed alike, and
the draws' choices and distributions."""

from __future__ import annotations

import pytest
import torch

from loader.ops.mixup import Mixup

N, C, H, W = 8, 3, 20, 30


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.rand(N, C, H, W, generator=torch.Generator().manual_seed(0))
    return images, torch.tensor([0, 1, 2, 3, 4, 0, 1, 2])


def test_mixup_blends_with_the_reversed_batch(batch):
    images, labels = batch
    mix = Mixup(mixup_alpha=0.2, cutmix_alpha=0.0, label_smoothing=0.1, num_classes=5, seed=1)
    lam = Mixup(mixup_alpha=0.2, cutmix_alpha=0.0, num_classes=5, seed=1).draw(N)[0][0]
    out, targets = mix(images, labels)
    assert torch.allclose(out, lam * images + (1 - lam) * images.flip(0), atol=1e-6)
    hot = torch.full((N, 5), 0.02)
    hot[torch.arange(N), labels] = 0.92
    assert torch.allclose(targets, lam * hot + (1 - lam) * hot.flip(0), atol=1e-6)
    assert torch.allclose(targets.sum(1), torch.ones(N))


def test_cutmix_pastes_a_box_and_takes_its_area_as_lambda(batch):
    images, labels = batch
    mix = Mixup(mixup_alpha=0.0, cutmix_alpha=1.0, label_smoothing=0.0, num_classes=5, seed=3)
    out, targets = mix(images, labels)
    pasted = (out == images.flip(0)).all(1) & (out != images).any(1)  # [N, H, W]
    area = pasted[0].float().mean().item()
    assert 0 < area < 1 and torch.equal(pasted[0], pasted[-1])  # one box for the batch
    ys, xs = pasted[0].nonzero(as_tuple=True)
    box = torch.zeros(H, W, dtype=torch.bool)
    box[ys.min() : ys.max() + 1, xs.min() : xs.max() + 1] = True
    assert torch.equal(pasted[0], box)  # a rectangle
    lam = 1 - area
    assert targets[0, labels[0]] == pytest.approx(lam) and targets[0, labels[-1]] == pytest.approx(
        1 - lam
    )


def test_elem_mode_draws_each_sample_and_prob_leaves_some_alone(batch):
    images, labels = batch
    mix = Mixup(mixup_alpha=1.0, cutmix_alpha=1.0, prob=0.5, mode="elem", num_classes=5, seed=2)
    lam, cut = mix.draw(4000)
    assert 0.45 < (lam == 1).mean() < 0.55  # not mixed
    mixed = lam < 1
    assert 0.45 < cut[mixed].mean() < 0.55  # switch_prob 0.5
    assert abs(lam[mixed].mean() - 0.5) < 0.02  # Beta(1, 1)
    out, targets = Mixup(mode="elem", num_classes=5, seed=0)(images, labels)
    assert out.shape == images.shape and targets.shape == (N, 5)


def test_the_seed_decides_and_bad_arguments_say_what_to_pass(batch):
    images, labels = batch
    a = Mixup(cutmix_alpha=1.0, num_classes=5, seed=7)
    b = Mixup(cutmix_alpha=1.0, num_classes=5, seed=7)
    for _ in range(3):
        (x, y), (x2, y2) = a(images, labels), b(images, labels)
        assert torch.equal(x, x2) and torch.equal(y, y2)
    with pytest.raises(ValueError, match="mode='pair' is unknown; known: batch, elem"):
        Mixup(mode="pair")
    with pytest.raises(ValueError, match="must be >= 0"):
        Mixup(mixup_alpha=-1)

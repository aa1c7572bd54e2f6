"""timm's recipes: what ``timm.data.create_transform`` makes is read as the loader's own
Transform (crop, flip, its RandAugment / AutoAugment, normalisation, RandomErasing), and
timm's ``train.py`` data code runs on the fast path with its loader swapped for ours."""

from __future__ import annotations

import pytest
import torch
from loader_data import make_store

import loader
from loader.ops.color import ColorJitter
from loader.ops.erasing import RandomErasing
from loader.ops.timm_augment import TimmAutoAugment, TimmRandAugment
from loader.recipes import NotARecipe, recognise

timm_data = pytest.importorskip("timm.data")
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("timm"))


def _create(size=224, **kw):
    return timm_data.create_transform(size, **kw)


def test_the_randaugment_recipe_of_timms_train_py_is_recognised():
    tf = _create(is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25,
                 re_mode="pixel", interpolation="bilinear")  # fmt: skip
    spec = recognise(tf)
    assert (spec.kind, spec.size, spec.flip, spec.scale) == ("train", (224, 224), 0.5, (0.08, 1.0))
    assert spec.mean == pytest.approx(IMAGENET[0]) and spec.std == pytest.approx(IMAGENET[1])
    (step,) = spec.steps
    assert isinstance(step, TimmRandAugment) and step.num_layers == 2 and len(step.ops) == 15
    assert {op.name for op in step.ops} >= {"Rotate", "SolarizeAdd", "TranslateXRel"}
    assert all(op.prob == 0.5 and op.magnitude == 9 and op.magnitude_std == 0.5 for op in step.ops)
    ratio = pytest.approx((0.3, 1 / 0.3))
    assert spec.erasing == RandomErasing(0.25, (0.02, 1 / 3), ratio, "pixel")


def test_timms_default_train_recipe_and_its_auto_augment_policies():
    spec = recognise(_create(is_training=True, interpolation="bilinear"))
    assert spec.steps == (ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), None),)
    assert spec.erasing is None
    assert spec.interpolation == "bilinear"
    randomly = _create(is_training=True, interpolation="random")  # train.py's default
    assert recognise(randomly).interpolation == "random"
    assert recognise(_create(is_training=True, interpolation="bicubic")).interpolation == "bicubic"
    evaluation = recognise(_create(is_training=False, crop_pct=0.95, interpolation="bicubic"))
    assert (evaluation.kind, evaluation.interpolation) == ("eval", "bicubic")
    assert int(224 / evaluation.crop_pct) == int(224 / 0.95)  # timm's Resize(235)
    for policy in ("original", "v0"):
        (step,) = recognise(_create(is_training=True, auto_augment=policy,
                                    interpolation="bilinear")).steps  # fmt: skip
        assert isinstance(step, TimmAutoAugment) and len(step.policy) == 25


@pytest.mark.parametrize(
    "kw, reason",
    [
        ({"auto_augment": "augmix-m5-w4-d2", "interpolation": "bilinear"}, "AugMix"),
        ({"re_prob": 0.25, "re_count": 2, "interpolation": "bilinear"}, "more than one box"),
    ],
    ids=["augmix", "two-boxes"],
)
def test_what_timm_makes_and_the_loader_does_not_run_says_why(kw, reason):
    with pytest.raises(NotARecipe, match=reason):
        recognise(_create(is_training=True, **kw))


def test_timms_crop_on_tensors_antialiases_as_torchs_default():
    import torchvision.transforms as T
    from timm.data.transforms import MaybePILToTensor, RandomResizedCropAndInterpolation

    crop = RandomResizedCropAndInterpolation(224)  # it has no antialias attribute
    tf = T.Compose([MaybePILToTensor(), crop, T.ConvertImageDtype(torch.float32)])
    spec = recognise(tf)
    assert (spec.kind, spec.antialias, spec.size) == ("train", True, (224, 224))


def test_timms_train_py_data_code_takes_the_fast_path(store):
    # train.py: create_loader sets dataset.transform; the swap reads it from there, and the
    # loop probes batch_sampler and sampler for set_epoch, then mixes up on the device.
    tf = _create(32, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25,
                 interpolation="bilinear")  # fmt: skip
    dl = loader.DataLoader(
        loader.LMDBDataset(store, transform=tf), batch_size=8, shuffle=True, num_workers=2,
        drop_last=True, pin_memory=True,
    )  # fmt: skip
    assert isinstance(dl, loader.DataLoader)
    assert not hasattr(dl.batch_sampler, "set_epoch") and hasattr(dl.sampler, "set_epoch")
    mixup = timm_data.Mixup(mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=3)
    seen = 0
    for epoch in range(2):
        dl.sampler.set_epoch(epoch)
        for images, labels in dl:
            assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
            _, targets = mixup(images, labels)
            ones = torch.ones(8, device=targets.device)  # on CUDA where there is one
            assert targets.shape == (8, 3) and torch.allclose(targets.sum(1), ones)
            seen += len(images)
    assert seen == 2 * len(dl) * 8 and len(dl) == len(loader.LMDBDataset(store)) // 8

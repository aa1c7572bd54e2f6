"""loader.recipes: the standard torchvision recipes (v1 and v2) become built-in Transforms, the
loader takes the fast path for them and says which path it took and why."""

from __future__ import annotations

import itertools
import logging
import warnings

import numpy as np
import pytest
import torch
import torch.utils.data
import torchvision.transforms as T
import torchvision.transforms.v2 as V
from loader_data import make_store

import loader
from loader import Transform
from loader.options import RESTARTED_WORKERS
from loader.recipes import NotARecipe, recognise
from loader.recipes.reader import _crop_pct

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
IMAGENET = {"mean": tuple(MEAN), "std": tuple(STD)}
RAW = {"mean": (0.0, 0.0, 0.0), "std": (1.0, 1.0, 1.0)}
F32 = V.ToDtype(torch.float32, scale=True)


def _quietly(make):
    """``make()`` without its warning (torchvision only warns of a reversed range)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return make()


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("recipes"))


@pytest.mark.parametrize(
    "transform, expected",
    [
        (
            T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                       T.Normalize(MEAN, STD)]),
            Transform("train", 224, **IMAGENET),
        ),
        (
            T.Compose([T.Resize(256), T.CenterCrop(224), T.ToTensor(), T.Normalize(MEAN, STD)]),
            Transform("eval", 224, crop_pct=0.875, **IMAGENET),
        ),
        (
            V.Compose([V.RandomHorizontalFlip(0.3), V.RandomResizedCrop(176, scale=(0.35, 1),
                       ratio=(0.5, 2)), V.ToImage(), F32, V.Normalize(MEAN, STD)]),
            Transform("train", 176, scale=(0.35, 1), ratio=(0.5, 2), flip=0.3, **IMAGENET),
        ),
        (  # v2 on tensors: the resize antialiases only if asked
            V.Compose([V.ToImage(), V.RandomResizedCrop((96, 128), antialias=False), F32]),
            Transform("train", (96, 128), flip=0.0, antialias=False, **RAW),
        ),
        (  # on PIL images torchvision always antialiases
            T.Compose([T.RandomResizedCrop(64, antialias=False), T.PILToTensor(),
                       T.ConvertImageDtype(torch.float32)]),
            Transform("train", 64, flip=0.0, **RAW),
        ),
        (
            V.Compose([V.Resize([160]), V.CenterCrop(128), V.ToImage(), F32]),
            Transform("eval", 128, crop_pct=0.8, **RAW),
        ),
        (
            T.Compose([T.Compose([T.Resize(257), T.CenterCrop(224)]), T.ToTensor()]),
            Transform("eval", 224, crop_pct=224 / 257, **RAW),
        ),
        (  # bicubic, v1 and v2, train and eval
            T.Compose([T.RandomResizedCrop(224, interpolation=T.InterpolationMode.BICUBIC),
                       T.ToTensor()]),
            Transform("train", 224, flip=0.0, interpolation="bicubic", **RAW),
        ),
        (
            V.Compose([V.Resize(256, interpolation=V.InterpolationMode.BICUBIC),
                       V.CenterCrop(224), V.ToImage(), F32]),
            Transform("eval", 224, interpolation="bicubic", **RAW),
        ),
    ],
)  # fmt: skip
def test_recognised(transform, expected):
    assert recognise(transform) == expected


def test_eval_resizes_the_short_side_exactly():
    """Transform resizes the short side to int(max(size) / crop_pct): that must be Resize's
    size for every crop and size, also where crop / size does not round-trip in floats."""
    for crop, short in itertools.product(range(1, 300), range(300, 520)):
        assert int(crop / _crop_pct(crop, short)) == short
    assert int(100 / (100 / 127)) == 126  # such a case: the plain ratio would be off by one
    assert recognise(T.Compose([T.Resize(127), T.CenterCrop(100), T.ToTensor()])).crop_pct == (
        _crop_pct(100, 127)
    )


@pytest.mark.parametrize(
    "transform, reason",
    [
        (T.Compose([T.RandomResizedCrop(224), T.RandomRotation(10), T.ToTensor()]),
         "RandomRotation is not a step the loader runs itself"),
        (T.Compose([T.ColorJitter(0.4), T.RandomResizedCrop(224), T.ToTensor()]),
         "ColorJitter comes before the crop (the loader runs it after)"),
        (T.Compose([T.RandomResizedCrop(224), T.ToTensor(), T.ColorJitter(0.4)]),
         "ColorJitter comes after the conversion to float"),
        (T.Compose([T.RandomResizedCrop(224), T.ToTensor(), T.RandomErasing(), T.Normalize(
            (0.5,) * 3, (0.5,) * 3)]), "Normalize comes after RandomErasing"),
        (T.Compose([T.RandomResizedCrop(224), T.RandomErasing(), T.ToTensor()]),
         "RandomErasing comes before the conversion to float"),
        (T.Compose([T.Resize(256, interpolation=T.InterpolationMode.NEAREST), T.CenterCrop(224),
                    T.ToTensor()]), "Resize interpolates with 'nearest', not bilinear or bicubic"),
        (T.Compose([T.Resize((256, 256)), T.CenterCrop(224), T.ToTensor()]),
         r"Resize(size=(256, 256)) is not a resize of the short side"),
        (T.Compose([T.Resize(200), T.CenterCrop(224), T.ToTensor()]),
         "CenterCrop(224, 224) is larger than Resize(200): it pads"),
        (T.Compose([T.CenterCrop(224), T.ToTensor()]),
         "CenterCrop does not directly follow Resize"),
        (T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip()]),
         "it does not end with a float tensor (ToTensor or ToDtype)"),
        # what torchvision takes (or only warns of) and the loader's Transform refuses
        (T.Compose([T.RandomResizedCrop(224, scale=(0.5, 2.0)), T.ToTensor()]),
         "its parameters are not the loader's: scale=(0.5, 2.0) is invalid"),
        (T.Compose([_quietly(lambda: T.RandomResizedCrop(224, ratio=(4 / 3, 3 / 4))),
                    T.ToTensor()]),
         "its parameters are not the loader's: ratio="),
        (T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(1.5), T.ToTensor()]),
         "its parameters are not the loader's: flip=1.5 is invalid"),
        (T.Compose([T.RandomResizedCrop(224), T.ToTensor(), T.Normalize(MEAN, STD),
                    T.RandomHorizontalFlip()]), "RandomHorizontalFlip comes after Normalize"),
        (T.Compose([T.ToTensor(), T.Normalize([0.5], [0.5]), T.RandomResizedCrop(8)]),
         "Normalize has 1 channel(s), not 3"),
        (T.Compose([T.Resize(256), T.CenterCrop(224), T.RandomHorizontalFlip(), T.ToTensor()]),
         "RandomHorizontalFlip with Resize + CenterCrop"),
        (V.Compose([V.ToImage(), V.RandomResizedCrop(8), V.ToDtype(torch.float16, scale=True)]),
         "ToDtype is not ToDtype(torch.float32, scale=True)"),
        (T.Compose([T.ToTensor()]),
         "it has no RandomResizedCrop, nor Resize followed by CenterCrop"),
        (lambda image: image, "function is not a step the loader runs itself"),
        (type("MyCrop", (T.RandomResizedCrop,), {})(224), "MyCrop is not a step the loader runs"),
    ],
)  # fmt: skip
def test_not_recognised_says_why(transform, reason):
    with pytest.raises(NotARecipe) as e:
        recognise(transform)
    assert str(e.value).startswith(reason)


def batches(dl) -> list[torch.Tensor]:
    return [images for images, *_ in dl]


def test_a_recipe_dataset_takes_the_fast_path(store, caplog):
    tf = T.Compose([T.Resize(288), T.CenterCrop(256), T.ToTensor(), T.Normalize(MEAN, STD)])
    ds = loader.LMDBDataset(store, transform=tf)
    with caplog.at_level(logging.INFO, logger="loader.dataloader"):
        dl = loader.DataLoader(ds, batch_size=16, device="cpu")
    assert isinstance(dl, loader.DataLoader) and dl.dataset is ds
    assert dl.transform == Transform("eval", 256, crop_pct=256 / 288, **IMAGENET)
    assert caplog.messages == [
        f"loader.DataLoader: fast path: the LMDBDataset's transform is the recipe {dl.transform}"
    ]
    builtin = loader.DataLoader(store, batch_size=16, transform=dl.transform, device="cpu")
    ours = batches(dl)
    assert all(torch.equal(a, b) for a, b in zip(ours, batches(builtin), strict=True))
    # Against torchvision on the same images (PIL decode and resize): the bound of
    # test_loader_decode's eval test, 0.75 grey levels on average (0.42 measured).
    ref = torch.stack([ds[i][0] for i in range(16)])
    std = torch.tensor(STD).view(1, 3, 1, 1)
    assert ((ours[0] - ref).abs() * std * 255).mean() < 0.75


def test_verbose_says_when_the_workers_start_again_each_epoch(store, capsys):
    fast = "loader.DataLoader: fast path: a store path"
    common = {"batch_size": 4, "transform": "eval", "device": "cpu", "verbose": True}
    loader.DataLoader(store, num_workers=1, **common).close()
    assert capsys.readouterr().err.splitlines() == [fast, RESTARTED_WORKERS]
    for kw in ({"num_workers": 1, "persistent_workers": True}, {"num_workers": 0}):
        loader.DataLoader(store, **common, **kw).close()
        assert capsys.readouterr().err.splitlines() == [fast]
    # num_workers given positionally, on a dataset of the store; torch's loader says nothing
    tf = T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor()])
    loader.DataLoader(loader.LMDBDataset(store, transform=tf), 4, False, None, None, 1,
                      device="cpu", verbose=True).close()  # fmt: skip
    assert capsys.readouterr().err.splitlines()[-1] == RESTARTED_WORKERS
    tf = T.Compose([T.Resize(40), T.CenterCrop(32), T.Grayscale(3), T.ToTensor()])
    dl = loader.DataLoader(loader.LMDBDataset(store, transform=tf), 4, False, None, None, 1,
                           verbose=True)  # fmt: skip
    assert type(dl) is torch.utils.data.DataLoader
    assert RESTARTED_WORKERS not in capsys.readouterr().err


def test_an_unrecognised_transform_gets_torchs_and_says_why(store, caplog, capsys):
    tf = T.Compose([T.Resize(40), T.CenterCrop(32), T.Grayscale(3), T.ToTensor()])
    ds = loader.LMDBDataset(store, transform=tf)
    with caplog.at_level(logging.INFO, logger="loader.dataloader"):
        dl = loader.DataLoader(ds, batch_size=4, verbose=True)
    assert type(dl) is torch.utils.data.DataLoader
    why = (
        "loader.DataLoader: torch DataLoader: the LMDBDataset's transform is not a recognised "
        "recipe: Grayscale is not a step the loader runs itself"
    )
    assert caplog.messages == [why] and capsys.readouterr().err == why + "\n"
    images, _ = next(iter(dl))
    assert images.shape == (4, 3, 32, 32)
    assert np.allclose(images[:, 0].numpy(), images[:, 1].numpy())  # torchvision's grayscale


def test_store_only_arguments_for_an_unrecognised_transform_warn_why(store):
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomRotation(10), T.ToTensor()])
    ds = loader.LMDBDataset(store, transform=tf)
    with pytest.warns(UserWarning) as caught:
        dl = loader.DataLoader(ds, batch_size=4, device="cpu")
    assert type(dl) is torch.utils.data.DataLoader and len(caught) == 1
    assert str(caught[0].message) == (
        "loader.DataLoader: device= ignored: torch's DataLoader reads this dataset (the "
        "LMDBDataset's transform is not a recognised recipe: RandomRotation is not a step the "
        "loader runs itself) and they apply only to the fast path"
    )


def test_the_transform_is_given_once(store):
    tf = T.Compose([T.RandomResizedCrop(64), T.ToTensor()])
    ds = loader.LMDBDataset(store, transform=tf)
    with pytest.raises(
        ValueError, match=r"transform='train' given to a loader.DataLoader over an "
    ):
        loader.DataLoader(ds, batch_size=4, transform="train", device="cpu")


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_colour_steps_and_erasing_are_read_in_order(v2):
    from loader.ops.color import ColorJitter, RandomGrayscale
    from loader.ops.erasing import RandomErasing

    t = V if v2 else T
    head = [t.ToImage()] if v2 else []
    to_float = [t.ToDtype(torch.float32, scale=True)] if v2 else [t.ToTensor()]
    recipe = t.Compose([
        *head, t.RandomResizedCrop(176), t.RandomHorizontalFlip(),
        t.ColorJitter(0.4, 0.3, 0.2, 0.1), t.RandomGrayscale(0.2), *to_float,
        t.Normalize((0.5,) * 3, (0.25,) * 3), t.RandomErasing(0.25, value="random"),
    ])  # fmt: skip
    spec = recognise(recipe)
    assert spec.size == (176, 176) and spec.flip == 0.5
    assert spec.steps == (
        ColorJitter((0.6, 1.4), (0.7, 1.3), (0.8, 1.2), (-0.1, 0.1)),
        RandomGrayscale(0.2),
    )
    assert spec.erasing == RandomErasing(0.25, (0.02, 0.33), (0.3, 3.3), "pixel")
    constant = recognise(
        t.Compose([*head, t.RandomResizedCrop(8), *to_float, t.RandomErasing(value=1)])
    )
    assert constant.erasing.fill == "const" and constant.erasing.value == (1.0, 1.0, 1.0)


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_auto_augment_policies_are_pixel_steps(v2):
    from loader.ops.autoaugment import AutoAugment, RandAugment, TrivialAugmentWide

    t = V if v2 else T
    to_float = [t.ToDtype(torch.float32, scale=True)] if v2 else [t.ToTensor()]
    head = [t.ToImage()] if v2 else []
    bilinear = t.InterpolationMode.BILINEAR
    for step, want in [
        (t.RandAugment(), RandAugment(2, 9, 31, "nearest", None)),
        (t.RandAugment(3, 7, 21, bilinear, [128, 64, 0]),
         RandAugment(3, 7, 21, "bilinear", (128.0, 64.0, 0.0))),
        (t.TrivialAugmentWide(), TrivialAugmentWide(31, "nearest", None)),
        (t.AutoAugment(), AutoAugment("imagenet", "nearest", None)),
    ]:  # fmt: skip
        spec = recognise(t.Compose([*head, t.RandomResizedCrop(64), step, *to_float]))
        assert spec.steps == (want,), step
    with pytest.raises(NotARecipe, match="RandAugment comes before the crop"):
        recognise(t.Compose([*head, t.RandAugment(), t.RandomResizedCrop(64), *to_float]))


def test_a_randaugment_recipe_runs_on_the_cpu_path(store):
    tf = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.RandAugment(),
                    T.ToTensor(), T.Normalize(MEAN, STD)])  # fmt: skip
    dl = loader.DataLoader(loader.LMDBDataset(store, transform=tf), batch_size=8, seed=3)
    assert isinstance(dl, loader.DataLoader)
    first = [b[0] for b in dl]
    again = [b[0] for b in loader.DataLoader(loader.LMDBDataset(store, transform=tf),
                                             batch_size=8, seed=3)]  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    plain = T.Compose([T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor(),
                       T.Normalize(MEAN, STD)])  # fmt: skip
    base = [b[0] for b in loader.DataLoader(loader.LMDBDataset(store, transform=plain),
                                            batch_size=8, seed=3)]  # fmt: skip
    changed = torch.cat([(a != b).flatten(1).any(1) for a, b in zip(first, base, strict=True)])
    assert 0.5 < changed.float().mean() <= 1.0  # two ops an image; identity sometimes

"""Built-in transforms: crop parameters distributed as torchvision's, eval pixels as its."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchvision.transforms as T

from loader.augment import Transform, plan_crops, random_resized_windows, resolve_transform

N = 20_000
# Two-sample Kolmogorov-Smirnov critical value for n = m = 20000 at alpha = 0.001:
# c(alpha) * sqrt(2 / n) with c = sqrt(-ln(alpha / 2) / 2) = 1.949. A correct sampler stays
# below it with probability 0.999; the seeds are fixed, so the outcome is too.
KS_CRITICAL = 1.949 * np.sqrt(2 / N)
# (height, width) of the images tried: landscape, portrait, square, and one so elongated that
# most of torchvision's ten attempts miss and its central-crop fallback is taken.
SIZES = [(375, 500), (500, 333), (224, 224), (40, 400)]


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    """Largest distance between the empirical CDFs of ``a`` and ``b`` (exact with ties)."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    cdf_a = np.searchsorted(a, grid, side="right") / len(a)
    cdf_b = np.searchsorted(b, grid, side="right") / len(b)
    return float(np.abs(cdf_a - cdf_b).max())


def features(windows: np.ndarray, h: int, w: int) -> dict[str, np.ndarray]:
    """What the distributions are compared on: crop area, aspect, size and centre position."""
    y, x, ch, cw = windows.T.astype(np.float64)
    return {
        "area fraction": ch * cw / (h * w),
        "log aspect": np.log(cw / ch),
        "height": ch,
        "width": cw,
        "centre y": (y + ch / 2) / h,
        "centre x": (x + cw / 2) / w,
    }


def torchvision_windows(h: int, w: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)) -> np.ndarray:
    torch.manual_seed(1234)
    img = torch.empty(1, h, w)
    return np.array(
        [T.RandomResizedCrop.get_params(img, list(scale), list(ratio)) for _ in range(N)]
    )


def ours(h: int, w: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), seed: int = 99) -> np.ndarray:
    hs, ws = np.full(N, h), np.full(N, w)
    return random_resized_windows(hs, ws, scale, ratio, np.random.default_rng(seed))


def worst_ks(a: np.ndarray, b: np.ndarray, h: int, w: int) -> tuple[str, float]:
    fa, fb = features(a, h, w), features(b, h, w)
    return max(((k, ks_statistic(fa[k], fb[k])) for k in fa), key=lambda kv: kv[1])


@pytest.fixture(scope="module")
def reference() -> dict:
    return {size: torchvision_windows(*size) for size in SIZES}


@pytest.mark.parametrize("size", SIZES)
def test_train_crops_distributed_as_torchvision(reference, size):
    h, w = size
    mine = ours(h, w)
    assert (mine[:, 0] >= 0).all() and (mine[:, 0] + mine[:, 2] <= h).all()
    assert (mine[:, 1] >= 0).all() and (mine[:, 1] + mine[:, 3] <= w).all()
    name, d = worst_ks(mine, reference[size], h, w)
    assert d < KS_CRITICAL, f"{name}: KS distance {d:.4f} >= {KS_CRITICAL:.4f}"
    # Moments too: the mean crop area agrees within 1% of the image.
    fa, fb = features(mine, h, w), features(reference[size], h, w)
    assert abs(fa["area fraction"].mean() - fb["area fraction"].mean()) < 0.01


def test_fallback_taken_as_often_as_torchvision(reference):
    h, w = 40, 400  # torchvision's fallback is the centred 40x53 crop
    fallback = np.array([(40 - 40) // 2, (400 - 53) // 2, 40, 53])
    share = [np.mean((win == fallback).all(axis=1)) for win in (ours(h, w), reference[(h, w)])]
    assert share[1] > 0.3  # the case does exercise the fallback
    assert abs(share[0] - share[1]) < 4 * np.sqrt(0.25 / N)


@pytest.mark.parametrize(
    "wrong",
    [
        {"scale": (0.10, 1.0)},  # a slightly different scale range
        {"ratio": (0.7, 1.4)},  # a slightly different aspect range
        {"uniform_ratio": True},  # aspect drawn uniformly instead of log-uniformly
    ],
)
def test_the_check_rejects_a_wrong_sampler(reference, wrong):
    """The tolerance above is tight enough to catch small mistakes (it cannot pass by luck)."""
    h, w = SIZES[0]
    if wrong.get("uniform_ratio"):
        rng = np.random.default_rng(5)
        area = h * w * rng.uniform(0.08, 1.0, N)
        aspect = rng.uniform(3 / 4, 4 / 3, N)
        cw = np.minimum(np.round(np.sqrt(area * aspect)), w).astype(int)
        ch = np.minimum(np.round(np.sqrt(area / aspect)), h).astype(int)
        bad = np.stack([rng.integers(0, h - ch + 1), rng.integers(0, w - cw + 1), ch, cw], 1)
    else:
        bad = ours(h, w, **{"scale": (0.08, 1.0), "ratio": (3 / 4, 4 / 3), **wrong})
    _, d = worst_ks(bad, reference[SIZES[0]], h, w)
    assert d > KS_CRITICAL


def test_flip_probability():
    rng = np.random.default_rng(0)
    crops = plan_crops(Transform("train"), np.full(N, 300), np.full(N, 400), rng)
    assert abs(crops[:, 8].mean() - 0.5) < 4 * np.sqrt(0.25 / N)
    no_flip = plan_crops(Transform("train", flip=0.0), np.full(100, 300), np.full(100, 400), rng)
    assert not no_flip[:, 8].any()


@pytest.mark.parametrize("h, w", [(375, 500), (500, 375), (300, 300), (257, 1000), (999, 256)])
def test_eval_geometry_matches_torchvision(h, w):
    """Resize(256) + CenterCrop(224) sizes and offsets, with torchvision's rounding."""
    crop = plan_crops(Transform("eval"), np.array([h]), np.array([w]), None)[0]
    img = torch.zeros(1, h, w)
    resized = T.Resize(256)(img)
    rh, rw = resized.shape[1:]
    assert (crop[0], crop[1], crop[2], crop[3]) == (0, 0, h, w)
    assert (crop[4], crop[5]) == (rh, rw)
    assert (crop[6], crop[7]) == (round((rh - 224) / 2.0), round((rw - 224) / 2.0))


def test_resolve_transform():
    assert resolve_transform("train", 160).size == (160, 160)
    assert resolve_transform("eval", (128, 192), mean=(0, 0, 0)).mean == (0.0, 0.0, 0.0)
    spec = Transform("train", 176, scale=(0.35, 1), flip=0.0)
    assert resolve_transform(spec) is spec


@pytest.mark.parametrize(
    "args, match",
    [
        (
            ("random",),
            r"transform='random' is not a built-in transform; use one of 'train', 'eval'",
        ),
        ((None,), r"transform= is required"),
        ((T.ToTensor(),), r"a torchvision transform goes on loader.LMDBDataset"),
        ((Transform("eval"), 128), r"image_size cannot be combined with a Transform"),
        (("train", 0), r"image_size=0 is invalid"),
        (("train", None, None, (0.2, 0.2, 0.0)), r"std must be > 0"),
    ],
)
def test_transform_errors(args, match):
    with pytest.raises(ValueError, match=match):
        resolve_transform(*args)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": (0.5, 0.1)}, r"scale=\(0.5, 0.1\) is invalid"),
        ({"ratio": (0, 1)}, r"ratio=\(0, 1\) is invalid"),
        ({"flip": 2}, r"flip=2 is invalid"),
        ({"crop_pct": 0}, r"crop_pct=0 is invalid"),
        ({"interpolation": "nearest"}, r"interpolation='nearest' is invalid: pass 'bilinear',"),
    ],
)
def test_transform_field_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Transform("train", **kwargs)


def test_interpolation_is_bilinear_unless_asked():
    assert Transform("train").interpolation == Transform("eval").interpolation == "bilinear"
    assert Transform("eval", interpolation="bicubic").interpolation == "bicubic"
    with pytest.raises(ValueError, match="interpolation='random' is for kind='train'"):
        Transform("eval", interpolation="random")


def test_the_crop_rows_say_which_filter():
    """CUBIC is the transform's, or for "random" drawn per image after the other draws
    (so a transform's windows and flips are the same whatever its interpolation)."""
    h, w = np.full(2000, 300), np.full(2000, 400)
    rows = {
        mode: plan_crops(Transform("train", interpolation=mode), h, w, np.random.default_rng(5))
        for mode in ("bilinear", "bicubic", "random")
    }
    assert (rows["bilinear"][:, 9] == 0).all() and (rows["bicubic"][:, 9] == 1).all()
    assert 0.45 < rows["random"][:, 9].mean() < 0.55
    assert all((r[:, :9] == rows["bilinear"][:, :9]).all() for r in rows.values())
    again = plan_crops(Transform("train", interpolation="random"), h, w, np.random.default_rng(5))
    assert (again == rows["random"]).all()
    evaluation = plan_crops(Transform("eval", interpolation="bicubic"), h[:3], w[:3], None)
    assert (evaluation[:, 9] == 1).all()

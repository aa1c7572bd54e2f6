"""timm's RandAugment and AutoAugment, batched: the steps its config strings build (and
``from_timm`` reads) are timm's ops; each op against timm's own PIL op with the same
argument: the tone ops and nearest shears and translations exact, nearest rotation on
under 0.1% of the pixels (PIL's fixed-point rotation), bilinear within 1 level on under
0.5%, bicubic (torch's a = -0.75 against PIL's a = -1) within 20 levels, mean under 1.
Then the level functions, the draws (probability, magnitude noise, signs, interpolation,
weighted choice), the seed, one image at a time.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from loader_data import assert_within_rounding, photo_batch
from PIL import Image

aa = pytest.importorskip("timm.data.auto_augment")

from loader.ops import timm_ops  # noqa: E402
from loader.ops.timm_augment import (  # noqa: E402
    TimmRandAugment,
    auto_augment,
    from_timm,
    rand_augment,
)
from loader.ops.timm_ops import TimmOp  # noqa: E402

N, SIZE = 12, 48
FILL = (124, 116, 104)
MODES = ("nearest", "bilinear", "bicubic")
PIL_MODES = {"nearest": Image.NEAREST, "bilinear": Image.BILINEAR, "bicubic": Image.BICUBIC}
HPARAMS = {"translate_const": 100, "img_mean": FILL}


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return photo_batch(N, SIZE)


def _pil(x: torch.Tensor) -> Image.Image:
    return Image.fromarray(x.permute(1, 2, 0).numpy())


def _tensor(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.array(image)).permute(2, 0, 1)


def _diff(got: torch.Tensor, want: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([(g.int() - w.int()).abs() for g, w in zip(got, want, strict=True)])


GEOMETRIC = {  # op -> (timm's function, argument range)
    "Rotate": (aa.rotate, 30.0),
    "ShearX": (aa.shear_x, 0.3),
    "ShearY": (aa.shear_y, 0.3),
    "TranslateX": (aa.translate_x_abs, 20.0),
    "TranslateY": (aa.translate_y_abs, 20.0),
    "TranslateXRel": (aa.translate_x_rel, 0.45),
    "TranslateYRel": (aa.translate_y_rel, 0.45),
}
BOUNDS = {"nearest": (0, 0.0), "bilinear": (1, 0.005), "bicubic": (20, 1.0)}  # max, mean


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(GEOMETRIC))
def test_each_warp_is_timms_pil_op(batch, name, mode):
    fn, span = GEOMETRIC[name]
    arg = np.random.default_rng(0).uniform(-span, span, N)
    got = timm_ops.run(batch, name, arg, np.full(N, MODES.index(mode)), MODES, FILL)
    kwargs = {"fillcolor": FILL, "resample": PIL_MODES[mode]}
    diff = _diff(got, [_tensor(fn(_pil(batch[k]), float(arg[k]), **kwargs)) for k in range(N)])
    top, mean = BOUNDS[mode]
    if name == "Rotate" and mode == "nearest":  # PIL's 16.16 fixed point: rare other picks
        assert (diff > 0).float().mean() < 1e-3
    else:
        assert diff.max() <= top and diff.float().mean() <= mean, (diff.max(), diff.float().mean())
    if mode == "bilinear":
        assert (diff > 0).float().mean() < 0.005


TONE = {  # op -> (timm's function, argument range or None, integer argument)
    "Color": (aa.color, (0.1, 1.9), False),
    "Contrast": (aa.contrast, (0.1, 1.9), False),
    "Brightness": (aa.brightness, (0.1, 1.9), False),
    "Sharpness": (aa.sharpness, (0.1, 1.9), False),
    "Posterize": (aa.posterize, (1, 8), True),  # Pillow 13 refuses 0 bits (ours: black)
    "Solarize": (aa.solarize, (0, 256), True),
    "SolarizeAdd": (aa.solarize_add, (0, 110), True),
    "AutoContrast": (aa.auto_contrast, None, False),
    "Equalize": (aa.equalize, None, False),
    "Invert": (aa.invert, None, False),
    "Desaturate": (aa.desaturate, (0.5, 1.0), False),
}


@pytest.mark.parametrize("name", list(TONE))
def test_each_tone_op_is_timms_pil_op(batch, name):
    fn, span, integer = TONE[name]
    rng = np.random.default_rng(1)
    if span is None:
        arg = np.full(N, np.nan)
    else:
        arg = rng.integers(span[0], span[1] + 1, N) if integer else rng.uniform(*span, N)
    got = timm_ops.run(batch, name, arg.astype(np.float64), np.zeros(N), MODES, FILL)

    def want(k):
        args = () if span is None else (int(arg[k]) if integer else float(arg[k]),)
        return _tensor(fn(_pil(batch[k]), *args))

    assert _diff(got, [want(k) for k in range(N)]).max() == 0


@pytest.mark.parametrize("name", list(aa.LEVEL_TO_ARG))
def test_the_levels_are_timms(name, monkeypatch):
    if name not in timm_ops.LEVELS:
        pytest.skip(f"{name} is not supported")
    op = TimmOp(name, translate_const=123, translate_pct=0.3)
    hparams = {"translate_const": 123, "translate_pct": 0.3}
    levels = np.array([0.0, 0.7, 2.5, 5.0, 9.0, 9.99, 10.0, 13.0])
    for negate in (False, True):
        monkeypatch.setattr(random, "random", lambda n=negate: 0.9 if n else 0.1)
        fn = aa.LEVEL_TO_ARG[name]
        want = [fn(level, hparams)[0] if fn else np.nan for level in levels]
        got = op.arguments(levels, np.full(len(levels), negate))
        assert np.array_equal(got, np.array(want, dtype=np.float64), equal_nan=True), name


CONFIGS = [
    "rand-m9-mstd0.5-inc1",
    "rand-m9-mstd0.5",
    "rand-m7-n3-p0.8-mmax15",
    "rand-m10-mstd101-inc1",
    "rand-m6-tweights-n4",
]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("hparams", [None, HPARAMS, {**HPARAMS, "interpolation": 3}])
def test_a_config_builds_timms_rand_augment(config, hparams):
    ours = rand_augment(config, hparams)
    assert from_timm(aa.rand_augment_transform(config, dict(hparams or {}) or None)) == ours
    if hparams and "interpolation" in hparams:
        assert ours.interpolation == ("bicubic",)


@pytest.mark.parametrize("policy", ["original", "originalr", "v0", "v0r-mstd1"])
def test_a_config_builds_timms_auto_augment(policy):
    ours = auto_augment(policy, HPARAMS)
    assert from_timm(aa.auto_augment_transform(policy, dict(HPARAMS))) == ours
    assert ours.fill == FILL and ours.interpolation == ("bilinear", "bicubic")


def test_what_it_cannot_express_is_refused():
    with pytest.raises(ValueError, match="AugMix"):
        from_timm(aa.augment_and_mix_transform("augmix-m5", dict(HPARAMS)))
    with pytest.raises(ValueError, match="'GaussianBlur' is not one the loader runs"):
        from_timm(aa.rand_augment_transform("rand-t3a", dict(HPARAMS)))
    with pytest.raises(ValueError, match="GaussianBlur"):
        rand_augment("rand-t3a")
    with pytest.raises(ValueError, match="is not timm's RandAugment"):
        from_timm(object())
    with pytest.raises(ValueError, match="unknown section"):
        rand_augment("rand-m9-x3")
    with pytest.raises(ValueError, match="policy '3a'"):
        auto_augment("3a")
    with pytest.raises(ValueError, match="interpolation"):
        rand_augment("rand-m9", {**HPARAMS, "interpolation": Image.LANCZOS})


def test_the_draws_follow_timms_probability_noise_and_signs():
    ops = (TimmOp("Rotate", 0.5, 9, 0.5),)
    params = TimmRandAugment(ops, num_layers=2).draw(np.random.default_rng(0), 40000)
    taken = params[:, 0::3] >= 0
    assert abs(taken.mean() - 0.5) < 0.01
    angle = params[:, 1::3]
    level = np.abs(angle) / 3.0  # Rotate: 30 degrees at level 10
    assert level.max() <= 10.0 and abs(level.mean() - 9.0) < 0.02
    assert 0.45 < level.std() < 0.52  # a normal of std 0.5, clipped at 10
    assert abs((angle < 0).mean() - 0.5) < 0.01
    assert abs(params[:, 2::3].mean() - 0.5) < 0.01  # bilinear or bicubic
    uniform = TimmRandAugment((TimmOp("Rotate", 1.0, 9, float("inf")),), 1)
    level = np.abs(uniform.draw(np.random.default_rng(1), 40000)[:, 1]) / 3.0
    assert (uniform.draw(np.random.default_rng(1), 40000)[:, 0] == 0).all()
    assert level.max() < 9.0 and abs(level.mean() - 4.5) < 0.05 and level.std() > 2.5


def test_a_weighted_choice_is_without_replacement_as_timms():
    step = rand_augment("rand-m9-tweights-n3")
    params = step.draw(np.random.default_rng(2), 30000)
    ops = np.where(params[:, 0::3] >= 0, params[:, 0::3], np.nan)
    weights = np.array(step.weights)
    rng = np.random.default_rng(3)
    numpy = np.array([rng.choice(len(weights), 3, replace=False, p=weights) for _ in range(30000)])
    for layer in range(3):  # timm's draw without replacement by numpy, layer by layer
        want = np.bincount(numpy[:, layer], minlength=len(weights)) / 30000
        picked = ops[:, layer][~np.isnan(ops[:, layer])].astype(int)
        got = np.bincount(picked, minlength=len(weights)) / len(picked)
        assert np.abs(got - want).max() < 0.015
    rows = np.sort(np.nan_to_num(ops, nan=-1), 1)
    assert not ((rows[:, 1:] == rows[:, :-1]) & (rows[:, 1:] >= 0)).any()  # never twice


def test_an_applied_sample_is_timms_ops_in_its_order(batch):
    step = auto_augment("v0", {**HPARAMS, "interpolation": Image.BILINEAR})
    params = step.draw(np.random.default_rng(4), N)
    got = step.apply(batch, params)
    flat = [op for sub in step.policy for op in sub]
    for k in range(N):
        image = _pil(batch[k])
        for code, arg, _ in params[k, :6].reshape(2, 3):
            if code < 0:
                continue
            op = flat[int(code)]
            fn = aa.NAME_TO_OP[op.name]
            args = () if np.isnan(arg) else (int(arg) if "olarize" in op.name else arg,)
            args = (int(arg),) if "Posterize" in op.name else args
            image = fn(image, *args, fillcolor=FILL, resample=Image.BILINEAR)
        diff = (got[k].int() - _tensor(image).int()).abs()
        assert diff.max() <= 1 and (diff > 0).float().mean() < 0.005, (k, params[k])


@pytest.mark.parametrize(
    "config", ["rand-m9-mstd0.5-inc1", "rand-m15-mmax20-n4", "rand-m0-n4", "original", "v0"]
)
def test_a_batch_is_its_images_one_by_one(batch, config):
    """A batch runs its warps together and its LUT ops together (``warps``, ``lookups``);
    one image runs op by op: the same pixels (m0: rotations by exactly 0 degrees)."""
    build = rand_augment if config.startswith("rand") else auto_augment
    step = build(config, HPARAMS)
    params = step.draw(np.random.default_rng(5), N)
    assert np.array_equal(params, step.draw(np.random.default_rng(5), N), equal_nan=True)
    got = step.apply(batch, params)
    assert torch.equal(step.apply(batch.contiguous(memory_format=torch.channels_last), params), got)
    for k in range(N):
        hwc = batch[k].permute(1, 2, 0).contiguous()
        assert torch.equal(step.apply(hwc.permute(2, 0, 1)[None], params[k : k + 1])[0], got[k])
    wide = batch[:, :, :40, :]  # not square: only half turns are transposes
    got = step.apply(wide, params)
    for k in range(N):
        assert torch.equal(step.apply(wide[k : k + 1], params[k : k + 1])[0], got[k])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("config", ["rand-m9-mstd0.5-inc1", "original", "v0"])
def test_cuda_applies_what_the_cpu_applies(batch, config):
    """The same code on CUDA: the same pixels but for float rounding on a handful."""
    build = rand_augment if config.startswith("rand") else auto_augment
    step = build(config, HPARAMS)
    params = step.draw(np.random.default_rng(9), N)
    got = step.apply(batch.cuda(), params)
    assert got.is_cuda and got.dtype == torch.uint8
    assert_within_rounding(got, step.apply(batch, params))

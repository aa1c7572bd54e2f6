"""The GPU path's last launch (``loader.gpu.normalise``): a recipe's uint8 batch normalised,
cast, erased and laid out as the torch ops it replaces make it (``addcmul``, the cast,
``RandomErasing.apply`` on the whole batch, ``contiguous``): the same values exactly, in
float16 and float32; in bfloat16 exactly on CUDA, and within one bfloat16 unit under
Triton's interpreter, whose cast truncates where CUDA's rounds to nearest. Without CUDA the
interpreter runs the kernel on small batches; the launches are compiled for sm_90 too.
"""

from __future__ import annotations

import gpu_path_data  # noqa: F401  (before Triton: its interpreter where there is no CUDA)
import numpy as np
import pytest
import torch
from gpu_path_data import CUDA, DEVICE
from loader_data import photo_batch
from triton_compile import assert_compiles_for_hopper

from loader.augment import Transform
from loader.gpu import normalise, steps
from loader.ops.draws import draw
from loader.ops.erasing import RandomErasing

N, H, W = (64, 224, 200) if CUDA else (6, 20, 24)
MEAN, STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
FORMATS = [torch.channels_last, torch.contiguous_format]


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    # several tiles a sample under the interpreter too, some of them outside its box
    if not CUDA:
        monkeypatch.setattr(normalise, "_BLOCK", 128)


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    return photo_batch(N, max(H, W))[:, :, :H, :W].contiguous().to(DEVICE)


def _affine():
    scale = torch.tensor((1.0 / (255.0 * STD)).tolist(), device=DEVICE).view(1, 3, 1, 1)
    bias = torch.tensor((-MEAN / STD).tolist(), device=DEVICE).view(1, 3, 1, 1)
    return scale, bias


def _torch_ops(x, dtype, fmt, erasing, boxes, seed):
    """What ``BatchSteps`` did before the kernel, op by op."""
    scale, bias = _affine()
    x = torch.addcmul(bias, x.float(), scale).to(dtype)
    if erasing is not None:
        x = erasing.apply(x, boxes, seed=seed, by_box=False)
    return x.contiguous(memory_format=fmt)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.stride() == want.stride()
    if want.dtype == torch.bfloat16 and not CUDA:  # the interpreter truncates the cast
        unit = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)
        assert ((got.float() - want.float()).abs() <= unit).all()
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("fill", ["const", "channel", "pixel"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=["channels_last", "contiguous"])
def test_the_kernel_gives_the_torch_ops_values(batch, fill, dtype, fmt):
    erasing = RandomErasing(0.7, fill=fill, value=(0.1, -0.7, 0.3))
    boxes = erasing.draw(np.random.default_rng(3), N, (H, W))
    assert 0 < np.count_nonzero(boxes[:, 2]) < N  # some samples erased, some not
    table = normalise.levels(*_affine())
    got = normalise.normalise_erase(batch, table, dtype, fmt, erasing, boxes, seed=99)
    want = _torch_ops(batch, dtype, fmt, erasing, boxes, 99)
    _same(got, want)
    erased = (got.float() - _torch_ops(batch, dtype, fmt, None, boxes, 0).float()).abs() > 0
    assert erased.any()  # the boxes were filled


def test_without_boxes_or_erasing_only_normalised(batch):
    table = normalise.levels(*_affine())
    none = np.zeros((N, 4), dtype=np.int64)
    want = _torch_ops(batch, torch.float16, torch.channels_last, None, none, 0)
    for erasing in (None, RandomErasing(0.5, fill="pixel")):
        got = normalise.normalise_erase(
            batch, table, torch.float16, torch.channels_last, erasing, none, seed=1
        )
        _same(got, want)


def test_a_channels_last_input_gives_the_same_values(batch):
    erasing = RandomErasing(0.5, fill="pixel")
    boxes = erasing.draw(np.random.default_rng(4), N, (H, W))
    assert boxes[:, 2].any()
    table = normalise.levels(*_affine())
    args = (table, torch.float16, torch.channels_last, erasing, boxes, 5)
    nhwc = batch.contiguous(memory_format=torch.channels_last)
    _same(normalise.normalise_erase(nhwc, *args), normalise.normalise_erase(batch, *args))


def test_batch_steps_end_in_the_kernel_with_their_draws(batch):
    # timm's erasing (pixel noise) after a colour step, from the batch seed's draws.
    from loader.ops.color import ColorJitter

    spec = Transform(
        "train", (H, W), steps=(ColorJitter((0.6, 1.4), None, None, None),),
        erasing=RandomErasing(0.5, fill="pixel"),
    )  # fmt: skip
    draws = draw(spec, 21, N)
    assert draws.boxes[:, 2].any()
    stepped = spec.steps[0].apply(batch, draws.params[0])
    want = _torch_ops(stepped, torch.float16, torch.channels_last, spec.erasing, draws.boxes,
                      draws.noise)  # fmt: skip
    fused = steps.BatchSteps(spec, torch.float16, torch.channels_last)
    fused.fused = True  # as on CUDA, where it always is
    _same(fused(batch, 21), want)
    if not CUDA:  # and the torch ops where it is not
        _same(steps.BatchSteps(spec, torch.float16, torch.channels_last)(batch, 21), want)


def test_the_kernel_compiles_for_hopper(tmp_path):
    """The interpreter runs code a compiler refuses: each fill and output dtype, with
    contiguous and channels-last strides, compiled here for sm_90 as on the GPU machine."""
    from loader.gpu import erase_kernels as k

    names = k.normalise_erase.arg_names
    launches = []
    for out in ("*fp16", "*fp32", "*bf16"):
        for fill in range(4):
            # the strides of 1 (Triton makes a 1 a constant), input and output: contiguous
            # to contiguous, contiguous to channels-last, channels-last to channels-last
            for ones in ("s_w", "d_w"), ("s_w", "d_c"), ("s_c", "d_c"):
                sig = dict.fromkeys(names, "i32")
                sig.update(src="*u8", dst=out, levels="*fp32", boxes="*i64")
                sig.update(fill0="fp32", fill1="fp32", fill2="fp32")
                consts = {"FILL": fill, "BLOCK": 1024, **dict.fromkeys(ones, 1)}
                sig.update(dict.fromkeys(consts, "constexpr"))
                launches.append(("normalise_erase", sig, consts))
    assert_compiles_for_hopper("loader.gpu.erase_kernels", launches, tmp_path)

"""The GPU path's fused auto-augmentation layers (``loader.gpu.fused_layers``) against the
torch ops they stand for (``loader.ops.timm_augment``: the CPU path's, checked against
timm's PIL ops in tests/loader/ops): the same draws, the same pixels but for the rounding
of a fused multiply-add, at most 1 level on at most 0.01% of a batch's pixels, the
channels-last input and the exact quarter turns exact. Without CUDA, Triton's interpreter
runs the kernels on small batches.
"""

from __future__ import annotations

import dataclasses

import gpu_path_data  # noqa: F401  (before Triton: its interpreter where there is no CUDA)
import numpy as np
import pytest
import torch
from gpu_path_data import CUDA, DEVICE
from loader_data import assert_within_rounding, photo_batch
from triton_compile import assert_compiles_for_hopper

from loader.gpu import fused_layers, steps
from loader.ops.color import ColorJitter
from loader.ops.timm_augment import auto_augment, rand_augment

N, H, W = (64, 224, 200) if CUDA else (16, 36, 40)
HPARAMS = {"translate_const": 10 if not CUDA else 100, "img_mean": (124, 116, 104)}
SPECS = [
    ("rand", "rand-m9-mstd0.5-inc1"),  # timm's ResNet strikes back, DeiT
    ("rand", "rand-m15-n3-mstd101"),  # uniform magnitudes: every level, larger warps
    ("rand", "rand-m0-n2"),  # level 0: rotations of 0 degrees (the exact-turn path)
    ("auto", "original"),
    ("auto", "v0r"),
]


@pytest.fixture(scope="module")
def batch() -> torch.Tensor:
    square = photo_batch(N, max(H, W) + 4)
    return square[:, :, 2 : 2 + H, 1 : 1 + W].contiguous().to(DEVICE)


def _step(kind: str, spec: str):
    return (rand_augment if kind == "rand" else auto_augment)(spec, HPARAMS)


def _within_rounding(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == torch.uint8
    assert_within_rounding(got, want, share=1e-4)


@pytest.mark.parametrize("kind,spec", SPECS)
@pytest.mark.parametrize("seed", [0, 1])
def test_a_fused_layer_gives_the_torch_ops_pixels(batch, kind, spec, seed):
    step = _step(kind, spec)
    params = step.draw(np.random.default_rng(seed), len(batch))
    _within_rounding(fused_layers.apply(step, batch, params), step.apply(batch, params))


def test_channels_last_input_gives_the_same_pixels(batch):
    step = _step("rand", "rand-m9-mstd0.5-inc1")
    params = step.draw(np.random.default_rng(7), len(batch))
    want = fused_layers.apply(step, batch, params)
    got = fused_layers.apply(step, batch.contiguous(memory_format=torch.channels_last), params)
    assert torch.equal(got, want)


def test_exact_turns_are_transpositions(batch):
    square = batch[:, :, :32, :32].contiguous()
    n = len(square)
    names = np.array(["Rotate"] * n)
    for k, angle in ((1, 90.0), (2, 180.0), (3, 270.0), (0, 360.0)):
        table, host = fused_layers.layer_table(names, names, np.full(n, angle), np.zeros(n), 32, 32)
        got = fused_layers.run_layer(square, table, host, (1, 2, 3))
        assert torch.equal(got, torch.rot90(square, k, (-2, -1))), angle
    table, host = fused_layers.layer_table(names, names, np.full(n, 180.0), np.zeros(n), H, W)
    assert torch.equal(fused_layers.run_layer(batch, table, host, (1, 2, 3)), batch.flip(-1, -2))


def test_only_timms_policies_on_uint8_rgb_batches_are_fused(batch):
    step = _step("rand", "rand-m9-mstd0.5-inc1")
    assert fused_layers.fusable(step) and fused_layers.takes(batch)
    assert not fused_layers.takes(batch.float())
    assert not fused_layers.takes(batch[:, :1])
    assert not fused_layers.fusable(ColorJitter((0.6, 1.4), None, None, None))


def test_every_interpolation_tiny_images_and_strided_inputs(batch):
    step = dataclasses.replace(
        _step("rand", "rand-m15-n3-mstd101"), interpolation=("nearest", "bilinear", "bicubic")
    )
    for x in (batch[:, :, :2, :7], batch[:, :, :5, :1], batch[:, :, :1, :1], batch[:, :, 3:, 5:]):
        params = step.draw(np.random.default_rng(3), len(x))
        _within_rounding(fused_layers.apply(step, x, params), step.apply(x.contiguous(), params))
    wide = torch.zeros((N, 3, H, 2 * W), dtype=torch.uint8, device=DEVICE)
    wide[..., ::2] = batch  # every other column: a stride of 2
    params = step.draw(np.random.default_rng(4), N)
    _within_rounding(fused_layers.apply(step, wide[..., ::2], params), step.apply(batch, params))


def test_a_fill_out_of_range_is_rounded_and_clamped_as_the_torch_ops(batch):
    step = dataclasses.replace(_step("rand", "rand-m15-n3-mstd101"), fill=(300, -5, 128))
    params = step.draw(np.random.default_rng(5), len(batch))
    _within_rounding(fused_layers.apply(step, batch, params), step.apply(batch, params))


def test_an_op_the_kernels_do_not_know_is_refused():
    names = np.array(["Rotate", "Blur"])
    with pytest.raises(ValueError, match="Blur"):
        fused_layers.layer_table(names, names, np.zeros(2), np.zeros(2), 8, 8)


def test_the_tables_layout_is_the_kernels(batch):
    from loader.gpu import layer_kernels as k

    assert k.COLS.value == fused_layers.COLS
    kinds = (k.COPY, k.LUT, k.COLOR, k.SHARP, k.WARP, k.TURN)
    assert [v.value for v in kinds] == [fused_layers._COPY, fused_layers._LUT,
                                        fused_layers._COLOR, fused_layers._SHARP,
                                        fused_layers._WARP, fused_layers._TURN]  # fmt: skip
    assert {n: getattr(k, n.upper()).value for n in fused_layers._STATS} == fused_layers._STATS


@pytest.mark.skipif(not CUDA, reason="BatchSteps fuses CUDA batches only")
def test_batch_steps_take_the_fused_layers_on_cuda(batch, monkeypatch):
    from loader.augment import Transform

    step = _step("rand", "rand-m9-mstd0.5-inc1")
    spec = Transform("train", (H, W), steps=(step,))
    calls = []
    real = fused_layers.run_layer
    monkeypatch.setattr(fused_layers, "run_layer", lambda *a: calls.append(1) or real(*a))
    out = steps.BatchSteps(spec, torch.float32, torch.contiguous_format)(batch, 11)
    assert calls == [1, 1] and out.shape == (N, 3, H, W) and out.is_cuda  # a launch a layer


_TYPES = {torch.uint8: "*u8", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}


def _signatures(batch, monkeypatch) -> list:
    """Each kernel launch of two layers (one with LUT ops, one without: a placeholder then
    takes their place) as (kernel, signature, constants), from the arguments given."""
    from loader.gpu import layer_kernels as k

    launches = []

    class Recorder:
        def __init__(self, name, fn):
            self.name, self.fn = name, fn

        def __getitem__(self, grid):
            def launch(*args, **kw):
                sig, consts = {}, {}
                for arg, value in zip(self.fn.arg_names, (*args, *kw.values()), strict=False):
                    if isinstance(value, torch.Tensor):
                        sig[arg] = _TYPES[value.dtype]
                    elif arg.isupper() or value == 1:  # constexprs; Triton makes a 1 one
                        sig[arg], consts[arg] = "constexpr", value
                    else:
                        sig[arg] = "i32"
                launches.append((self.name, sig, consts))
                return self.fn[grid](*args, **kw)

            return launch

    for name in ("layer_stats", "layer_luts", "layer_apply"):
        monkeypatch.setattr(k, name, Recorder(name, getattr(k, name)))
    small = batch[:4, :, :8, :8]
    n = len(small)
    for op, arg in (("Equalize", 0.0), ("Color", 1.5)):
        names = np.array([op] * n)
        table, host = fused_layers.layer_table(names, names, np.full(n, arg), np.zeros(n), 8, 8)
        fused_layers.run_layer(small, table, host, (1, 2, 3))
    return launches


def test_the_kernels_compile_for_hopper(batch, monkeypatch, tmp_path):
    """The interpreter runs kernels a compiler refuses (a branch giving a value of another
    type): each launch the layers make is compiled here for sm_90, as on the H200, with
    the argument types it was given, without a GPU."""
    launches = _signatures(batch, monkeypatch)
    assert {name for name, _, _ in launches} == {"layer_stats", "layer_luts", "layer_apply"}
    assert_compiles_for_hopper(
        "loader.gpu.layer_kernels", launches, tmp_path, enable_fp_fusion=False
    )


@pytest.mark.parametrize("n,seed", [(5, 12), (7, 0)])  # draws that take AutoContrast
def test_a_batch_of_any_count_gives_16_byte_aligned_statistics(batch, n, seed, monkeypatch):
    # Triton compiles a kernel again for a pointer of another alignment: the per-channel
    # histograms, minima and maxima of a batch of 5 or 7 images (an epoch's last) must be
    # 16-byte aligned, as those of a batch of 256 are.
    from loader.gpu import layer_kernels

    seen, luts = [], layer_kernels.layer_luts

    class Spy:
        def __getitem__(self, grid):
            def launch(table, host, hist, lows, highs, *rest, **options):
                seen.append([p.data_ptr() % 16 for p in (hist, lows, highs)])
                return luts[grid](table, host, hist, lows, highs, *rest, **options)

            return launch

    monkeypatch.setattr(layer_kernels, "layer_luts", Spy())
    step = _step("auto", "original")
    params = step.draw(np.random.default_rng(seed), n)
    ops = params[:, 0 : 3 * step.layers : 3].astype(int)
    assert "AutoContrast" in {step.flat_ops[k].name for k in ops[ops >= 0]}
    _within_rounding(fused_layers.apply(step, batch[:n], params), step.apply(batch[:n], params))
    assert seen and all(s == [0, 0, 0] for s in seen)

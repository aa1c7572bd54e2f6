"""The GPU path: the samples, crop windows and pixels of the CPU path; routing between the
GPU decoder and the workers; failures, resume, stream safety, bounded memory.

On a CUDA machine these run the real thing (nvjpeg, Triton kernels on the GPU). Without
one (CI), the same pipeline runs on the CPU with a stand-in batch decoder and Triton's
interpreter (``gpu_path_data``). Tolerances, in uint8 levels (0..255):

- the augmentation kernels against PIL's resize of the same window: max 1, mean 0.25
  (rounding of the two separable passes), bilinear and bicubic alike;
- the GPU path against torchvision's PIL pipeline on the same windows: mean 0.5 per
  sample with a libjpeg decode, 2.0 with nvjpeg (its IDCT and chroma upsampling differ);
- on CUDA, at full size, the GPU path against the CPU path: mean 3.0 per epoch (the CPU
  path approximates PIL's filter with a Gaussian prefilter after DCT-domain reduction,
  which at the tiny sizes of the CPU run is far coarser, so there only samples and labels
  are compared).

Where the same decode happens on both sides the comparison is exact: a sample decoded by
the workers (a CPU share, a retry) equals the CPU path's pixels bit for bit, a sample
decoded by the GPU decoder equals the GPU-only run's.
"""

from __future__ import annotations

import concurrent.futures
import gc
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import weakref

import cv2
import numpy as np
import pytest
import torch
from fixtures import collector_off
from gpu_checks import (
    EVAL,
    TRAIN,
    B,
    all_freed,
    assert_half_shared_by_way,
    assert_holds_nothing_more,
    assert_never_overwritten,
    assert_rows_read_where_they_lie,
    assert_slots_kept_until_done,
    batch_seeds,
    cpu_rows,
    epoch,
    exits_without_closing,
    flat,
    gpu_only,
    gpu_threads,
    make,
    mean_diff,
    pil_reference,
    record_ways_and_shares,
    same_batches,
    wait_for_no_gpu_threads,
)
from gpu_path_data import (
    BACKEND,
    CUDA,
    DEVICE,
    NUM_SAMPLES,
    SHORT_SIDE,
    SIZE,
    SerialisingDecoder,
    make_small_store,
    pil_resized_crop,
    use_stand_ins,
)

pytest.importorskip("triton")

import loader
from loader.augment import Transform, plan_crops
from loader.bench.synth import random_view, sample_photos
from loader.gpu.augment import GpuAugment
from loader.gpu.decode_threads import DecodeThreads as _DecodeThreads
from loader.gpu.encoded import EncodedBatches
from loader.gpu.prefetch import GpuEpochIterator
from loader.gpu.slots import ring_slots
from loader.gpu.stage import GpuStage
from loader.gpu.tuning.picker import WayPicker
from loader.gpu.tuning.share import WindowShare
from loader.options import resolve_decoder
from loader.store import Store
from loader.telemetry.stats import LoaderStats

GPU_ELIGIBLE = NUM_SAMPLES - 2  # all but the PNG and the progressive JPEG
PIL_TOL = 2.0 if CUDA else 0.5


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_small_store(tmp_path_factory.mktemp("gpu_path"))


@pytest.fixture(scope="module")
def pixel_store(store):
    """The small store again with about half its samples as pixels (mixed:0.5)."""
    from ingest.build import BuildOptions, build

    mixed = store.parent / "mixed"
    build(store.parent / "src", mixed, BuildOptions(encoding="mixed:0.5"), workers=2,
          progress=False)  # fmt: skip
    return mixed


@pytest.fixture(autouse=True)
def backend(monkeypatch):
    use_stand_ins(monkeypatch)


# -- the augmentation kernels ----------------------------------------------------------------


def photos(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    photo = cv2.cvtColor(cv2.imread(str(sample_photos()[0])), cv2.COLOR_BGR2RGB)
    return [np.ascontiguousarray(random_view(photo, rng, SHORT_SIDE)) for _ in range(n)]


def train_crops(images, seed: int) -> np.ndarray:
    heights, widths = (np.array(v) for v in zip(*[im.shape[:2] for im in images], strict=True))
    return plan_crops(TRAIN, heights, widths, np.random.default_rng(seed))


def augment(
    images,
    crops,
    dtype=torch.uint8,
    channels_last=False,
    antialias=True,
    backend="triton",
    interpolation="bilinear",
):
    """``images`` through the kernels (or their stand-in); ``interpolation`` sets the crop
    rows' CUBIC column ("random": as drawn in ``crops``)."""
    aug = GpuAugment((SIZE, SIZE), EVAL.mean, EVAL.std, antialias, backend)
    if interpolation != "random":
        crops = crops.copy()
        crops[:, 9] = interpolation == "bicubic"
    fmt_ = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.full((len(images), 3, SIZE, SIZE), 7, dtype=dtype, device=DEVICE)
    out = out.contiguous(memory_format=fmt_)
    tensors = [torch.from_numpy(im).permute(2, 0, 1).contiguous().to(DEVICE) for im in images]
    aug(tensors, crops, np.arange(len(images)), out)
    return out.cpu()


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "random"])
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("spec", [TRAIN, EVAL], ids=["train", "eval"])
def test_augment_matches_pil_resize_of_the_window(spec, backend, interpolation):
    """Each image by its own row's filter ("random": a batch of both)."""
    images = photos(5, seed=1)
    rng = np.random.default_rng(2)
    heights = np.array([im.shape[0] for im in images])
    widths = np.array([im.shape[1] for im in images])
    crops = plan_crops(spec, heights, widths, rng)
    crops[:, 8] = [1, 0, 1, 0, 0]  # some mirrored, whatever the transform
    crops[:, 9] = [0, 1, 1, 0, 1] if interpolation == "random" else interpolation == "bicubic"
    out = augment(images, crops, backend=backend, interpolation=interpolation)
    for k, image in enumerate(images):
        mode = "bicubic" if crops[k, 9] else "bilinear"
        ref = pil_resized_crop(image, crops[k], (SIZE, SIZE), mode).astype(np.int64)
        got = out[k].permute(1, 2, 0).numpy().astype(np.int64)
        assert np.abs(got - ref).max() <= 1, crops[k]
        assert np.abs(got - ref).mean() <= 0.25, crops[k]


@pytest.fixture(scope="module")
def uint8_augmented() -> tuple[list[np.ndarray], np.ndarray, torch.Tensor]:
    """(3 images, their train windows, the kernels' uint8 output of them in 0..1)."""
    images = photos(3, seed=4)
    crops = plan_crops(
        TRAIN, *zip(*[im.shape[:2] for im in images], strict=True), np.random.default_rng(5)
    )
    return images, crops, augment(images, crops).float() / 255.0


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "dtype, tol", [(torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 2e-2)]
)
def test_augment_normalises_casts_and_keeps_the_layout(uint8_augmented, dtype, tol, channels_last):
    images, crops, raw = uint8_augmented
    out = augment(images, crops, dtype, channels_last)
    mean = torch.tensor(EVAL.mean).view(1, 3, 1, 1)
    std = torch.tensor(EVAL.std).view(1, 3, 1, 1)
    fmt_ = torch.channels_last if channels_last else torch.contiguous_format
    assert out.dtype == dtype and out.is_contiguous(memory_format=fmt_)
    assert torch.allclose(out.float(), (raw - mean) / std, atol=tol, rtol=0)


def test_augment_without_antialias_is_plain_bilinear():
    images = photos(3, seed=6)
    crops = plan_crops(
        TRAIN, *zip(*[im.shape[:2] for im in images], strict=True), np.random.default_rng(7)
    )
    crops[:, 8] = 0
    out = augment(images, crops, antialias=False)
    for k, image in enumerate(images):
        y, x, h, w = crops[k, :4]
        window = torch.from_numpy(image[y : y + h, x : x + w]).permute(2, 0, 1)[None].float()
        ref = torch.nn.functional.interpolate(
            window, (SIZE, SIZE), mode="bilinear", align_corners=False, antialias=False
        )
        ref = ref.round().clamp(0, 255)[0]
        assert (out[k].float() - ref).abs().max() <= 1


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bicubic_matches_pil_when_shrinking_and_enlarging(backend):
    """PIL's bicubic (a = -0.5, widened by the factor when shrinking, each pass clamped) on
    a window shrunk (1.8 and 2.3 times at 16 px), one enlarged (1.6 and 2.7 times) and one
    shrunk down and enlarged across. Measured at 16 px: max 1, mean 0.14-0.17 (float passes
    against PIL's fixed-point ones), 0.6-0.8 from the bilinear; at 224 px on photographs,
    max 1, mean 0.14. Without the clamp between the passes: max 7."""
    images = photos(3, seed=8)
    h, w = images[0].shape[:2]  # at least 24 (SHORT_SIDE)
    crops = np.array([
        [0, 0, h, w, SIZE, SIZE, 0, 0, 0, 1],  # shrunk
        [3, 5, 6, 10, SIZE, SIZE, 0, 0, 1, 1],  # enlarged, mirrored
        [2, 1, 20, 7, SIZE, SIZE, 0, 0, 0, 1],  # shrunk down, enlarged across
    ], dtype=np.int32)  # fmt: skip
    out = augment(images, crops, backend=backend, interpolation="bicubic")
    bilinear = augment(images, crops, backend=backend)
    for k, image in enumerate(images):
        ref = pil_resized_crop(image, crops[k], (SIZE, SIZE), "bicubic").astype(np.int64)
        diff = np.abs(out[k].permute(1, 2, 0).numpy().astype(np.int64) - ref)
        assert diff.max() <= 1 and diff.mean() <= 0.25, crops[k]
    assert not torch.equal(out, bilinear)  # a filter of its own


def test_bicubic_without_antialias_is_torchs_plain_bicubic():
    """a = -0.75, as ``interpolate(mode="bicubic", antialias=False)``; only the borders
    differ (PIL's window drops the taps past the edge, torch repeats the edge pixel).
    Measured: inside the borders equal, on them up to 2 levels, mean 0.02-0.07."""
    images = photos(3, seed=6)
    crops = plan_crops(
        TRAIN, *zip(*[im.shape[:2] for im in images], strict=True), np.random.default_rng(7)
    )
    crops[:, 8] = 0
    out = augment(images, crops, antialias=False, interpolation="bicubic")
    for k, image in enumerate(images):
        y, x, h, w = crops[k, :4]
        window = torch.from_numpy(image[y : y + h, x : x + w]).permute(2, 0, 1)[None].double()
        ref = torch.nn.functional.interpolate(
            window, (SIZE, SIZE), mode="bicubic", align_corners=False, antialias=False
        )
        diff = (out[k].double() - ref.round().clamp(0, 255)[0]).abs()
        assert diff[:, 2:-2, 2:-2].max() <= 1 and diff.mean() <= 0.25


# -- the pipeline against the CPU path -------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        EVAL,
        TRAIN,
        Transform("train", SIZE, interpolation="bicubic"),
        Transform("train", SIZE, interpolation="random"),
    ],
    ids=["eval", "train", "train-bicubic", "train-random"],
)
def test_same_samples_labels_and_windows_as_the_cpu_path(store, spec):
    on_cpu = epoch(make(store, transform=spec, decoder="cpu", device="cpu"))
    on_gpu = epoch(make(store, transform=spec, cpu_share=0.0))
    assert len(on_cpu) == len(on_gpu) == 3
    assert torch.equal(flat(on_gpu, 2), flat(on_cpu, 2))  # the same samples, in order
    assert torch.equal(flat(on_gpu, 1), flat(on_cpu, 1))  # and labels
    # The same windows: each sample is what PIL makes of its planned window.
    reference = pil_reference(store, spec, on_gpu, seed=5)
    cpu_side = [k * B + r for k, b in enumerate(on_gpu) for r in cpu_rows(store, b[2])]
    assert len(cpu_side) == 2  # the PNG and the progressive JPEG: the CPU path's pixels
    rows = zip(flat(on_gpu, 0), reference, flat(on_cpu, 0), strict=True)
    for k, (got, ref, cpu) in enumerate(rows):
        assert torch.equal(got, cpu) if k in cpu_side else mean_diff(got, ref) <= PIL_TOL
    if CUDA:  # at full size the CPU path's approximation of PIL's filter is close too
        assert mean_diff(flat(on_gpu, 0), flat(on_cpu, 0)) <= 3.0
    if spec is TRAIN:  # negative control: other windows are far apart
        other = epoch(make(store, transform=spec, seed=6, shuffle=False))
        mine = epoch(make(store, transform=spec, shuffle=False))
        assert mean_diff(flat(other, 0), flat(mine, 0)) > 10


def same_as_one_of(batches, gpu_only, cpu_only) -> list[str]:
    """Per sample: "gpu" or "cpu", whichever reference it equals exactly (else "none")."""
    got, g, c = flat(batches, 0), flat(gpu_only, 0), flat(cpu_only, 0)
    return [
        "gpu" if torch.equal(x, y) else "cpu" if torch.equal(x, z) else "none"
        for x, y, z in zip(got, g, c, strict=True)
    ]


@pytest.mark.parametrize("share, on_gpu", [(0.0, GPU_ELIGIBLE), (1.0, 0)])
def test_routing_png_and_progressive_to_the_workers(store, share, on_gpu):
    dl = make(store, cpu_share=share)
    epoch(dl)
    stats = dl.stats()
    assert stats["samples"] == NUM_SAMPLES and stats["batches"] == 3
    assert stats["gpu_decoded"] == on_gpu
    assert stats["cpu_decoded"] == NUM_SAMPLES - on_gpu
    assert stats["decoder"] == BACKEND and stats["cpu_share"] == share
    assert stats["prefetch_cpu_s"] > 0 and stats["decode_threads_cpu_s"] > 0


@pytest.mark.parametrize("spec", [EVAL, TRAIN], ids=["eval", "train"])
def test_pixel_records_are_cropped_by_the_kernels_and_keep_the_samples(
    store, tmp_path, monkeypatch, spec
):
    # A store of which about half the samples are pixels (``--encoding mixed:0.5``): the
    # workers copy their crop windows, the GPU kernels crop them in the JPEGs' launch; none
    # reaches a decoder. The same samples as the JPEG store, each what PIL makes of its
    # planned window. (Room for whole images: a few small batches' windows may overflow
    # the usual room, and a window that does not fit is cropped by the workers.)
    from ingest.build import BuildOptions, build
    from ingest.format import FLAG_PROGRESSIVE, FORMAT_CODES

    monkeypatch.setattr(loader.gpu.encoded, "_WINDOW_SHARE", {"train": 1.0, "eval": 1.0})
    mixed = tmp_path / "mixed"
    build(store.parent / "src", mixed, BuildOptions(encoding="mixed:0.5"), workers=2,
          progress=False)  # fmt: skip
    raw = loader.store.Store(mixed).index["format"] == FORMAT_CODES["raw"]
    index = loader.store.Store(store).index
    eligible = (index["format"] == FORMAT_CODES["jpeg"]) & (index["flags"] & FLAG_PROGRESSIVE == 0)
    dl = make(mixed, transform=spec, cpu_share=0.0)
    batches = epoch(dl)
    stats = dl.stats()
    gpu_side = epoch(make(store, transform=spec, cpu_share=0.0))  # the JPEG store
    shared = epoch(make(mixed, transform=spec, cpu_share=1.0))  # its JPEGs on the workers
    assert 0 < raw.sum() < NUM_SAMPLES and eligible.sum() == GPU_ELIGIBLE
    assert stats["gpu_decoded"] == int((eligible & ~raw).sum())
    assert stats["gpu_cropped"] == int(raw.sum())
    assert stats["cpu_decoded"] == int((~eligible & ~raw).sum())
    assert torch.equal(flat(batches, 2), flat(gpu_side, 2))  # the same samples, in order
    assert torch.equal(flat(batches, 1), flat(gpu_side, 1))  # and labels
    order = flat(batches, 2).tolist()
    pixels = [k for k, i in enumerate(order) if raw[i]]
    jpegs = [k for k, i in enumerate(order) if not raw[i]]
    got = flat(batches, 0)
    assert torch.equal(got[jpegs], flat(gpu_side, 0)[jpegs])  # the rest as from JPEGs
    assert torch.equal(got[pixels], flat(shared, 0)[pixels])  # the windows: GPU's still
    reference = pil_reference(mixed, spec, batches, seed=5)
    for k in pixels:  # the kernels' tolerance against PIL (module docstring)
        diff = (got[k].float() - reference[k].float()).abs()
        assert diff.max() <= 1 and diff.mean() <= 0.25, k


def test_the_room_for_windows_follows_the_recipe_and_is_capped(pixel_store, monkeypatch):
    # Training windows average half an image, eval's are whole images: 0.9 and 1.5 of the
    # mean image a sample (the slack of 1.5 included); at most _MAX_WINDOW_ROOM of them.
    from ingest.format import FLAG_PROGRESSIVE, FORMAT_CODES

    index = loader.store.Store(pixel_store).index
    raw = index["format"] == FORMAT_CODES["raw"]
    jpeg = (index["format"] == FORMAT_CODES["jpeg"]) & (index["flags"] & FLAG_PROGRESSIVE == 0)
    pixels = (index["height"] * index["width"] * index["channels"]).astype(np.float64)[raw]
    per = B * 1.5 / (raw.sum() + jpeg.sum())
    jpegs = index["nbytes"][jpeg].astype(np.float64)
    for spec, share in ((TRAIN, 0.6), (EVAL, 1.0)):
        want = int((jpegs.sum() + share * pixels.sum()) * per) + int(jpegs.max())
        assert abs(EncodedBatches(loader.store.Store(pixel_store), spec, B).capacity - want) <= 1
    monkeypatch.setattr(loader.gpu.encoded, "_MAX_WINDOW_ROOM", 1000)
    want = int(jpegs.sum() * per + 1000) + int(jpegs.max())
    assert abs(EncodedBatches(loader.store.Store(pixel_store), EVAL, B).capacity - want) <= 1


def test_a_window_that_does_not_fit_is_cropped_by_the_workers(store, tmp_path, monkeypatch):
    # Room for the JPEGs first, then for the windows in order; what is left out goes to
    # the workers, the same samples in the same order. (Room made small for it.)
    from ingest.build import BuildOptions, build
    from ingest.format import FORMAT_CODES

    monkeypatch.setattr(loader.gpu.encoded, "_WINDOW_SHARE", {"train": 0.15, "eval": 0.15})
    raw_store = tmp_path / "raw"
    build(store.parent / "src", raw_store, BuildOptions(encoding="raw"), workers=2,
          progress=False)  # fmt: skip
    st = loader.store.Store(raw_store)
    producer = EncodedBatches(st, TRAIN, B)
    rows = producer.plan(np.arange(B), seed=3)
    need = rows[:, 2] * rows[:, 3] * st.index["channels"][:B]
    assert (st.index["format"][:B] == FORMAT_CODES["raw"]).all()
    fits = np.cumsum(need) <= producer.capacity
    assert 0 < fits.sum() < B
    assert np.array_equal(rows[:, loader.gpu.encoded.ROOM], np.where(fits, need, 0))  # room
    assert np.array_equal(rows[fits, loader.gpu.encoded.START], np.cumsum(need[fits]) - need[fits])
    dl = make(raw_store, transform=TRAIN)
    batches = epoch(dl)
    stats = dl.stats()
    assert 0 < stats["gpu_cropped"] < NUM_SAMPLES and stats["gpu_decoded"] == 0
    assert stats["gpu_cropped"] + stats["cpu_decoded"] == NUM_SAMPLES
    want = epoch(make(store, transform=TRAIN))
    assert torch.equal(flat(batches, 2), flat(want, 2))
    assert torch.equal(flat(batches, 1), flat(want, 1))


def test_a_cpu_share_decodes_each_sample_on_one_side(store):
    gpu_side = epoch(make(store, cpu_share=0.0))
    cpu_side = epoch(make(store, cpu_share=1.0))
    shared = make(store, cpu_share=0.5)
    batches = epoch(shared)
    stats = shared.stats()
    assert 0 < stats["gpu_decoded"] < GPU_ELIGIBLE
    assert stats["gpu_decoded"] + stats["cpu_decoded"] == NUM_SAMPLES
    assert torch.equal(flat(batches, 2), flat(gpu_side, 2))
    # Each sample is exactly what one side makes of it (the PNG and the progressive JPEG
    # are the workers' on both, so counting sides would not say which decoded what).
    assert "none" not in same_as_one_of(batches, gpu_side, cpu_side)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_batch_split_over_the_workers_is_planned_as_one(store, monkeypatch, share):
    """Each worker plans the whole batch with the share the training process decided, and
    fills its rows: batches split into chunks of 3 equal those made without workers."""
    inline = make(store, transform=TRAIN, cpu_share=share, num_workers=0)
    want = epoch(inline)
    if share == 1.0:  # the share reaches the plan without workers too
        assert inline.stats()["cpu_decoded"] == NUM_SAMPLES
    monkeypatch.setattr(loader.gpu.prefetch, "gather_chunk", lambda *_: 3)
    split = make(store, transform=TRAIN, cpu_share=share, num_workers=2)
    same_batches(epoch(split), want)
    assert split.stats()["cpu_decoded"] == inline.stats()["cpu_decoded"]


def test_auto_share_is_tried_as_a_way_and_keeps_the_samples(store):
    # With cpu_share="auto" every way is tried with the workers' share and without: each
    # batch planned "+cpu" has its share decoded by the workers, the others none, and
    # every sample is the one the GPU-only run delivers, from one side or the other.
    dl = make(store, cpu_share="auto", batch_size=4)
    stage = dl._gpu_stage
    assert stage.picker.ways == ("gpu", "gpu+cpu")
    # A trial at once, windows of 5: A B B A from the first of the 18 batches of 3 epochs.
    stage.routing.picker = WayPicker(stage.picker.ways, window=5, skip=1, warmup=0)
    finished = record_ways_and_shares(stage)
    stage.routing.plan(seed=12345)  # a batch planned, then dropped unstarted: it takes the
    # trial's first batch, and no other batch's way
    got = [epoch(dl) for _ in range(3)]
    gpu_only, cpu_only = (make(store, cpu_share=share, batch_size=4) for share in (0.0, 1.0))
    reference = [epoch(gpu_only) for _ in range(3)]
    cpu_side = [epoch(cpu_only) for _ in range(3)]
    ways = assert_half_shared_by_way(stage, finished, list(itertools.chain(*got)))
    assert ways == ["gpu"] * 4 + ["gpu+cpu"] * 10 + ["gpu"] * 4  # the trial's A B B A so far
    for mine, gpu_side, cpu_made in zip(got, reference, cpu_side, strict=True):
        assert torch.equal(flat(mine, 2), flat(gpu_side, 2))
        assert "none" not in same_as_one_of(mine, gpu_side, cpu_made)


def test_an_epochs_first_batch_does_not_steer_the_auto_share(store):
    # The workers take 0.3 s to start: the first batch's wait is theirs, not their pace.
    dl = make(store, cpu_share="auto", worker_init_fn=lambda _: time.sleep(0.3))
    stage = dl._gpu_stage
    stage.fix_way("gpu+cpu")  # every batch with the share
    steered = []  # (wait, busy, the share after them), batch by batch

    def steer(waited, busy, way, real=stage._steer):
        real(waited, busy, way)
        steered.append((waited, busy, stage.cpu_share))

    stage._steer = steer
    stage.routing.share = 0.5  # as if steered there
    for k in range(9):  # as if the loop had taken 8 batches a second apart, never waiting
        stage.loop.handed(0.0, k - 10.0)
    epoch(dl)
    assert len(steered) == 3
    (wait, _, share), *rest = steered
    assert wait > 0.2 and share == 0.5  # the workers' start: unmoved
    for waited, busy, after in rest:  # the others steer it: gain 0.5, target 5% idle
        share = min(max(share + 0.5 * (0.05 - waited / (waited + busy)), 0.0), 0.9)
        assert after == pytest.approx(share)


def test_the_auto_share_shrinks_while_the_loop_waits_for_batches(store):
    # A loop that waits for its batches has the loader for its limit: the share does not
    # grow, whatever the workers' wait, and shrinks by half the share of its time waiting.
    # Only the batches of a way with the share steer it.
    stage = make(store, cpu_share="auto")._gpu_stage
    stage.routing.share = 0.5  # what its ways with the share get
    for k in range(8):  # gaps of 10 ms, 4 of them waiting for the batch
        stage.loop.handed(0.004, 0.01 * (k + 1))
    assert stage.loop.share() is None  # 7 gaps: too few
    stage.loop.handed(0.004, 0.09)
    assert stage.loop.share() == pytest.approx(0.4)
    stage._steer(waited=0.0, busy=0.01, way="gpu")  # a batch without the share: unmoved
    assert stage.routing.share == 0.5
    stage._steer(waited=0.0, busy=0.01, way="gpu+cpu")  # the workers kept up
    assert stage.routing.share == pytest.approx(0.5 - 0.5 * 0.4)
    for _ in range(2):
        stage._steer(waited=0.0, busy=0.01, way="gpu+cpu")
    assert stage.routing.share == 0.0
    # Once it stops waiting (under 5% of its time), the share grows again by the workers'.
    for k in range(8):
        stage.loop.handed(0.0004, 0.09 + 0.01 * (k + 1))
    assert stage.loop.share() == pytest.approx(0.04)
    stage._steer(waited=0.0, busy=0.01, way="gpu+cpu")
    assert stage.routing.share == pytest.approx(0.5 * 0.05)
    # An epoch's start: the gap to its first hand-off is the loop's own, left out.
    stage.epoch_started()
    stage.loop.handed(5.0, 10.0)
    assert stage.loop.share() == pytest.approx(0.04)
    stage.loop.handed(0.01, 10.01)  # the window's oldest gap gives way to this one
    assert stage.loop.share() == pytest.approx((7 * 0.0004 + 0.01) / 0.08)


def test_a_loop_that_waits_while_the_loader_holds_batches_does_not_shrink_the_share(store):
    # The loop waits for a batch now and then while the prefetch thread holds finished
    # batches 30% of its time (the queue of them full): the loader's pace is not the loop's
    # limit, and the workers' wait alone steers the share. Holding under 20%, it shrinks.
    # Intervals of a second: the few ms to the steer's own mark (now) hardly count.
    stage = make(store, cpu_share="auto")._gpu_stage
    stage.routing.share = 0.5
    start = time.perf_counter() - 9.0
    for k in range(9):  # gaps of 1 s, 0.4 s of each waiting for the batch
        stage.loop.handed(0.4, start + k)
    for k in range(9):  # intervals of 1 s from batch to batch, 0.3 s of each holding it
        stage.held.handed(0.3, start + k)
    stage.note_held(0.3)  # the batch steering: its interval up to now, 0.3 s held
    stage._steer(waited=0.0, busy=0.01, way="gpu+cpu")  # the workers kept up
    assert stage.held.share() == pytest.approx(0.3, abs=0.01)  # 0.26 without note_held
    assert stage.routing.share == pytest.approx(0.5 + 0.5 * 0.05)
    assert stage.stats.snapshot()["loop_waits_held"] == 1
    stage.held = WindowShare(8)
    start = time.perf_counter() - 9.0
    for k in range(9):  # held 0.1 s of each second: the thread is the loop's limit
        stage.held.handed(0.1, start + k)
    stage._steer(waited=0.0, busy=0.01, way="gpu+cpu")
    assert stage.held.share() == pytest.approx(0.7 / 8, abs=0.01)
    assert stage.routing.share == pytest.approx(0.525 - 0.5 * 0.4)
    assert stage.stats.snapshot()["loop_waits_held"] == 1


@pytest.mark.parametrize("pause", [0.0, 0.15])
def test_the_prefetch_thread_counts_its_time_holding_batches_the_loop_has_not_taken(store, pause):
    # A loop that takes 0.15 s a batch leaves the thread holding each batch past the two
    # the queue takes most of that time; with room in the queue for every batch of the
    # epoch, the thread never holds one.
    dl = make(store, batch_size=2, prefetch_factor=2 if pause else 16)
    taken = 0
    for _ in dl:
        taken += 1
        time.sleep(pause)
    stats = dl.stats()
    held, share = stats.get("stage_held_s", 0.0), stats["held_share"]
    assert taken == 12 and share is not None
    if pause:
        assert held > (taken - 4) * pause / 2 and share > 0.5
    else:
        assert held == 0.0 and share == 0.0


def test_stats_report_the_share_of_the_way_kept(store):
    dl = make(store, cpu_share="auto")
    stage = dl._gpu_stage
    stage.routing.share = 0.3  # what the ways with the share get
    assert (stage.picker.way, dl.stats()["cpu_share"]) == ("gpu", 0.0)
    stage.fix_way("gpu+cpu")
    assert dl.stats()["cpu_share"] == 0.3
    fixed = make(store, cpu_share=0.2)  # a fixed share: every batch's, no ways tried
    assert (fixed._gpu_stage.picker, fixed.stats()["cpu_share"]) == (None, 0.2)


def test_an_auto_share_beside_a_loop_that_waits_goes_to_zero(store):
    # Iterated with nothing to do, the loop waits for its batches: the share, unmoved
    # until 8 hand-offs tell whether the loop waits, then goes to 0 and stays there.
    # (Batches of one sample: a share of 0.25 of one rounds to none, so each sample is
    # the GPU-only run's.)
    dl = make(store, cpu_share="auto", batch_size=1)
    stage = dl._gpu_stage
    stage.fix_way("gpu+cpu")
    shares = []

    def steer(waited, busy, way, real=stage._steer):
        real(waited, busy, way)
        shares.append((stage.loop.share(), stage.cpu_share))

    stage._steer = steer
    got = epoch(dl)
    assert len(shares) == NUM_SAMPLES
    told = [k for k, (loop, _) in enumerate(shares) if loop is not None]
    assert all(share == 0.25 for _, share in shares[: told[0]])  # where it starts
    assert sum(shares[k][0] > 0.05 for k in told) > NUM_SAMPLES // 2
    assert shares[-1][1] == 0.0
    assert torch.equal(flat(got, 2), flat(epoch(make(store, cpu_share=0.0, batch_size=1)), 2))


def test_the_picker_is_told_each_epochs_start_before_its_batches(store):
    dl = make(store)
    calls = []

    class Told:  # what a WayPicker is told by the stage, recorded
        way = "gpu"

        def next(self):  # as each batch is planned
            planned.append(1)
            return self.way

        def epoch_started(self):
            calls.append("epoch")

        def finished(self, now):
            calls.append("finished")

        def handed(self, now):
            handed.append(now)

        def forget(self):  # as the iteration closes, with nothing left in flight
            calls.append("forget")

    handed, planned = [], []
    dl._gpu_stage.routing.picker = Told()
    epoch(dl)
    epoch(dl)
    assert calls == (["epoch"] + ["finished"] * 3 + ["forget"]) * 2  # batches of 8, 8, 7
    assert len(handed) == len(planned) == 6


def test_stats_report_the_picker_of_ways(store):
    dl = make(store)
    dl._gpu_stage.routing.picker = WayPicker(("engines", "cuda"))  # a trial after 16 hand-offs
    epoch(dl)  # 3 batches: none yet
    picked = {k: v for k, v in dl.stats().items() if k.startswith("way")}
    assert picked == {
        "way": "engines", "way_trials": 0, "way_trialing": False,
        "way_trial_causes": [], "way_paces_ms": {}, "way_drifts_ms": [],
    }  # fmt: skip


def test_an_image_the_gpu_decoder_rejects_is_decoded_on_the_cpu(store):
    reference = epoch(make(store, cpu_share=0.0))
    first_gpu = next(k for k in range(B) if k not in cpu_rows(store, reference[0][2]))
    # The decoder rejects that one image, in whichever call it comes (two decode threads
    # take batches in no set order).
    chosen = Store(store).image(int(reference[0][2][first_gpu]))[0]
    dl = make(store, cpu_share=0.0)
    real = dl._gpu_stage.decoder.decode_batch

    def reject_chosen(encoded):
        out = real(encoded)
        for k, data in enumerate(encoded):
            if data.numpy().tobytes() == chosen:
                out[k] = None
        return out

    dl._gpu_stage.decoder.decode_batch = reject_chosen
    batches = epoch(dl)
    stats = dl.stats()
    assert stats["gpu_rejected"] == 1 and dl.bad_samples == {} and dl.num_replaced == 0
    assert stats["gpu_decoded"] == GPU_ELIGIBLE - 1
    assert torch.equal(flat(batches, 2), flat(reference, 2))
    sides = same_as_one_of(batches, reference, epoch(make(store, cpu_share=1.0)))
    assert sides[first_gpu] == "cpu" and "none" not in sides


def test_a_damaged_pixel_record_is_replaced_and_counted(store, tmp_path):
    # Its CRC-32 fails in the worker copying its window: the worker replaces it, drawn from
    # the batch's seed, as the CPU path does (the replacement cropped there, on the CPU).
    from loader_data import corrupt

    from ingest.build import BuildOptions, build

    raw_store = tmp_path / "raw"
    build(store.parent / "src", raw_store, BuildOptions(encoding="raw"), workers=2,
          progress=False)  # fmt: skip
    path, damaged = corrupt(raw_store, tmp_path, 5)
    dl = make(damaged, transform=TRAIN)
    batches = epoch(dl)
    stats = dl.stats()
    got = flat(batches, 2).tolist()
    assert len(got) == NUM_SAMPLES and 5 not in got
    assert list(dl.bad_samples) == [5] and path in dl.bad_samples[5] and dl.num_replaced == 1
    assert stats["gpu_cropped"] == NUM_SAMPLES - 1 and stats["cpu_decoded"] == 1
    cpu_side = epoch(make(damaged, transform=TRAIN, decoder="cpu", device="cpu"))
    assert flat(cpu_side, 2).tolist() == got  # the same replacement


def test_an_abandoned_iterator_stops_its_thread(store):
    dl = make(store)
    it = iter(dl)
    next(it)
    del it
    gc.collect()
    wait_for_no_gpu_threads()
    assert not gpu_threads()  # the prefetch thread and the decode thread
    assert len(epoch(dl)) == 3  # and the loader still reads whole epochs


def test_the_next_batch_waits_inside_the_decoder_not_for_the_gil(store):
    """With a decoder that takes two callers (torchvision's serialises them), the next
    batch's call is already waiting inside it when the current one ends; the batches are
    those of one decode thread."""
    SerialisingDecoder.most_inside = 0
    two = epoch(make(store, decoder="serialising", cpu_share=0.0))
    assert SerialisingDecoder.most_inside == 2
    one = epoch(make(store, cpu_share=0.0))
    for k in (1, 2):  # labels, indices
        assert torch.equal(flat(two, k), flat(one, k))
    assert mean_diff(flat(two, 0), flat(one, 0)) == 0


def test_a_stopped_decoder_runs_nothing_more():
    threads = _DecodeThreads(2)
    ran = threading.Event()
    assert threads.submit(lambda: 7).result(timeout=10) == 7
    assert threads.stop(10)
    late = threads.submit(ran.set)  # a call from a thread that outlived the stop
    assert late.cancelled() and not ran.wait(0.2)
    assert threads.stop(1)  # no thread was started for it


def test_a_call_gives_its_outcome_once_and_a_failed_one_is_freed_untaken():
    from loader.gpu.calls import Call

    assert Call.of(lambda: 7).result() == 7
    with pytest.raises(ZeroDivisionError):
        Call.of(lambda: 1 / 0)  # called here: raised here
    call = Call(lambda: 8)
    call.run()
    assert call.result(timeout=1) == 8
    with pytest.raises(RuntimeError, match="taken twice"):
        call.result()
    waiting = Call(lambda: 9)
    with pytest.raises(TimeoutError):
        waiting.result(timeout=0.01)
    waiting.cancel()
    assert waiting.cancelled()
    waiting.run()  # cancelled: never runs
    with pytest.raises(concurrent.futures.CancelledError):
        waiting.result()

    class Stage:
        def decode(self):
            raise RuntimeError("a decoder's own failure")

    stage = Stage()
    refs = [weakref.ref(stage)]
    with collector_off():
        failed = Call(stage.decode)
        failed.run()
        refs.append(weakref.ref(failed))
        del stage, failed  # never taken: its error held no cycle through the call
        assert [r() for r in refs] == [None, None]


def test_a_decode_thread_lets_go_of_a_failed_call_at_once():
    """A call that raised is let go of once its caller has the error (the thread alive,
    waiting for the next call), with the cyclic collector off: the thread's frame, which
    the error's traceback holds, no longer holds the call (the stage, in the loader)."""

    class Stage:
        def start(self):
            raise RuntimeError("CUDA error: an illegal memory access")

    threads = _DecodeThreads(1)
    stage = Stage()
    ref = weakref.ref(stage)
    with collector_off():
        future = threads.submit(stage.start)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            future.result(timeout=10)
        del stage, future
        assert all_freed([ref])
    assert threads.stop(10)


def test_a_slow_batch_holds_up_none_of_those_before_it(store, monkeypatch):
    """The prefetch thread finishes the batches it has while the workers are still on a
    slow one (a huge PNG, a stalled read), instead of waiting for it first."""
    fill = EncodedBatches.fill_rows

    def slow(self, slot, lo, indices, *args):
        if 16 in indices.tolist():
            time.sleep(4.0)  # batch 2 of 3
        return fill(self, slot, lo, indices, *args)

    monkeypatch.setattr(EncodedBatches, "fill_rows", slow)
    dl = make(store, shuffle=False, cpu_share=0.0)
    start = time.monotonic()
    it = iter(dl)
    head = [next(it), next(it)]
    assert time.monotonic() - start < 2.5  # was 4 s and more: batch 1 waited for batch 2
    batches = head + list(it)
    assert flat(batches, 2).tolist() == list(range(NUM_SAMPLES))


def test_closing_after_a_worker_error_the_loop_has_not_taken_does_not_wait(store, monkeypatch):
    fill = EncodedBatches.fill_rows

    def failing(self, slot, lo, indices, *args):
        if 16 in indices.tolist():  # batch 2 of 3, once the others are delivered
            time.sleep(0.5)
            raise OSError("disk gone")
        return fill(self, slot, lo, indices, *args)

    monkeypatch.setattr(EncodedBatches, "fill_rows", failing)
    dl = make(store, shuffle=False, persistent_workers=True)
    it = iter(dl)
    next(it)
    time.sleep(1.5)  # the prefetch thread has the error queued for the loop
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 5  # was 30 s: a drain waiting for batch 2
    monkeypatch.setattr(EncodedBatches, "fill_rows", fill)
    assert flat(epoch(dl), 2).tolist() == list(range(NUM_SAMPLES))
    dl.close()


def test_argument_errors_and_auto(store):
    with pytest.raises(ValueError, match=r"decoder='nvjpeg' decodes on a CUDA device but"):
        make(store, decoder="nvjpeg", device="cpu")
    with pytest.raises(ValueError, match=r"cpu_share=1.5 is invalid: pass 'auto'"):
        make(store, cpu_share=1.5)
    assert make(store, decoder="auto", device="cpu").decoder == "cpu"
    if CUDA:
        assert make(store, decoder="auto", device="cuda").decoder in ("dali", "nvjpeg")


def test_auto_on_cuda_is_dali_where_installed_else_nvjpeg(monkeypatch):
    cuda = torch.device("cuda")  # resolving the name touches no device
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        assert resolve_decoder("auto", cuda) == "nvjpeg"
    else:
        assert resolve_decoder("auto", cuda) == "dali"
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # as if not installed
    assert resolve_decoder("auto", cuda) == "nvjpeg"
    monkeypatch.setitem(sys.modules, "torchvision.io", None)
    assert resolve_decoder("auto", cuda) == "cpu"
    assert resolve_decoder("auto", torch.device("cpu")) == "cpu"


def test_stats_say_where_the_time_went(store):
    dl = make(store, cpu_share=0.0)
    epoch(dl)
    stats = dl.stats()
    for key in ("wait_s", "gpu_decode_s", "augment_s", "worker_read_s", "cpu_decode_s"):
        assert stats[key] >= 0.0, key
        assert key[:-2] + "_us_per_sample" in stats
    assert stats["gpu_share"] == GPU_ELIGIBLE / NUM_SAMPLES


# -- CUDA only: stream safety and memory -----------------------------------------------------


@gpu_only
def test_stats_count_the_bytes_copied_to_the_device(store):
    dl = make(store, cpu_share=0.5)
    epoch(dl)
    stats = dl.stats()
    # The workers' pixels and every label cross, and the kernels' tables: per GPU-decoded
    # image an address, 17 int32 parameters and an int32 per window row; the workers' row
    # numbers; each array's slot rounded up to 16 bytes.
    least = stats["cpu_decoded"] * 3 * SIZE * SIZE + 8 * stats["samples"]
    tallest = int(Store(store).index["height"].max())
    tables = stats["gpu_decoded"] * (8 + 68 + 4 * tallest) + 8 * stats["cpu_decoded"]
    assert least < stats["h2d_bytes"] <= least + tables + 6 * 16 * stats["batches"]


@gpu_only
def test_rows_that_cannot_be_read_where_they_lie_are_copied(store, monkeypatch):
    # The ring registered by someone else first: the loader's registration is refused
    # (and that refusal, this thread's last CUDA error, raises nowhere later); the rows
    # are copied as before, the batches bit for bit those of the copying path.
    got = make(store, cpu_share=0.5)
    pixels = got._ring.tensors["pixels"]
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(pixels.data_ptr(), pixels.nbytes, 0)) == 0
    try:
        batches = epoch(got)
        stats = got.stats()
        assert got._gpu_stage.uploads.rows_mapped is None and "mapped_rows" not in stats
        assert stats["cpu_decoded"] > 0
        torch.zeros(1, device=DEVICE)  # no error left behind for a later launch
    finally:
        got.close()
        assert int(rt.cudaHostUnregister(pixels.data_ptr())) == 0
    monkeypatch.setattr(GpuStage, "map_ring", lambda self, tensors: None)
    same_batches(batches, epoch(make(store, cpu_share=0.5)))


@gpu_only
def test_pixel_windows_are_copied_from_the_registered_ring_or_through_pinned_memory(
    pixel_store, monkeypatch
):
    # The windows cross by one DMA copy from the ring's registered byte buffer; refused
    # that (someone registered it first), through a pinned buffer; bit for bit the same
    # batches either way, and closing the loader undoes the registration.
    rt = torch.cuda.cudart()
    refused = make(pixel_store, transform=TRAIN)
    data = refused._ring.tensors["data"]
    assert int(rt.cudaHostRegister(data.data_ptr(), data.nbytes, 0)) == 0
    try:
        batches = epoch(refused)
        assert refused._gpu_stage.uploads.data_mapped is None
        assert refused.stats()["gpu_cropped"] > 0
        torch.zeros(1, device=DEVICE)  # no error left behind for a later launch
    finally:
        refused.close()
        assert int(rt.cudaHostUnregister(data.data_ptr())) == 0
    got = make(pixel_store, transform=TRAIN)
    same_batches(batches, epoch(got))
    mapped, data = got._gpu_stage.uploads.data_mapped, got._ring.tensors["data"]
    assert mapped is not None and mapped._slots is not None
    got.close()
    assert int(rt.cudaHostRegister(data.data_ptr(), data.nbytes, 0)) == 0  # undone: anew
    assert int(rt.cudaHostUnregister(data.data_ptr())) == 0
    monkeypatch.setattr(GpuStage, "map_ring", lambda self, tensors: None)
    same_batches(batches, epoch(make(pixel_store, transform=TRAIN)))


@gpu_only
def test_batches_of_a_pixel_store_are_never_overwritten(pixel_store):
    dl = make(pixel_store, transform=TRAIN, dtype=torch.float16, num_workers=2)
    assert_never_overwritten(dl, torch.cuda.Stream())


@pytest.mark.parametrize("queries", [3, None], ids=["done-soon", "done-when-waited"])
def test_a_pixel_store_slot_is_refilled_only_once_its_batch_gpu_work_is_done(
    pixel_store, queries, monkeypatch
):
    # The windows' copy reads the slot as the JPEG decode does (see the test below).
    dl = make(pixel_store, batch_size=2, num_workers=2, persistent_workers=True)
    assert_slots_kept_until_done(dl, type(dl._gpu_stage), monkeypatch, queries)


@gpu_only
@pytest.mark.parametrize("persistent", [False, True], ids=["workers-anew", "persistent"])
def test_the_workers_rows_are_read_where_they_lie(store, monkeypatch, persistent):
    assert_rows_read_where_they_lie(make, store, monkeypatch, persistent)


@gpu_only
@pytest.mark.parametrize("own_stream", [False, True], ids=["default-stream", "own-stream"])
def test_delivered_batches_are_never_overwritten(store, own_stream):
    dl = make(store, dtype=torch.float16, num_workers=2)
    assert_never_overwritten(dl, torch.cuda.Stream() if own_stream else None)


@pytest.mark.parametrize("abandon", [False, True], ids=["whole", "abandoned"])
def test_nothing_is_held_longer_epoch_after_epoch(store, abandon):
    assert_holds_nothing_more(make(store, persistent_workers=True), abandon)


@pytest.mark.parametrize("queries", [3, None], ids=["done-soon", "done-when-waited"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_slot_is_refilled_only_once_its_batch_gpu_work_is_done(
    store, num_workers, queries, monkeypatch
):
    # Batches of 2: 12 an epoch, more than the ring's slots, so that "done-when-waited"
    # runs out of them.
    dl = make(store, batch_size=2, num_workers=num_workers, persistent_workers=num_workers > 0)
    assert_slots_kept_until_done(dl, type(dl._gpu_stage), monkeypatch, queries)


@gpu_only
def test_gpu_memory_is_flat_across_epochs(store):
    dl = make(store, dtype=torch.float16, batch_size=8, num_workers=2)
    index = Store(store).index
    batch_bytes = 8 * 3 * int(index["height"].max()) * int(index["width"].max())
    reserved = []
    for _ in range(10):
        for _batch in dl:
            pass
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    # The caching allocator settles within the first epochs (how the decode threads and
    # the side stream interleave decides in which); a batch's decoded images kept per
    # epoch would add that much each epoch.
    assert reserved[-1] - reserved[4] < batch_bytes, reserved
    assert reserved[-1] <= reserved[0] + 2 * batch_bytes, reserved


# -- the prefetch thread's life: errors, persistent workers, close ---------------------------


def test_a_dead_worker_surfaces_through_the_prefetch_thread(store):
    dl = make(store, num_workers=2, batch_size=2)  # 12 batches: more than the thread prefetches
    it = iter(dl)
    next(it)
    os.kill(dl.worker_pids[0], signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"DataLoader worker \d \(pid \d+\) died: killed by"):
        for _ in it:
            pass
    assert not gpu_threads()
    assert len(epoch(dl)) == 12  # a new iteration starts new workers


def test_persistent_workers_serve_every_epoch(store):
    dl = make(store, num_workers=2, persistent_workers=True)
    first = epoch(dl)
    pids = dl.worker_pids
    second = epoch(dl)
    assert dl.worker_pids == pids and len(pids) == 2
    for batches in (first, second):
        assert sorted(flat(batches, 2).tolist()) == list(range(NUM_SAMPLES))
    dl.close()
    assert dl.worker_pids == []


@pytest.mark.parametrize("pause", [0.0, 0.5], ids=["back-to-back", "loop-pauses"])
def test_persistent_workers_carry_on_into_the_next_epoch(store, pause):
    # The thread makes the next epoch's first batches while the loop ends this one (with a
    # pause between epochs and room for 4 finished batches, all three of the next epoch's,
    # and then it waits for the loop to start it): every epoch is the one a loader that
    # stops at each epoch's end delivers.
    dl = make(
        store, persistent_workers=True, dtype=torch.float16, transform=TRAIN,
        prefetch_factor=4 if pause else 2,
    )  # fmt: skip
    want = make(store, dtype=torch.float16, transform=TRAIN)
    for e in range(3):
        same_batches(epoch(dl), epoch(want))
        assert dl.epoch == want.epoch == e + 1
        assert sorted(gpu_threads()).count("imfeed-gpu-prefetch") == 1  # carrying on
        if pause:
            time.sleep(pause)
            stats = dl.stats()  # the next epoch is made, whole, before the loop asks
            assert stats["gpu_decoded"] + stats["cpu_decoded"] == (e + 2) * NUM_SAMPLES
    stats = dl.stats()
    assert (stats["epochs_carried"], stats.get("carries_dropped", 0)) == (2, 0)
    assert (stats["batches"], stats["samples"]) == (9, 3 * NUM_SAMPLES)
    dl.close()
    wait_for_no_gpu_threads()
    assert not gpu_threads() and dl.worker_pids == []


def test_a_loop_bounded_by_len_carries_on(store):
    # next(it) len(loader) times, or zip / islice (which drop the iterator), never asking
    # past the last batch: the thread's "end" between the epochs is read at the next
    # iter(), which takes over the batches made meanwhile.
    dl = make(store, persistent_workers=True)
    want = make(store)
    it = iter(dl)
    same_batches([tuple(t.cpu() for t in next(it)) for _ in range(len(dl))], epoch(want))
    again = iter(dl)
    assert again is it and dl.epoch == 1
    del it, again  # epoch 1 left unread: closed, and read again from its start
    for e in range(1, 3):
        if e == 1:
            bounded = (batch for _, batch in zip(range(len(dl)), dl, strict=False))
        else:
            bounded = itertools.islice(dl, len(dl))
        same_batches([tuple(t.cpu() for t in batch) for batch in bounded], epoch(want))
        del bounded
        assert sorted(gpu_threads()).count("imfeed-gpu-prefetch") == 1  # carrying on
        state = dl.state_dict()  # as at a `for` loop's last batch: the epoch, all of it
        assert (dl.epoch, state["epoch"], state["consumed"]) == (e + 1, e, NUM_SAMPLES)
    assert (dl.stats()["epochs_carried"], dl.stats().get("carries_dropped", 0)) == (2, 0)
    same_batches(epoch(dl), epoch(want))  # and read to its end as usual
    assert dl.stats()["epochs_carried"] == 3
    dl.close()
    wait_for_no_gpu_threads()
    assert not gpu_threads() and dl.worker_pids == []


def test_a_checkpoint_at_an_epochs_last_batch_resumes_with_the_next(store):
    dl = make(store, persistent_workers=True)
    for _batch in dl:
        state = dl.state_dict()  # at the last batch: epoch 0, all of it consumed
    dl.close()
    assert (state["epoch"], state["consumed"]) == (0, NUM_SAMPLES)
    want = make(store)
    epoch(want)
    resumed = make(store, persistent_workers=True)
    resumed.load_state_dict(state)
    assert epoch(resumed) == []  # the rest of epoch 0
    same_batches(epoch(resumed), epoch(want))  # then epoch 1, whole
    assert resumed.epoch == 2
    resumed.close()


@pytest.mark.parametrize("how", ["set_epoch", "load_state_dict", "sampler-not-moved"])
def test_batches_made_for_an_epoch_the_loop_does_not_take_are_dropped(store, how):
    sampler = torch.utils.data.DistributedSampler(
        range(NUM_SAMPLES), num_replicas=1, rank=0, seed=5
    )
    extra = {"sampler": sampler, "shuffle": False} if how == "sampler-not-moved" else {}
    dl = make(store, persistent_workers=True, **extra)
    want = make(store, **extra)
    epoch(dl)
    pids = dl.worker_pids
    time.sleep(0.3)  # the thread is into epoch 1 (the sampler's epoch 0 once more)
    if how == "set_epoch":
        dl.set_epoch(4)
        want.set_epoch(4)
    elif how == "load_state_dict":  # halfway through epoch 1
        state = {**dl.state_dict(), "consumed": B, "step": 1}
        dl.load_state_dict(state)
        want.load_state_dict(state)
    same_batches(epoch(dl), epoch(want))
    stats = dl.stats()
    assert (stats.get("epochs_carried", 0), stats["carries_dropped"]) == (0, 1)
    assert dl.worker_pids == pids  # the workers were drained, not stopped
    if how == "sampler-not-moved":
        sampler.set_epoch(1)  # as the loop should
    same_batches(epoch(dl), epoch(want))  # and the next one follows on again
    assert dl.stats()["epochs_carried"] == 1
    dl.close()


def test_resume_in_an_epoch_that_was_carried_on(store):
    dl = make(store, persistent_workers=True)
    epoch(dl)
    it = iter(dl)  # epoch 1, its first batches made during epoch 0
    head = [tuple(t.cpu() for t in next(it))]
    state = dl.state_dict()
    assert (state["epoch"], state["consumed"], dl.stats()["epochs_carried"]) == (1, B, 1)
    resumed = make(store)
    resumed.load_state_dict(state)
    rest = epoch(resumed)
    whole = make(store)
    whole.set_epoch(1)
    want = epoch(whole)
    same_batches(head + rest, want)
    it.close()  # a loop that stops early: the epoch starts again, whole, from its start
    same_batches(epoch(dl), want)
    dl.close()


def hold_the_second_batch(monkeypatch) -> tuple[threading.Event, list]:
    """The prefetch thread waits inside its second ``_produce_one`` until the event is set
    (it then holds the iterator); chunks come one by one (50 ms each), so draining them
    takes several reads. Returns the event and the list of calls (clear both to repeat)."""
    dropped = threading.Event()
    produce = GpuEpochIterator._produce_one
    calls = []

    def held(self):
        out = produce(self)
        calls.append(1)
        if len(calls) == 2:
            dropped.wait(10)
        return out

    fill = EncodedBatches.fill_rows

    def slow_fill(*args):
        time.sleep(0.05)
        return fill(*args)

    monkeypatch.setattr(GpuEpochIterator, "_produce_one", held)
    monkeypatch.setattr(EncodedBatches, "fill_rows", slow_fill)
    return dropped, calls


def test_an_iterator_dropped_while_its_thread_makes_a_batch(store, monkeypatch):
    # The loop leaves its epoch while the thread holds the iterator: the thread lets go
    # last, and so closes it itself; the workers' chunks still out must be drained all the
    # same (once, a stale one reached the next epoch: KeyError).
    dropped, _ = hold_the_second_batch(monkeypatch)
    dl = make(store, persistent_workers=True, batch_size=2)  # 12 batches: many chunks out
    it = iter(dl)
    next(it)
    pids = dl.worker_pids
    del it  # the thread, inside _produce_one, still holds it
    dropped.set()
    wait_for_no_gpu_threads()
    assert not gpu_threads()
    want = make(store, batch_size=2)
    for e in (3, 4):  # another order, so a stale chunk would land in another batch
        dl.set_epoch(e)
        want.set_epoch(e)
        same_batches(epoch(dl), epoch(want))
    assert dl.worker_pids == pids
    dl.close()


def test_a_new_iteration_waits_for_a_close_on_the_thread(store, monkeypatch):
    # As above, but the loop starts its next iteration at once, while the thread that let
    # go of the old iterator last still drains that one's chunks: the new iteration waits
    # for that close (before, it took the old chunks: KeyError, or a hang).
    dropped, calls = hold_the_second_batch(monkeypatch)
    dl = make(store, persistent_workers=True, batch_size=2)
    want = make(store, batch_size=2)
    for e, pause in ((3, 0.005), (4, 0.02), (5, 0.05), (6, 0.1)):
        calls.clear()
        dropped.clear()
        it = iter(dl)
        next(it)
        del it  # the thread, inside _produce_one, holds it: it lets go last
        dropped.set()
        time.sleep(pause)  # the thread is closing it now, draining chunks of 50 ms each
        dl.set_epoch(e)
        want.set_epoch(e)
        same_batches(epoch(dl), epoch(want))
    dl.close()


def test_a_worker_that_dies_between_epochs_is_reported_and_replaced(store):
    # Batches of 2, 12 an epoch: the next epoch needs the workers again after its first.
    dl = make(store, persistent_workers=True, batch_size=2)
    want = make(store, batch_size=2)
    same_batches(epoch(dl), epoch(want))
    os.kill(dl.worker_pids[0], signal.SIGKILL)  # while the next epoch's batches are made
    with pytest.raises(RuntimeError, match=r"worker \d \(pid \d+\) died: killed by signal"):
        epoch(dl)
    wait_for_no_gpu_threads()
    assert not gpu_threads() and dl.worker_pids == []
    same_batches(epoch(dl), epoch(want))  # the failed epoch again, whole, by new workers
    dl.close()


def test_a_parked_iterator_stops_with_its_loader(store):
    dl = make(store, persistent_workers=True)
    epoch(dl)
    assert "imfeed-gpu-prefetch" in gpu_threads()
    del dl
    # The loader and its iterator hold each other: the garbage collector frees them, once
    # the thread, which may be on a batch, has let go of the iterator.
    deadline = time.monotonic() + 10
    while gpu_threads() and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert not gpu_threads()


@pytest.mark.parametrize("decoder", [BACKEND, "serialising"])  # slow: calls still queued
def test_an_epoch_left_early_keeps_the_persistent_workers(store, decoder):
    dl = make(store, num_workers=2, persistent_workers=True, decoder=decoder)
    it = iter(dl)
    next(it)
    pids = dl.worker_pids
    it.close()  # as a generator around the loader does when it is closed
    assert dl.worker_pids == pids and not gpu_threads()
    assert sorted(flat(epoch(dl), 2).tolist()) == list(range(NUM_SAMPLES))
    dl.close()


def test_close_mid_epoch_stops_the_thread_and_the_workers(store):
    dl = make(store, num_workers=2, with_indices=False)
    it = iter(dl)
    images, labels = next(it)  # two tensors without with_indices
    assert images.shape == (B, 3, SIZE, SIZE) and labels.shape == (B,)
    dl.close()
    assert dl.worker_pids == []
    assert not gpu_threads()
    with pytest.raises(RuntimeError, match=r"this iterator was ended by close\(\)"):
        next(it)


def test_ctrl_c_while_waiting_stops_the_thread_and_the_workers(store, monkeypatch):
    dl = make(store, num_workers=2)
    it = iter(dl)
    next(it)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(it, "_take_finished", interrupted)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert dl.worker_pids == []
    assert not gpu_threads()


@gpu_only
def test_a_failed_handoff_stops_the_thread_and_the_workers(store, monkeypatch):
    dl = make(store, num_workers=2)
    it = iter(dl)
    next(it)

    def failed(*_args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(it, "_hand_over", failed)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        next(it)
    assert dl.worker_pids == [] and not gpu_threads()
    with pytest.raises(StopIteration):  # as a generator after it raised
        next(it)


class _Used:
    """A stand-in for a batch's tensor on a GPU: the streams it was marked as used by."""

    device = torch.device("cuda", 0)

    def __init__(self) -> None:
        self.streams: list = []

    def record_stream(self, stream) -> None:
        self.streams.append(stream)


class _TrainingStream:
    def __init__(self) -> None:
        self.waited: list = []

    def query(self) -> bool:  # work still queued: the model was not starved
        return False

    def wait_event(self, event) -> None:
        self.waited.append(event)


class _QueriedEvent:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_a_handoff_waits_only_for_gpu_work_still_running(monkeypatch):
    # The training stream waits for a batch's event only while its GPU work runs: waiting
    # lets the GIL go (torch's Event.wait), querying does not. Either way both tensors are
    # marked as used by the training stream, for the allocator.
    stream = _TrainingStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    stats = LoaderStats()
    it = type("It", (), {})()
    it._stats = stats
    events = [_QueriedEvent(True), _QueriedEvent(False), _QueriedEvent(True)]
    tensors = []
    for event in events:
        images, labels = _Used(), _Used()
        GpuEpochIterator._hand_over(it, images, labels, event)
        tensors += [images, labels]
    assert stream.waited == [events[1]]
    assert all(t.streams == [stream] for t in tensors)
    totals = stats.snapshot()
    assert totals["pending_handoffs"] == 1 and totals["starved_handoffs"] == 0


def test_close_with_stopped_workers_returns_promptly(store):
    dl = make(store, num_workers=2, batch_size=2)
    it = iter(dl)
    next(it)
    for pid in dl.worker_pids:
        os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    dl.close()
    assert time.monotonic() - start < 5.0  # the thread leaves at its next poll of the workers
    assert dl.worker_pids == [] and not gpu_threads()


def test_the_training_process_never_takes_over_stderr(store, monkeypatch):
    import loader.cpu.decode

    def no(*args):
        raise AssertionError("fd 2 redirected in the training process")

    monkeypatch.setattr(loader.cpu.decode, "captured", no)
    # Every sample through the CPU decoder, in the main process (num_workers=0).
    got = epoch(make(store, num_workers=0, cpu_share=1.0))
    assert sorted(flat(got, 2).tolist()) == list(range(NUM_SAMPLES))


def test_timeout_covers_the_gpu_stage(store, monkeypatch):
    dl = make(store, num_workers=2, timeout=0.5)
    real = dl._gpu_stage.decoder.decode_batch

    def hung(*args, **kwargs):
        time.sleep(3)  # a GPU call that does not return
        return real(*args, **kwargs)

    monkeypatch.setattr(dl._gpu_stage.decoder, "decode_batch", hung)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"timed out after 0.5 seconds waiting for a batch"):
        next(iter(dl))
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("share", [0.0, "auto"])
@pytest.mark.parametrize("closed", [True, False])
def test_a_loader_let_go_is_freed_at_once_with_its_gpu_stage(store, share, closed):
    """No reference cycle holds a GPU-path loader, its iterator or its stage once the
    training code lets go of them, mid-epoch, closed or not: reference counting frees
    them, not a full collection, which a long run may not see for hours while the stage
    holds device memory (DALI's pipelines: 670 MiB for each loader built again after a
    preemption, ``benchmarks/soak.py`` on the H200). Among the cycles there were: a
    producer holding the stage's bound method, and the prefetch thread's frame holding
    the error that stopped it, whose traceback holds that frame."""
    epoch(make(store, transform=TRAIN, cpu_share=share))  # first imports done
    with collector_off():
        dl = make(store, transform=TRAIN, cpu_share=share, persistent_workers=True)
        epoch(dl)
        it = iter(dl)
        next(it)
        if closed:
            dl.close()
        refs = [weakref.ref(dl), weakref.ref(dl._gpu_stage), weakref.ref(it)]
        del dl, it
        assert all_freed(refs)


@pytest.mark.parametrize("share", [0.0, "auto"])
def test_a_loader_let_go_after_an_epoch_read_to_its_end_is_freed_at_once(store, share):
    """With persistent workers the loader keeps the iterator of an epoch read to its end
    (it goes on into the next epoch's batches): the two held each other, so a loader let
    go of then was freed only by a full collection, its thread and workers going on
    meanwhile. Freed at once now, and its threads end."""
    epoch(make(store, transform=TRAIN, cpu_share=share))  # first imports done
    with collector_off():
        dl = make(store, transform=TRAIN, cpu_share=share, persistent_workers=True)
        it = iter(dl)
        got = list(it)  # read to its end: parked, on into the next epoch
        assert dl._carry is it and sorted(flat(got, 2).tolist()) == list(range(NUM_SAMPLES))
        threads = [it._thread, *it._decoder._threads]
        refs = [weakref.ref(dl), weakref.ref(dl._gpu_stage), weakref.ref(it)]
        del dl, it, got
        assert all_freed(refs)
        for thread in threads:
            thread.join(10)
        assert not [thread.name for thread in threads if thread.is_alive()]


@pytest.mark.parametrize("bounded", [False, True], ids=["loader-only-in-loop", "zip"])
def test_a_loader_held_only_by_its_loop_or_let_go_after_a_bounded_loop(store, bounded):
    """``for batch in DataLoader(...)`` reads every sample once and ends (the iterator
    lets go of the loader with the last batch); after a loop bounded by ``len(loader)``
    a loader let go of is freed at once. Its threads end either way."""
    epoch(make(store, transform=TRAIN))  # first imports done
    with collector_off():
        dl = make(store, transform=TRAIN, persistent_workers=True)
        ref = weakref.ref(dl)
        if bounded:
            got = [b for _, b in zip(range(len(dl)), dl, strict=False)]
            it = dl._read
            del dl
        else:
            it = iter(dl)
            del dl
            got = []
            for batch in it:
                got.append(batch)
        assert sorted(flat(got, 2).tolist()) == list(range(NUM_SAMPLES))
        threads = [it._thread, *it._decoder._threads]
        del it
        assert all_freed([ref])
        for thread in threads:
            thread.join(10)
        assert not [thread.name for thread in threads if thread.is_alive()]


def test_an_iterator_read_whole_by_a_bounded_loop_closes_after_its_loader_went(store):
    """Only the iterator kept, read to its last batch by a loop bounded by its length: its
    loader is freed, and closing it is no error and ends its threads (before, the close
    raised LoaderGone and the decode threads went on while the iterator was kept)."""
    epoch(make(store, transform=TRAIN))  # first imports done
    with collector_off():
        dl = make(store, transform=TRAIN, persistent_workers=True)
        ref = weakref.ref(dl)
        it = iter(dl)
        del dl
        got = list(itertools.islice(it, len(it)))
        assert sorted(flat(got, 2).tolist()) == list(range(NUM_SAMPLES)) and all_freed([ref])
        threads = [it._thread, *it._decoder._threads]
        it.close()
        for thread in threads:
            thread.join(10)
        assert not [thread.name for thread in threads if thread.is_alive()]
        with pytest.raises(StopIteration):
            next(it)


def test_an_error_from_the_gpu_stage_holds_nothing_once_handled(store, monkeypatch):
    """An error the stage raised (not a GPU one: raised as it is) reaches the loop without
    a reference cycle: it was made its own cause, and its traceback held the iterator, the
    loader and the stage until a full collection."""
    epoch(make(store, transform=TRAIN))  # first imports done
    with collector_off():
        dl = make(store, transform=TRAIN, cpu_share=0.0)

        def fails(*args, **kwargs):
            raise RuntimeError("a decoder's own failure")

        monkeypatch.setattr(dl._gpu_stage.decoder, "decode_batch", fails)
        it = iter(dl)
        try:
            next(it)
        except RuntimeError as e:
            assert str(e) == "a decoder's own failure" and e.__cause__ is not e
        refs = [weakref.ref(dl), weakref.ref(dl._gpu_stage), weakref.ref(it)]
        monkeypatch.undo()
        del dl, it, fails
        assert all_freed(refs)


FIRST_IMPORT = """
import gc, sys, weakref
import torch
from loader.gpu.nvjpeg import import_torchvision_io
assert "torchvision" not in sys.modules
gc.disable()

class Marker:
    pass

def builds():  # as DataLoader.__init__, whose call first imports torchvision
    marker = Marker()
    io = import_torchvision_io()
    return weakref.ref(marker), io

ref, io = builds()
print(ref() is None, callable(io.decode_jpeg))
"""


def test_the_first_import_of_torchvision_keeps_no_frame_of_its_caller():
    """torchvision's first import leaves a frame that refers to itself, holding every frame
    up the stack until a collection: the loader being built, where building it imported
    torchvision (the nvjpeg decoder), was not freed when let go of."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_IMPORT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True"]


def test_close_lets_go_of_the_gpu_stage_and_a_later_epoch_has_every_sample(store):
    dl = make(store, transform=TRAIN, cpu_share="auto", persistent_workers=True)
    epoch(dl)
    it = iter(dl)
    next(it)
    stage, picker = dl._gpu_stage, dl._gpu_stage.picker
    assert stage._in_flight  # the images of the last batches, kept for their kernels
    dl.close()
    assert not stage._in_flight and not stage.routing.pending and not stage.abandoned
    assert dl._gpu_stage is stage and stage.picker is picker  # what it measured stays
    got = epoch(dl)  # the rest of the epoch cut short: it started again, whole
    assert sorted(flat(got, 2).tolist()) == list(range(NUM_SAMPLES))
    assert flat(got, 1).tolist() == Store(store).labels[flat(got, 2).numpy()].tolist()


class _Stream:
    def __init__(self, index: int) -> None:
        self.device = torch.device("cuda", index)


def test_the_stream_pool_lends_again_what_was_given_back_by_role_and_device(monkeypatch):
    made = []
    monkeypatch.setattr(
        torch.cuda, "Stream", lambda index, priority: made.append(index) or _Stream(index)
    )
    pool = loader.gpu.streams.StreamPool()
    gpu0, gpu1 = torch.device("cuda", 0), torch.device("cuda", 1)
    lent = {"finish": pool.lend(gpu0, "finish"), "decode": pool.lend(gpu0, "decode")}
    first = dict(lent)
    other = pool.lend(gpu1, "finish")
    assert made == [0, 0, 1] and len({id(s) for s in (*first.values(), other)}) == 3
    pool.give_back(lent)
    pool.give_back(lent)  # emptied by the first: nothing given twice
    assert lent == {}
    assert pool.lend(gpu1, "finish") is not first["finish"]  # another device: a new one
    assert pool.lend(gpu0, "decode") is first["decode"]
    assert pool.lend(gpu0, "finish") is first["finish"]
    assert pool.lend(gpu0, "finish") is not first["finish"] and made == [0, 0, 1, 1, 0]


@gpu_only
def test_a_loader_built_again_reuses_the_streams_and_memory_of_the_one_closed(store):
    """A rebuild after a preemption (close, a new loader) allocates where the loader before
    it did: torch's allocator reuses a block only on the stream it was made on."""

    def rebuilt(dl):
        dl.close()
        new = make(
            store, transform=TRAIN, dtype=torch.bfloat16, persistent_workers=True, cpu_share=0.0
        )  # the same work every time: no trials of ways
        epoch(new)
        return new

    dl = make(store, transform=TRAIN, dtype=torch.bfloat16, persistent_workers=True, cpu_share=0.0)
    epoch(dl)
    other = make(store, transform=TRAIN, persistent_workers=True)  # alive: its own streams
    streams = (dl._gpu_stage.stream, dl._gpu_stage.decode_stream)
    assert not {other._gpu_stage.stream, other._gpu_stage.decode_stream} & set(streams)
    dl = rebuilt(dl)
    assert (dl._gpu_stage.stream, dl._gpu_stage.decode_stream) == streams
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    for _ in range(3):
        dl = rebuilt(dl)
    torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    dl.close()
    assert (other._gpu_stage.stream, other._gpu_stage.decode_stream) != streams
    assert sorted(flat(epoch(dl), 2).tolist()) == list(range(NUM_SAMPLES))  # streams again
    other.close()


def test_close_leaves_a_stage_a_hung_thread_may_still_be_in(store, monkeypatch):
    """A prefetch thread that does not stop within the wait for it may still be in the
    stage: ``close`` then lets go of nothing of the stage's (the thread would use it)."""
    import loader.gpu.prefetch

    monkeypatch.setattr(loader.gpu.prefetch, "_JOIN_S", 0.2)
    dl = make(store, transform=TRAIN, num_workers=2, shuffle=False)
    real = dl._gpu_stage._decode
    entered, returns = threading.Event(), threading.Event()

    def hung(views, *args):
        # The last batch (samples 16-22; not the first, which the loop waits for: on CUDA
        # two decode threads start the first two batches at once, in either order) does
        # not return until the close is over.
        if 16 in views["indices"].tolist():
            entered.set()
            returns.wait(30)
        return real(views, *args)

    monkeypatch.setattr(dl._gpu_stage, "_decode", hung)
    it = iter(dl)
    next(it)
    assert entered.wait(30)
    stage = dl._gpu_stage
    held = {id(item) for item in stage._in_flight}  # (the thread may still add one)
    threads = [it._thread, *it._decoder._threads]
    try:
        dl.close()
        assert stage.abandoned and held and held <= {id(item) for item in stage._in_flight}
    finally:
        returns.set()
    # Once the call returns, the threads left behind end.
    for thread in threads:
        thread.join(10)
    assert not [thread.name for thread in threads if thread.is_alive()]


def test_a_loader_left_open_is_closed_at_exit_before_earlier_exit_hooks(store):
    """Before the hooks registered before it (DALI's shuts its pipelines down): the
    workers are stopped when an earlier hook runs."""
    done = exits_without_closing(store, BACKEND)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["read", "workers at the earlier hook: None"]


@pytest.mark.parametrize(
    "batch, workers, prefetch, on_gpu, slots",
    [
        (256, 16, 2, 2, 6),  # 4 tasks a batch: 4 batches keep 16 workers busy, +2 on the GPU
        (256, 16, 2, 3, 7),  # two decode threads: one more batch on the GPU
        (256, 32, 2, 2, 10),
        (256, 2, 2, 2, 4),  # 2 tasks a batch: prefetch depth decides
        (256, 2, 1, 3, 4),  # or the batches on the GPU, plus one for the workers
        (64, 64, 2, 2, 16),  # a task a batch: capped
        (256, 0, 2, 2, 1),  # no workers: the prefetch thread gathers in place
    ],
)
def test_the_ring_keeps_every_worker_busy(batch, workers, prefetch, on_gpu, slots):
    assert ring_slots(batch, workers, prefetch, on_gpu) == slots


def test_gathering_rows_into_a_buffer_matches_numpy():
    from loader.gpu.host_arrays import Rows, copy_holding_gil, gather

    pixels = np.random.default_rng(0).integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)
    rows = np.array([4, 0, 5, 4])
    target = np.zeros((4, 5, 4, 3), dtype=np.uint8)
    gather(Rows(pixels, rows), target)
    assert np.array_equal(target, pixels[rows])
    strided = pixels[:, :, ::2]  # not contiguous: numpy gathers it
    target = np.zeros((4, 5, 2, 3), dtype=np.uint8)
    gather(Rows(strided, rows), target)
    assert np.array_equal(target, strided[rows])
    params = np.arange(48, dtype=np.int32).reshape(3, 16)
    into = np.zeros(48 * 4, dtype=np.uint8).view(np.int32).reshape(3, 16)
    copy_holding_gil(into, params)
    assert np.array_equal(into, params)
    copy_holding_gil(into, np.asfortranarray(params))  # any layout of the source
    assert np.array_equal(into, params)
    copy_holding_gil(np.zeros((0, 16), np.int32), np.zeros((0, 16), np.int32))  # empty: no-op
    gather(Rows(pixels, np.zeros(0, np.int64)), np.zeros((0, 5, 4, 3), np.uint8))


@pytest.mark.parametrize(
    "starts, lengths",
    [
        ([0, 5, 9], [5, 4, 3]),  # packed back to back
        ([2, 9, 20], [3, 0, 7]),  # gaps (CPU-decoded rows between), an empty span
        ([10, 0, 4], [3, 4, 2]),  # out of order: sliced one by one
        ([0, 3], [5, 4]),  # overlapping: sliced one by one
        ([], []),
    ],
)
def test_cutting_spans_out_of_a_slot_matches_slicing(starts, lengths):
    from loader.gpu.host_arrays import cut

    data = torch.arange(40, dtype=torch.uint8)
    pieces = cut(data, starts, lengths)
    assert [p.tolist() for p in pieces] == [
        data[s : s + m].tolist() for s, m in zip(starts, lengths, strict=True)
    ]
    assert all(
        p.data_ptr() == data.data_ptr() + s for p, s in zip(pieces, starts, strict=True) if len(p)
    )
    as_numpy = cut(data.numpy(), starts, lengths)  # what a decoder fed numpy arrays gets
    assert [p.tolist() for p in as_numpy] == [p.tolist() for p in pieces]


def test_one_copy_unpacks_into_arrays_of_their_shapes_and_dtypes():
    from loader.gpu.host_arrays import Rows, slot_sizes, unpack

    pixels = np.arange(2 * 3 * 2 * 3, dtype=np.uint8).reshape(2, 3, 2, 3)
    arrays = [
        np.array([7, -1, 2**40], dtype=np.int64),
        np.arange(32, dtype=np.int32).reshape(2, 16),
        Rows(pixels, np.array([1])),
        np.array([5, 6, 7], dtype=np.uint8),
    ]
    sizes = slot_sizes(arrays)
    assert sizes == [32, 128, 32, 16]  # each slot starts 16-byte aligned
    flat = np.zeros(sum(sizes), dtype=np.uint8)
    at = 0
    for a, size in zip(arrays, sizes, strict=True):
        data = a.array[a.rows] if isinstance(a, Rows) else a
        flat[at : at + a.nbytes] = np.frombuffer(data.tobytes(), dtype=np.uint8)
        at += size
    got = unpack(torch.from_numpy(flat), arrays, sizes)
    wants = [arrays[0], arrays[1], pixels[[1]], arrays[3]]
    for t, want in zip(got, wants, strict=True):
        assert t.dtype == torch.from_numpy(want).dtype and t.shape == want.shape
        assert np.array_equal(t.numpy(), want)


def test_ragged_windows_are_the_pixels_they_point_at():
    # Two windows side by side in one span, RGB then gray (read three times by a channel
    # stride of 0), joined after a tensor image: each as the kernels and the CPU stand-in
    # see it.
    from loader.gpu.ragged import Ragged

    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    gray = np.arange(100, 106, dtype=np.uint8).reshape(3, 2, 1)
    span = torch.from_numpy(np.concatenate([rgb.ravel(), gray.ravel()]))
    windows = Ragged.windows(span, [0, rgb.size], [2, 3], [3, 2], [3, 1])
    image = torch.arange(3 * 4 * 5, dtype=torch.uint8).view(3, 4, 5)
    joined = Ragged.of([image]).join(windows)
    assert joined.addresses.tolist() == [image.data_ptr(), span.data_ptr(), span.data_ptr() + 18]
    assert joined.strides.tolist() == [[20, 5, 1], [1, 9, 3], [0, 2, 1]]
    first, second, third = joined.tensors()
    assert torch.equal(first, image)
    assert torch.equal(second, torch.from_numpy(rgb).permute(2, 0, 1))
    assert torch.equal(third, torch.from_numpy(gray).permute(2, 0, 1).expand(3, 3, 2))
    assert len(Ragged.empty().join(windows)) == 2 and len(windows.join(Ragged.empty())) == 2


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_a_recipes_colour_steps_and_erasing_act_on_the_cropped_batch(store, dtype, monkeypatch):
    """The same samples and crops as without them; each batch is then the crop's uint8
    pixels through the steps drawn from its seed (BatchSteps: within 1 level of
    torchvision, tests/loader/ops), normalised and erased; the seed decides, and the
    workers draw (the stage reads every batch's draws from its slot). On the CPU
    stand-ins exactly BatchSteps of the plain batch; on CUDA within 1 level on a handful
    of pixels (measured on the H200: 1 level on 0.001% of one sample, the same in two runs;
    the pixel noise, before it was a function of its coordinates, differed in the boxes)."""
    from loader.gpu.step_tables import StepTables
    from loader.gpu.steps import BatchSteps
    from loader.ops.color import ColorJitter, RandomGrayscale
    from loader.ops.erasing import RandomErasing

    steps = (ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), (-0.1, 0.1)), RandomGrayscale(0.3))
    erasing = RandomErasing(0.5, fill="pixel") if dtype.is_floating_point else None
    spec = Transform("train", SIZE, steps=steps, erasing=erasing)
    reads = []
    read = StepTables.read
    monkeypatch.setattr(StepTables, "read", lambda *a: reads.append(1) or read(*a))
    got = epoch(make(store, transform=spec, dtype=dtype))
    assert len(reads) == len(got) == 3  # batches of 8, 8, 7: each drawn in a worker
    again = epoch(make(store, transform=spec, dtype=dtype))
    plain = epoch(make(store, transform=TRAIN, dtype=torch.uint8))
    assert torch.equal(flat(got, 2), flat(plain, 2)) and torch.equal(flat(got, 1), flat(plain, 1))
    assert torch.equal(flat(got, 0), flat(again, 0))
    seeds = batch_seeds(len(plain))
    after = BatchSteps(spec, dtype, torch.contiguous_format)
    want = torch.cat([after(b[0], seed) for b, seed in zip(plain, seeds, strict=True)])
    if DEVICE == "cpu":
        assert torch.equal(flat(got, 0), want)
    else:
        level = 1.0 if dtype == torch.uint8 else 1.0 / (255 * min(TRAIN.std)) + 0.01
        diff = (flat(got, 0).float() - want.float()).abs()
        assert diff.max() <= level and (diff > 0).float().mean() < 1e-3, diff.max()
    unstepped = Transform("train", SIZE, erasing=erasing)
    unstepped = BatchSteps(unstepped, dtype, torch.contiguous_format)
    base = torch.cat([unstepped(b[0], seed) for b, seed in zip(plain, seeds, strict=True)])
    assert not torch.equal(flat(got, 0), base)  # the steps changed pixels

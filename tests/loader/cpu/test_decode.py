"""The CPU decode path: registry, DCT-domain reduction, pixel agreement with torchvision."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from loader_data import NUM_SAMPLES, make_store
from PIL import Image

import loader
from loader.augment import Transform
from loader.cpu.batches import PixelBatches
from loader.cpu.decode import reduction, reductions
from loader.decode import DecodeError, decoders, get_decoder
from loader.store import Store


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("decode"))


@pytest.fixture(scope="module")
def store(store_path):
    s = Store(store_path)
    yield s
    s.close()


def pil_image(store: Store, i: int) -> Image.Image:
    data, _ = store.image(i)
    with Image.open(io.BytesIO(data)) as img:
        return img.convert("RGB")


def special(store: Store, name: str) -> int:
    return next(i for i, p in enumerate(store.paths) if p.endswith(name))


def test_registry():
    assert decoders() == ["cpu", "dali", "nvjpeg"]
    assert get_decoder("cpu").in_workers
    with pytest.raises(ValueError, match=r"decoder='pil' is unknown; known decoders: cpu, dali"):
        get_decoder("pil")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"decoder='nvjpeg' decodes on a CUDA device"):
            get_decoder("nvjpeg", device="cpu")


@pytest.mark.parametrize(
    "window, out, kind, factor",
    [
        ((400, 400), (224, 224), "jpeg", 1),  # shrinks by less than 2: full decode
        ((448, 448), (224, 224), "jpeg", 2),
        ((1000, 460), (224, 224), "jpeg", 2),  # the narrower side decides
        ((1800, 1800), (224, 224), "jpeg", 8),
        ((1000, 1000), (224, 224), "jpeg", 4),
        ((1000, 1000), (224, 224), "png", 1),  # PNG has no DCT to scale
    ],
)
def test_reduction_factor(window, out, kind, factor):
    crop = np.array([0, 0, *window, *out, 0, 0, 0, 0])
    assert reduction(kind, crop) == factor


def test_reductions_match_reduction_row_by_row():
    rng = np.random.default_rng(0)
    crops = np.zeros((500, 10), dtype=np.int32)
    crops[:, 2:4] = rng.integers(1, 2000, (500, 2))
    crops[:, 4:6] = rng.integers(1, 300, (500, 2))
    edges = [  # (h, w, rh, rw): exactly at a factor's bound, and past int32 at 8 x 2^28
        (448, 448, 224, 224), (447, 448, 224, 224), (1792, 1792, 224, 224),
        (1791, 1792, 224, 224), (2**31 - 1, 2**31 - 1, 2**28, 2**28),
    ]  # fmt: skip
    crops[: len(edges), 2:6] = edges
    expected = [reduction("jpeg", row) for row in crops]
    assert expected[: len(edges)] == [2, 1, 8, 4, 4]
    assert reductions(crops).tolist() == expected
    assert set(expected) == {1, 2, 4, 8}
    assert reductions(crops[:0]).tolist() == []


def test_eval_pixels_match_torchvision(store_path, store):
    """transform="eval" against torchvision Resize(256) + CenterCrop(224) on PIL images.

    Measured on these 63 images (real photographs, one grayscale JPEG, one 1100 px JPEG
    decoded at 1/2 scale in the DCT domain, one PNG): mean abs difference 0.45 (uint8
    scale), worst image 1.15, 99th percentile 3, max 35 at a few edge pixels (our Gaussian
    prefilter + bilinear vs PIL's antialiased bilinear). The tolerances leave ~1.7x room;
    plain bilinear without the prefilter (antialias=False) fails them (worst image 2.5).
    """
    tf = T.Compose([T.Resize(256), T.CenterCrop(224), T.PILToTensor()])
    ref = torch.stack([tf(pil_image(store, i)) for i in range(len(store))])
    dl = loader.DataLoader(store_path, batch_size=16, transform="eval", dtype="uint8", device="cpu")
    ours = torch.cat([images for images, _ in dl])
    assert ours.shape == ref.shape == (NUM_SAMPLES, 3, 224, 224)
    diff = (ours.int() - ref.int()).abs().float()
    assert diff.mean() < 0.75
    assert diff.mean(dim=(1, 2, 3)).max() < 2.0
    assert np.percentile(diff.numpy(), 99) <= 8
    png = special(store, "plain.png")
    assert diff[png].mean() < 0.1  # lossless source, same geometry: (nearly) identical


def test_eval_pixels_match_torchvision_bicubic(store_path, store):
    """Transform("eval", interpolation="bicubic") against torchvision Resize(256, BICUBIC) +
    CenterCrop(224) on PIL images, through the loader's CPU path. Measured on these 63
    images: mean abs difference 0.018, worst image 0.91 (the JPEG decoded at 1/2 scale in
    the DCT domain), 99th percentile 0, max 39 at a few edge pixels; the PNG identical. The
    tolerances leave 2x room or more; the bilinear filter fails them (mean 0.44)."""
    bicubic = T.InterpolationMode.BICUBIC
    tf = T.Compose([T.Resize(256, interpolation=bicubic), T.CenterCrop(224), T.PILToTensor()])
    ref = torch.stack([tf(pil_image(store, i)) for i in range(len(store))])
    spec = Transform("eval", interpolation="bicubic")
    dl = loader.DataLoader(store_path, batch_size=16, transform=spec, dtype="uint8", device="cpu")
    diff = (torch.cat([images for images, _ in dl]).int() - ref.int()).abs().float()
    assert diff.mean() < 0.1
    assert diff.mean(dim=(1, 2, 3)).max() < 2.0
    assert np.percentile(diff.numpy(), 99) <= 2
    png = special(store, "plain.png")
    assert diff[png].mean() < 0.1  # lossless source, same geometry: (nearly) identical


# Measured on these 21 crops, mean abs difference (uint8 scale) and worst crop: bilinear
# 0.32 and 1.10 (prefilter + bilinear vs PIL's antialiased bilinear when shrinking; bilinear
# both when enlarging; without the prefilter: 0.51 and 2.6); bicubic 0.03 and 0.36 (PIL's
# filter itself: only the decode differs, at 1/2 scale in the DCT domain). The tolerances
# leave about 2x room.
@pytest.mark.parametrize(
    "interpolation, mean_tol, worst_tol", [("bilinear", 0.75, 2.5), ("bicubic", 0.1, 1.0)]
)
def test_train_pixels_match_torchvision_for_the_same_crop(
    store, interpolation, mean_tol, worst_tol
):
    """The same crop window through our decoder and torchvision's resized_crop + hflip."""
    batches = PixelBatches(store, Transform("train"), batch_size=1)
    decoder = get_decoder("cpu")
    cubic = int(interpolation == "bicubic")
    mode = TF.InterpolationMode(interpolation)
    torch.manual_seed(0)
    diffs = []
    for i in range(0, len(store), 3):
        pil = pil_image(store, i)
        y, x, h, w = T.RandomResizedCrop.get_params(pil, [0.08, 1.0], [3 / 4, 4 / 3])
        flip = i % 2
        ref = TF.resized_crop(pil, y, x, h, w, [224, 224], interpolation=mode, antialias=True)
        ref = np.asarray(TF.hflip(ref) if flip else ref).astype(int)
        out = np.empty((224, 224, 3), np.uint8)
        data, kind = batches.read(i)
        shape = (pil.height, pil.width)
        crop = np.array([y, x, h, w, 224, 224, 0, 0, flip, cubic])
        decoder.decode_into(data, kind, shape, crop, out)
        diffs.append(np.abs(out.astype(int) - ref).mean())
    assert np.mean(diffs) < mean_tol
    assert max(diffs) < worst_tol


@pytest.mark.parametrize(
    "window, size",
    [((250, 380), (224, 224)), ((300, 300), (64, 48)), ((40, 60), (224, 224)),
     ((960, 1000), (32, 32)), ((120, 500), (224, 100))],
    ids=["shrink-1.1-1.3", "shrink-5-6", "enlarge-4-6", "shrink-30", "mixed"],
)  # fmt: skip
def test_bicubic_is_pils_on_the_same_pixels(window, size):
    """The CPU decoder's bicubic resize against PIL's (``Image.resize(BICUBIC,
    reducing_gap=None)``) on views of a photograph (short side in ``window``, cut to at
    most ``window``), PNG-coded so that both resize the same pixels. Measured: max 1-2
    levels, mean at most 0.005 (torch's uint8 kernel is PIL's algorithm); the bilinear
    path is 1.1-3.2 off on average. Without antialias: torch's plain bicubic (a = -0.75),
    within 1 level."""
    from loader.bench.synth import random_view, sample_photos

    rng = np.random.default_rng(sum(window))
    rgb = random_view(cv2.imread(str(sample_photos()[2]), cv2.IMREAD_COLOR_RGB), rng, window)
    rgb = np.ascontiguousarray(rgb[: window[0], : window[1]])
    png = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))[1].tobytes()
    out = {}
    for aa in (True, False):
        for cubic, mode in enumerate(("bilinear", "bicubic")):
            out[aa, mode] = np.empty((*size, 3), np.uint8)
            crop = np.array([0, 0, *rgb.shape[:2], *size, 0, 0, 0, cubic])
            decoder = get_decoder("cpu", antialias=aa)
            decoder.decode_into(png, "png", rgb.shape[:2], crop, out[aa, mode])
    ref = np.asarray(Image.fromarray(rgb).resize(size[::-1], Image.BICUBIC, reducing_gap=None))
    diff = np.abs(out[True, "bicubic"].astype(int) - ref)
    assert diff.max() <= 2 and diff.mean() <= 0.02
    assert np.abs(out[True, "bilinear"].astype(int) - ref).mean() > 0.5  # another filter
    plain = torch.nn.functional.interpolate(
        torch.from_numpy(rgb).permute(2, 0, 1)[None].double(), size, mode="bicubic",
        align_corners=False, antialias=False,
    )  # fmt: skip
    plain = plain.round().clamp(0, 255)[0].permute(1, 2, 0).numpy()
    assert np.abs(out[False, "bicubic"] - plain).max() <= 1


def test_grayscale_jpeg_becomes_rgb(store):
    i = special(store, "gray.JPEG")
    assert store.index["channels"][i] == 1
    batches = PixelBatches(store, Transform("eval"), batch_size=1)
    slot = {"images": np.zeros((1, 224, 224, 3), np.uint8), "indices": np.zeros(1, np.int64)}
    indices = np.array([i])
    batches.fill_rows(slot, 0, indices, batches.plan(indices, seed=0), seed=0)
    img = slot["images"][0]
    assert img.std() > 10  # a real picture, not a blank
    assert (img[..., 0] == img[..., 1]).all() and (img[..., 1] == img[..., 2]).all()


@pytest.mark.parametrize(
    "reason, todo",
    [
        ("does not decode", ": check it with `ingest verify {root}` and rebuild it"),
        ("CRC-32 mismatch; check the store with `ingest verify {root}`", ": rebuild it"),
        ("the header says 9x9; check the store with `ingest verify {root}` and rebuild it", ""),
    ],
)
def test_a_run_of_bad_records_names_the_last_one_and_advises_once(store, monkeypatch, reason, todo):
    """16 records failing in a row stop the batch: the message named the replacement drawn
    after the last failure, not the failure, and repeated the advice its reason gave."""
    batches = PixelBatches(store, Transform("eval"), batch_size=1)
    tried = []

    def read(i):
        tried.append(i)
        raise DecodeError(f"key {i}: {reason.format(root=store.root)}")

    monkeypatch.setattr(batches, "read", read)
    slot = {"images": np.zeros((1, 224, 224, 3), np.uint8), "indices": np.zeros(1, np.int64)}
    indices = np.array([3])
    with pytest.raises(RuntimeError) as raised:
        batches.fill_rows(slot, 0, indices, batches.plan(indices, seed=0), seed=0)
    assert len(tried) == 16 and tried[0] == 3
    last = tried[-1]
    assert str(raised.value) == (
        f"{store.root}: 16 records in a row failed to decode (last: sample {last}, key {last}: "
        f"{reason.format(root=store.root)}); the store looks damaged{todo.format(root=store.root)}"
    )


def test_decode_errors(store):
    decoder = get_decoder("cpu")
    out = np.empty((224, 224, 3), np.uint8)
    crop = np.array([0, 0, 300, 300, 224, 224, 0, 0, 0, 0])
    # In the training process a JPEG is checked in stop-on-warning mode before OpenCV sees
    # it (in a worker, OpenCV decodes under a captured stderr and says "could not decode").
    with pytest.raises(DecodeError, match=r"corrupt JPEG data: .*no end-of-image marker"):
        decoder.decode_into(b"not a jpg", "jpeg", (300, 300), crop, out)
    data, kind = store.image(0)
    h, w = int(store.index["height"][0]), int(store.index["width"][0])
    with pytest.raises(DecodeError, match=rf"differs from the index's {w + 1}x{h}"):
        decoder.decode_into(data, kind, (h, w + 1), crop, out)


def test_a_large_shrink_averages_boxes_before_the_blur(tmp_path, monkeypatch):
    """A PNG (no DCT-domain reduction) shrunk 30-fold: the Gaussian's kernel grows with the
    factor (an 8000-pixel PNG shrunk to 32 px took 26 s of CPU), so boxes are averaged first and
    the blur gets a window 2-3 times the output. Measured against PIL on this photograph
    (1095x960 to 32x32): mean abs difference 0.84 (0.64 without boxes first, the prefilter
    taking 41 ms against 3.6); the tolerance leaves 1.5x room."""
    from loader.bench.synth import make_image_folder

    (path,) = make_image_folder(tmp_path, 1, 1, short_side=(960, 960))
    pil = Image.open(path).convert("RGB")
    png = io.BytesIO()
    pil.save(png, "PNG")
    blurred, real_blur = [], cv2.GaussianBlur

    def blur(img, *args, **kwargs):
        blurred.append(img.shape)
        return real_blur(img, *args, **kwargs)

    monkeypatch.setattr(cv2, "GaussianBlur", blur)
    out = np.empty((32, 32, 3), np.uint8)
    crop = np.array([0, 0, pil.height, pil.width, 32, 32, 0, 0, 0, 0])
    get_decoder("cpu").decode_into(png.getvalue(), "png", (pil.height, pil.width), crop, out)
    ((h, w, _),) = blurred
    assert 64 <= h <= 96 and 64 <= w <= 96 * pil.width // pil.height + 1
    ref = np.asarray(TF.resize(pil, [32, 32], antialias=True)).astype(int)
    assert np.abs(out.astype(int) - ref).mean() < 1.25

"""Test data and stand-ins of the GPU path tests.

Without CUDA (CI), the GPU path's pipeline runs on the CPU: a stand-in batched decoder
(torchvision's CPU ``decode_jpeg``) takes the place of nvjpeg and Triton's interpreter runs
the augmentation kernels, so everything but the CUDA calls themselves is tested. The
images are small, because the interpreter is slow.
"""

from __future__ import annotations

import os
import threading
import time
import warnings

import cv2
import numpy as np
import torch
from PIL import Image

from ingest.build import build
from loader.bench.synth import make_image_folder, random_view, sample_photos
from loader.gpu.nvjpeg import import_torchvision_io

CUDA = torch.cuda.is_available()
if not CUDA:  # before Triton is first imported: its CPU interpreter runs the GPU kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if CUDA else "cpu"
BACKEND = "nvjpeg" if CUDA else "tvcpu"
SIZE = 64 if CUDA else 16  # output side; the interpreter needs tiny batches
SHORT_SIDE = (300, 450) if CUDA else (24, 40)
CLASSES, PER_CLASS = 2, 10
EXTRA = 3  # a PNG, a progressive JPEG and a grayscale JPEG: routed to the CPU or handled
NUM_SAMPLES = CLASSES * PER_CLASS + EXTRA


def make_small_store(root):
    """Build ``root/store`` from 23 small images (20 baseline JPEGs and the extras)."""
    src = root / "src"
    make_image_folder(src, CLASSES, PER_CLASS, seed=3, short_side=SHORT_SIDE)
    rng = np.random.default_rng(3)
    photo = cv2.imread(str(sample_photos()[1]), cv2.IMREAD_COLOR)
    view = random_view(photo, rng, SHORT_SIDE)
    cv2.imwrite(str(src / "class_00" / "zz_plain.png"), view)
    prog = [cv2.IMWRITE_JPEG_PROGRESSIVE, 1, cv2.IMWRITE_JPEG_QUALITY, 90]
    progressive = random_view(photo, rng, SHORT_SIDE)
    cv2.imwrite(str(src / "class_01" / "zz_progressive.JPEG"), progressive, prog)
    gray = cv2.cvtColor(random_view(photo, rng, SHORT_SIDE), cv2.COLOR_BGR2GRAY)
    cv2.imwrite(str(src / "class_01" / "zz_gray.JPEG"), gray, [cv2.IMWRITE_JPEG_QUALITY, 90])
    store = root / "store"
    build(src, store, workers=2, progress=False)
    return store


class TorchvisionCpuBatchDecoder:
    """Stand-in for a GPU batch decoder on the CPU: torchvision's libjpeg decode."""

    name = "tvcpu"
    in_workers = False
    devices = ("cpu",)

    def __init__(self, device=None, antialias: bool = True, batch_size=None) -> None:
        io = import_torchvision_io()  # as the nvjpeg decoder imports it
        self._decode, self._mode = io.decode_jpeg, io.ImageReadMode.RGB

    def decode_batch(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | None]:
        out = []
        for data in encoded:
            try:
                with warnings.catch_warnings():  # torchvision 0.29 deprecates its decoders
                    warnings.simplefilter("ignore", DeprecationWarning)
                    out.append(self._decode(data, mode=self._mode))
            except RuntimeError:
                out.append(None)
        return out


class SerialisingDecoder:
    """The test backend (nvjpeg on CUDA, the CPU stand-in otherwise), one call at a time
    like torchvision's (a mutex), each taking at least ``SLOW_S``; counts how many threads
    were inside ``decode_batch`` at once."""

    name = "serialising"
    in_workers = False
    devices = ("cuda",) if CUDA else ("cpu",)
    concurrent_calls = 2
    SLOW_S = 0.05
    most_inside = 0
    _inside = 0
    _count_lock = threading.Lock()
    _mutex = threading.Lock()

    def __init__(self, device=None, antialias: bool = True, batch_size=None) -> None:
        from loader.decode import get_decoder

        self._inner = get_decoder(BACKEND, device=device)

    def decode_batch(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | None]:
        cls = type(self)
        with cls._count_lock:
            cls._inside += 1
            cls.most_inside = max(cls.most_inside, cls._inside)
        try:
            with cls._mutex:
                time.sleep(cls.SLOW_S)
                return self._inner.decode_batch(encoded)
        finally:
            with cls._count_lock:
                cls._inside -= 1


def pil_resized_crop(
    rgb: np.ndarray, crop, size: tuple[int, int], interpolation: str = "bilinear"
) -> np.ndarray:
    """Reference: PIL's antialiased bilinear (or bicubic) resize of the crop window,
    cropped, flipped."""
    y, x, h, w, rh, rw, oy, ox, flip = (int(v) for v in crop[:9])
    img = Image.fromarray(rgb).crop((x, y, x + w, y + h))
    mode = Image.BICUBIC if interpolation == "bicubic" else Image.BILINEAR
    out = np.array(img.resize((rw, rh), mode, reducing_gap=None))
    out = out[oy : oy + size[0], ox : ox + size[1]]
    return np.ascontiguousarray(out[:, ::-1] if flip else out)


STAND_INS = {  # registry name -> this module's class, for the runs without CUDA
    "tvcpu": "gpu_path_data:TorchvisionCpuBatchDecoder",
    "dalicpu": "gpu_path_data:DaliCpuDecoder",
}
TEST_DECODERS = {"serialising": "gpu_path_data:SerialisingDecoder"}  # CUDA or not


def use_stand_ins(monkeypatch) -> None:
    """Register the test decoders, and without CUDA the CPU stand-ins of the GPU
    decoders, for one test."""
    import loader.decode as registry

    for name, target in {**TEST_DECODERS, **({} if CUDA else STAND_INS)}.items():
        monkeypatch.setitem(registry._BACKENDS, name, target)


def dali_backend() -> str:
    """The DALI decoder's registry name here: "dali" on CUDA; without CUDA a stand-in
    running DALI's CPU decoder ("dalicpu", registered by the tests that use it)."""
    return "dali" if CUDA else "dalicpu"


def _dali_cpu_decoder():
    from loader.gpu.dali_decode import DaliDecoder

    class DaliCpuDecoder(DaliDecoder):
        """The DALI decoder with DALI's CPU operators, where there is no GPU."""

        name = "dalicpu"
        devices = ("cpu",)

    return DaliCpuDecoder


def __getattr__(name: str):  # "gpu_path_data:DaliCpuDecoder" for the decoder registry
    if name == "DaliCpuDecoder":
        return _dali_cpu_decoder()
    raise AttributeError(name)

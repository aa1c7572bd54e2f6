"""The CPU path's delivery to a CUDA device: the same batches as on the CPU, converted on
the GPU. (The GPU path, which decoder="auto" picks on CUDA, is tested in test_gpu_path.py.)"""

from __future__ import annotations

import pytest
import torch
from loader_data import make_store

import loader

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("cuda"))


def batches(store, **kwargs) -> list:
    args = {"batch_size": 16, "transform": "train", "shuffle": True, "seed": 1, "decoder": "cpu"}
    dl = loader.DataLoader(store, **{**args, **kwargs})
    return [tuple(t.cpu() for t in b) for b in dl]


def test_default_device_is_cuda(store):
    images, labels = next(iter(loader.DataLoader(store, batch_size=4, transform="eval")))
    assert images.device.type == labels.device.type == "cuda"


@pytest.mark.parametrize("pin_memory", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize(
    "dtype, tol",
    [(torch.float32, 1e-5), (torch.float16, 4e-3), (torch.bfloat16, 2e-2), (torch.uint8, 0)],
)
def test_cuda_batches_equal_cpu_batches(store, dtype, tol, channels_last, pin_memory):
    kw = {"dtype": dtype, "channels_last": channels_last, "num_workers": 2}
    on_cpu = batches(store, device="cpu", **kw)
    dl = loader.DataLoader(
        store,
        batch_size=16,
        transform="train",
        shuffle=True,
        seed=1,
        device="cuda",
        pin_memory=pin_memory,
        decoder="cpu",  # the CPU path's delivery to CUDA (the GPU path: test_gpu_path.py)
        **kw,
    )
    on_gpu = list(dl)
    assert len(on_gpu) == len(on_cpu) == 4
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for (gi, gl), (ci, cl) in zip(on_gpu, on_cpu, strict=True):
        assert gi.device.type == gl.device.type == "cuda"
        assert gi.dtype == dtype and gi.is_contiguous(memory_format=fmt)
        assert torch.equal(gl.cpu(), cl)
        assert torch.allclose(gi.cpu().float(), ci.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("pin_memory", [False, True])
def test_stats_count_and_time_the_copies_to_the_device(store, pin_memory):
    dl = loader.DataLoader(
        store, batch_size=16, transform="train", device="cuda", decoder="cpu",
        dtype=torch.float16, pin_memory=pin_memory, num_workers=2,
    )  # fmt: skip
    n = sum(len(labels) for _, labels in dl)
    stats = dl.stats()
    h, w = dl.transform.size
    # uint8 pixels cross to the device (converted there), then int64 labels.
    assert stats["h2d_bytes"] == n * (3 * h * w + 8)
    assert stats["h2d_s"] > 0.0

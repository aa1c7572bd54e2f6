"""BatchOutput on the CPU: one conversion table, the same result with any number of threads."""

from __future__ import annotations

import pytest
import torch

from loader.augment import Transform
from loader.cpu.output import BatchOutput


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("channels_last", [False, True])
def test_threads_split_the_batch_without_changing_it(dtype, channels_last):
    # The ring slot is [N, 3, H, W] for NCHW outputs and [N, H, W, 3] for channels_last.
    shape = (37, 40, 48, 3) if channels_last else (37, 3, 40, 48)
    pixels = torch.randint(0, 256, shape, dtype=torch.uint8)
    cpu = torch.device("cpu")
    one = BatchOutput(Transform("eval"), dtype, channels_last, cpu, False, threads=1)
    four = BatchOutput(Transform("eval"), dtype, channels_last, cpu, False, threads=4)
    a, b = one.images(pixels), four.images(pixels)
    four.close()
    assert a.shape == b.shape == (37, 3, 40, 48) and torch.equal(a, b)
    nchw = pixels.permute(0, 3, 1, 2) if channels_last else pixels
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)
    expect = nchw if dtype == torch.uint8 else ((nchw / 255.0 - mean) / std).to(dtype)
    assert torch.equal(a, expect) if dtype != torch.float32 else torch.allclose(a, expect)

"""HostMemory: a batch's memory is reused only once nothing refers to it any more."""

from __future__ import annotations

import pytest
import torch

import loader.hostmem
from loader.hostmem import HostMemory, trim_heap

SHAPE = (8, 3, 224, 224)  # 4.8 MB of float32: above the size that is recycled


def test_freed_batches_are_reused():
    mem = HostMemory()
    a = mem.empty(SHAPE, torch.float32)
    ptr = a.data_ptr()
    del a
    assert mem.empty(SHAPE, torch.float32).data_ptr() == ptr


def test_memory_in_use_is_never_reused():
    mem = HostMemory(keep=8)
    w = torch.randn(2, 3, 1, 1, requires_grad=True)
    holders = []
    for hold in (
        lambda t: t,  # the tensor itself
        lambda t: t[1],  # a view
        lambda t: t.numpy(),  # a numpy array over it
        lambda t: t.untyped_storage(),  # its storage
        lambda t: torch.nn.functional.conv2d(t, w),  # an autograd graph that saved it
    ):
        t = mem.empty(SHAPE, torch.float32)
        t.fill_(len(holders))
        holders.append(hold(t))
        del t
    fresh = mem.empty(SHAPE, torch.float32).fill_(-1)
    ptrs = {
        h.data_ptr() if isinstance(h, (torch.Tensor, torch.UntypedStorage)) else h.ctypes.data
        for h in holders[:4]
    }
    assert fresh.data_ptr() not in ptrs and len(ptrs) == 4
    assert holders[0].eq(0).all() and holders[1].eq(1).all() and (holders[2] == 2).all()
    holders[4].sum().backward()  # the saved input is intact: the gradient sees 4.0s
    assert torch.allclose(w.grad, torch.full_like(w.grad, 4.0 * 8 * 224 * 224))


def test_other_sizes_and_small_batches():
    mem = HostMemory()
    a = mem.empty(SHAPE, torch.float32)
    b = mem.empty((4, 3, 224, 224), torch.float32)  # another size: another mapping
    assert a.data_ptr() != b.data_ptr()
    small = mem.empty((2, 3, 8, 8), torch.float32)  # below the threshold: torch.empty
    assert small.shape == (2, 3, 8, 8)


def _anonymous_mib() -> float:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) / 1024 for line in f if line.startswith("Anonymous:"))


@pytest.mark.skipif(loader.hostmem._MALLOC_TRIM is None, reason="malloc_trim is glibc's")
def test_trim_heap_gives_back_what_malloc_keeps_free():
    """A heap freed but for one block in 200 (as a DALI pipeline's threads leave theirs)
    stays resident; ``trim_heap`` gives it back."""
    blocks = [bytes(1000) + bytes([i % 256]) for i in range(200_000)]  # 200 MB, in malloc
    kept = blocks[::200]
    del blocks
    before = _anonymous_mib()
    assert trim_heap()
    assert before - _anonymous_mib() > 150, "freed memory still resident after trim_heap"
    assert len(kept) == 1000

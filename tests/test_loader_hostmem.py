"""HostMemory: a batch's memory is reused only once nothing refers to it any more."""

from __future__ import annotations

import torch

from loader.hostmem import HostMemory

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

"""Triton kernel of ``loader.gpu.normalise``: a uint8 batch normalised, cast and erased.

A program handles a tile of one sample's pixels, all three channels: each value is the
pixel's level looked up in its channel's row of the 256 levels' normalised values
(float32), or, inside the sample's erasing box, the fill: a constant, or
``loader.ops.noise``'s normal noise of (key, channel) or (key, channel, row, column), the
same integer hash and float64 Box-Muller. Then it is cast to the output's dtype and
written with the output's strides (channels-last or not).
Kept at a module's top level: Triton resolves helpers from globals.
"""

import triton
import triton.language as tl

NONE, CONST, CHANNEL, PIXEL = (tl.constexpr(k) for k in range(4))  # the fill
BOX_COLS = tl.constexpr(5)  # top, left, height (0: no box), width, the sample's noise key


@triton.jit
def _hash32(x):
    # ``noise._hash32`` on int64 values below 2**32: products stay below 2**63
    mask = tl.full([], 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * tl.full([], 0x7FEB352D, tl.int64)) & mask
    x = x ^ (x >> 15)
    x = (x * tl.full([], 0x5BD1E995, tl.int64)) & mask
    return x ^ (x >> 16)


@triton.jit
def _normal(key, index):
    # ``noise.normal``'s value at flat ``index`` for the sample ``key``: float32
    first = _hash32(key ^ _hash32(index & tl.full([], 0xFFFFFFFF, tl.int64)))
    second = _hash32(first ^ tl.full([], 0x68E31DA4, tl.int64))
    unit = tl.full([], 2.3283064365386963e-10, tl.float64)  # 2 ** -32
    u1 = (first.to(tl.float64) + 0.5) * unit
    u2 = (second.to(tl.float64) + 0.5) * unit
    two_pi = tl.full([], 6.283185307179586, tl.float64)
    return (tl.sqrt(-2.0 * tl.log(u1)) * tl.cos(two_pi * u2)).to(tl.float32)


@triton.jit
def normalise_erase(
    src, dst, levels, boxes, H, W, s_n, s_c, s_h, s_w, d_n, d_c, d_h, d_w, fill0, fill1, fill2,
    FILL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(1).to(tl.int64)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H * W
    y = offs // W
    x = offs % W
    inside = offs < 0  # no lane
    key = tl.full([], 0, tl.int64)
    if FILL != NONE:
        row = boxes + b * BOX_COLS
        top = tl.load(row)
        left = tl.load(row + 1)
        inside = (y >= top) & (y < top + tl.load(row + 2))
        inside = inside & (x >= left) & (x < left + tl.load(row + 3))
        key = tl.load(row + 4)
    at = src + b * s_n + y * s_h + x * s_w
    to = dst + b * d_n + y * d_h + x * d_w
    for c in tl.static_range(3):
        level = tl.load(at + c * s_c, mask=m, other=0).to(tl.int32)
        v = tl.load(levels + c * 256 + level, mask=m, other=0.0)
        if FILL == CONST:
            v = tl.where(inside, fill0 if c == 0 else (fill1 if c == 1 else fill2), v)
        elif FILL == CHANNEL:
            v = tl.where(inside, _normal(key, tl.full([], c, tl.int64)), v)
        elif FILL == PIXEL:  # noqa: SIM102  (a compile-time branch, then a runtime one)
            if tl.max(inside.to(tl.int32), 0) > 0:  # the noise only in a tile the box meets
                index = (c * H + y.to(tl.int64)) * W + x
                v = tl.where(inside, _normal(key, index), v)
        tl.store(to + c * d_c, v.to(dst.dtype.element_ty), mask=m)

"""Triton kernels of ``loader.gpu.fused_layers``: one auto-augmentation layer of a batch.

Each sample's row of the layer table names its one op (a kind below) and its arguments; a
program handles a tile of one sample, so the branch is the same for all its lanes. The
arithmetic is that of the torch ops the CPU path runs (``loader.ops.tone``,
``loader.ops.geometry``): the blends in float32 without fused multiply-adds, the warps'
coordinates, taps and weights as torch's CUDA ``grid_sample`` computes them (nvcc fuses
its multiply-adds; Triton's interpreter, as the CPU, does not). Kept at a module's top
level: Triton resolves helpers from globals.
"""

import triton
import triton.language as tl

# The op kinds of a table row's first column (``fused_layers`` writes them).
COPY, LUT, COLOR, SHARP, WARP, TURN = (tl.constexpr(k) for k in range(6))
AUTOCONTRAST, EQUALIZE, CONTRAST = (tl.constexpr(k) for k in range(6, 9))
COLS = tl.constexpr(12)  # kind, factor, mode, turns, theta (6: [3, 2] row-major), 2 spare


@triton.jit
def _blend(d, v, f):
    # PIL's Image.blend(d, v, f), as ``tone.pil_blend``: (v - d) * f + d, clamped, truncated
    out = (v - d) * f + d
    return tl.minimum(tl.maximum(out, 0.0), 255.0).to(tl.uint8)


@triton.jit
def _rint(c):
    # round half to even (std::nearbyint), for grid_sample's nearest taps (c >= 0; the
    # fraction is exact, where c + 0.5 may round up)
    r = tl.floor(c)
    frac = c - r
    odd = (r.to(tl.int32) & 1) == 1
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    return tl.where(up, r + 1.0, r).to(tl.int32)


@triton.jit
def _cubic_weights(t):
    # torch's get_cubic_upsampling_coefficients(t), A = -0.75
    x1 = t + 1.0
    x2 = 1.0 - t
    x3 = x2 + 1.0
    w0 = tl.fma(tl.fma(tl.fma(-0.75, x1, 3.75), x1, -6.0), x1, 3.0)
    w1 = tl.fma(tl.fma(1.25, t, -2.25) * t, t, 1.0)
    w2 = tl.fma(tl.fma(1.25, x2, -2.25) * x2, x2, 1.0)
    w3 = tl.fma(tl.fma(tl.fma(-0.75, x3, 3.75), x3, -6.0), x3, 3.0)
    return w0, w1, w2, w3


@triton.jit
def _interp(v0, v1, v2, v3, w0, w1, w2, w3):
    return tl.fma(v3, w3, tl.fma(v2, w2, tl.fma(v1, w1, v0 * w0)))


@triton.jit
def _tap(plane, yy, xx, s_h, s_w, H, W, m):
    ok = m & (xx >= 0) & (xx < W) & (yy >= 0) & (yy < H)
    return tl.load(plane + yy * s_h + xx * s_w, mask=ok, other=0).to(tl.float32)


@triton.jit
def _bicubic_row(plane, yy, x_nw, s_h, s_w, H, W, m, w0, w1, w2, w3):
    # one row of the 4 x 4 taps, each coordinate clamped to the border (get_value_bounded)
    y = tl.minimum(tl.maximum(yy, 0.0), H - 1.0).to(tl.int32)
    xa = tl.minimum(tl.maximum(x_nw - 1.0, 0.0), W - 1.0).to(tl.int32)
    xb = tl.minimum(tl.maximum(x_nw, 0.0), W - 1.0).to(tl.int32)
    xc = tl.minimum(tl.maximum(x_nw + 1.0, 0.0), W - 1.0).to(tl.int32)
    xd = tl.minimum(tl.maximum(x_nw + 2.0, 0.0), W - 1.0).to(tl.int32)
    v0 = _tap(plane, y, xa, s_h, s_w, H, W, m)
    v1 = _tap(plane, y, xb, s_h, s_w, H, W, m)
    v2 = _tap(plane, y, xc, s_h, s_w, H, W, m)
    v3 = _tap(plane, y, xd, s_h, s_w, H, W, m)
    return _interp(v0, v1, v2, v3, w0, w1, w2, w3)


@triton.jit
def layer_stats(
    src, table, hist, lows, highs, gray, H, W, s_n, s_c, s_h, s_w, BLOCK: tl.constexpr
):  # fmt: skip
    # The statistics of the samples whose op needs them: each channel's histogram, least and
    # greatest value, and the sum of PIL's luma.
    b = tl.program_id(1)
    kind = tl.load(table + b * COLS).to(tl.int32)
    if kind >= AUTOCONTRAST:
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < H * W
        at = src + b.to(tl.int64) * s_n + (offs // W) * s_h + (offs % W) * s_w
        r = tl.load(at, mask=m, other=0).to(tl.int32)
        g = tl.load(at + s_c, mask=m, other=0).to(tl.int32)
        bl = tl.load(at + 2 * s_c, mask=m, other=0).to(tl.int32)
        luma = (r * 19595 + g * 38470 + bl * 7471 + 32768) >> 16
        tl.atomic_add(gray + b, tl.sum(tl.where(m, luma, 0)).to(tl.int64))
        bins = tl.arange(0, 256)
        for c in tl.static_range(3):
            v = r if c == 0 else (g if c == 1 else bl)
            tl.atomic_min(lows + b * 3 + c, tl.min(tl.where(m, v, 255)))
            tl.atomic_max(highs + b * 3 + c, tl.max(tl.where(m, v, 0)))
            tl.atomic_add(hist + (b * 3 + c) * 256 + bins, tl.histogram(v, 256, mask=m))


@triton.jit
def layer_luts(table, host, hist, lows, highs, gray, luts, count):
    # Each (sample, channel)'s LUT: the host's (pointwise ops), or made from the statistics
    # as ``tone.autocontrast_pil_lut``, ``tone.equalize_lut`` and ``tone.pil_contrast`` do.
    bc = tl.program_id(0)
    b = bc // 3
    kind = tl.load(table + b * COLS).to(tl.int32)
    levels = tl.arange(0, 256)
    out = luts + bc * 256 + levels
    if kind == LUT:
        tl.store(out, tl.load(host + b * 256 + levels))
    elif kind == AUTOCONTRAST:
        low = tl.load(lows + bc).to(tl.float64)
        high = tl.load(highs + bc).to(tl.float64)
        scale = 255.0 / tl.maximum(high - low, 1.0)
        lut = levels.to(tl.float64) * scale + (-low * scale)
        lut = tl.minimum(tl.maximum(lut, 0.0), 255.0).to(tl.int32)  # trunc: lut >= 0
        tl.store(out, tl.where(high > low, lut, levels).to(tl.uint8))
    elif kind == EQUALIZE:
        h = tl.load(hist + bc * 256 + levels)
        cum = tl.cumsum(h, 0)
        last = tl.max(tl.where(h > 0, levels, -1))  # the top level: its count is left out
        top = tl.sum(tl.where(levels == last, h, 0))
        step = (count - top) // 255
        below = cum - h  # cum[i - 1]
        lut = tl.minimum((below + step // 2) // tl.maximum(step, 1), 255)
        tl.store(out, tl.where(step > 0, lut, levels).to(tl.uint8))
    elif kind == CONTRAST:
        total = tl.load(gray + b)
        mean = ((2 * total + count) // (2 * (total * 0 + count))).to(tl.float32)
        f = tl.load(table + b * COLS + 1)
        tl.store(out, _blend(mean, levels.to(tl.float32), f))


@triton.jit
def layer_apply(
    src, dst, table, luts, H, W, s_n, s_c, s_h, s_w, fill0, fill1, fill2,
    GRID64: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # The layer's output (uint8, contiguous [N, 3, H, W]) of a tile of one sample.
    b = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < H * W
    i = offs // W
    j = offs % W
    row = table + b * COLS
    kind = tl.load(row).to(tl.int32)
    base = src + b.to(tl.int64) * s_n
    here = base + i * s_h + j * s_w
    out = dst + b.to(tl.int64) * 3 * H * W + offs
    if kind == WARP:
        mode = tl.load(row + 2).to(tl.int32)
        x0 = j.to(tl.float32) - (W - 1.0) * 0.5  # the pixel centre about the image centre
        y0 = i.to(tl.float32) - (H - 1.0) * 0.5
        if GRID64:  # as ``geometry.grid`` on CUDA: the grid in float64, then float32
            gx = (x0.to(tl.float64) * tl.load(row + 4).to(tl.float64)
                  + y0.to(tl.float64) * tl.load(row + 6).to(tl.float64)
                  + tl.load(row + 8).to(tl.float64)).to(tl.float32)  # fmt: skip
            gy = (x0.to(tl.float64) * tl.load(row + 5).to(tl.float64)
                  + y0.to(tl.float64) * tl.load(row + 7).to(tl.float64)
                  + tl.load(row + 9).to(tl.float64)).to(tl.float32)  # fmt: skip
        else:
            gx = x0 * tl.load(row + 4) + y0 * tl.load(row + 6) + tl.load(row + 8)
            gy = x0 * tl.load(row + 5) + y0 * tl.load(row + 7) + tl.load(row + 9)
        inside = (gx >= -1.0) & (gx < 1.0) & (gy >= -1.0) & (gy < 1.0)
        # grid_sampler_unnormalize, align_corners=False: ((g + 1) * size - 1) / 2, its
        # multiply-add fused as nvcc compiles it (the interpreter rounds twice, as the CPU)
        ix = tl.fma(gx + 1.0, W * 1.0, -1.0) * 0.5  # (Triton's "/" is approximate)
        iy = tl.fma(gy + 1.0, H * 1.0, -1.0) * 0.5
        for c in tl.static_range(3):
            plane = base + c * s_c
            fill = fill0 if c == 0 else (fill1 if c == 1 else fill2)
            if mode == 0:  # nearest, border padding
                xn = _rint(tl.minimum(tl.maximum(ix, 0.0), W - 1.0))
                yn = _rint(tl.minimum(tl.maximum(iy, 0.0), H - 1.0))
                v = _tap(plane, yn, xn, s_h, s_w, H, W, m)
            elif mode == 1:  # bilinear, border padding
                cx = tl.minimum(tl.maximum(ix, 0.0), W - 1.0)
                cy = tl.minimum(tl.maximum(iy, 0.0), H - 1.0)
                fx = tl.floor(cx)
                fy = tl.floor(cy)
                xw = fx.to(tl.int32)
                yn = fy.to(tl.int32)
                nw = (fx + 1.0 - cx) * (fy + 1.0 - cy)
                ne = (cx - fx) * (fy + 1.0 - cy)
                sw = (fx + 1.0 - cx) * (cy - fy)
                se = (cx - fx) * (cy - fy)
                v = _tap(plane, yn, xw, s_h, s_w, H, W, m) * nw
                v = tl.fma(_tap(plane, yn, xw + 1, s_h, s_w, H, W, m), ne, v)
                v = tl.fma(_tap(plane, yn + 1, xw, s_h, s_w, H, W, m), sw, v)
                v = tl.fma(_tap(plane, yn + 1, xw + 1, s_h, s_w, H, W, m), se, v)
                v = tl.floor(tl.minimum(tl.maximum(v, 0.0), 255.0) + 1e-3)  # geometry._TRUNCATE
            else:  # bicubic: taps clamped to the border one by one
                fx = tl.floor(ix)
                fy = tl.floor(iy)
                wx0, wx1, wx2, wx3 = _cubic_weights(ix - fx)
                wy0, wy1, wy2, wy3 = _cubic_weights(iy - fy)
                r0 = _bicubic_row(plane, fy - 1.0, fx, s_h, s_w, H, W, m, wx0, wx1, wx2, wx3)
                r1 = _bicubic_row(plane, fy, fx, s_h, s_w, H, W, m, wx0, wx1, wx2, wx3)
                r2 = _bicubic_row(plane, fy + 1.0, fx, s_h, s_w, H, W, m, wx0, wx1, wx2, wx3)
                r3 = _bicubic_row(plane, fy + 2.0, fx, s_h, s_w, H, W, m, wx0, wx1, wx2, wx3)
                v = _interp(r0, r1, r2, r3, wy0, wy1, wy2, wy3)
                v = tl.floor(tl.minimum(tl.maximum(v, 0.0), 255.0) + 1e-3)
            tl.store(out + c * H * W, tl.where(inside, v, fill).to(tl.uint8), mask=m)
    elif kind == TURN:  # exact quarter turns, as torch.rot90(x, k, (-2, -1))
        k = tl.load(row + 3).to(tl.int32)
        if k == 1:
            si, sj = j, W - 1 - i
        elif k == 2:
            si, sj = H - 1 - i, W - 1 - j
        else:
            si, sj = H - 1 - j, i
        for c in tl.static_range(3):
            v = tl.load(base + c * s_c + si * s_h + sj * s_w, mask=m, other=0)
            tl.store(out + c * H * W, v, mask=m)
    else:
        r = tl.load(here, mask=m, other=0)
        g = tl.load(here + s_c, mask=m, other=0)
        bl = tl.load(here + 2 * s_c, mask=m, other=0)
        if kind == COLOR:
            f = tl.load(row + 1)
            luma = (r.to(tl.int32) * 19595 + g.to(tl.int32) * 38470 + bl.to(tl.int32) * 7471
                    + 32768) >> 16  # fmt: skip
            d = luma.to(tl.float32)
            r = _blend(d, r.to(tl.float32), f)
            g = _blend(d, g.to(tl.float32), f)
            bl = _blend(d, bl.to(tl.float32), f)
        elif kind == SHARP:  # blended with the rounded 3 x 3 smooth, the border kept
            f = tl.load(row + 1)
            inner = m & (i >= 1) & (i < H - 1) & (j >= 1) & (j < W - 1)
            for c in tl.static_range(3):
                plane = base + c * s_c
                v = r if c == 0 else (g if c == 1 else bl)
                total = 4 * v.to(tl.int32)
                for di in tl.static_range(3):
                    for dj in tl.static_range(3):
                        at = plane + (i + di - 1) * s_h + (j + dj - 1) * s_w
                        total += tl.load(at, mask=inner, other=0).to(tl.int32)
                smooth = tl.where(inner, (2 * total + 13) // 26, v.to(tl.int32))
                blended = _blend(smooth.to(tl.float32), v.to(tl.float32), f)
                tl.store(out + c * H * W, blended, mask=m)
        elif kind != COPY:  # a LUT op: the sample's LUT of each channel
            lut = luts + b * 3 * 256
            r = tl.load(lut + r.to(tl.int32), mask=m, other=0)
            g = tl.load(lut + 256 + g.to(tl.int32), mask=m, other=0)
            bl = tl.load(lut + 512 + bl.to(tl.int32), mask=m, other=0)
        if kind != SHARP:
            tl.store(out, r, mask=m)
            tl.store(out + H * W, g, mask=m)
            tl.store(out + 2 * H * W, bl, mask=m)

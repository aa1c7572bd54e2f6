"""Triton kernels of ``loader.gpu.augment`` (imported only when a batch is augmented).

Triton resolves the helpers a kernel calls from the module's globals, so the kernels live
at the top level of a module of their own, which the rest of the loader imports lazily.
"""

import triton
import triton.language as tl


@triton.jit
def filter_span(pos, size, scale, cubic, antialias: tl.constexpr, CUBIC: tl.constexpr):
    # PIL's precompute_coeffs: the centre of output pixel `pos` in source coordinates,
    # the filter's scale (the shrink factor with antialias, else 1), the first source
    # pixel it covers and the one past its last (its half-width is the scale, twice that
    # for the images whose `cubic` is set; CUBIC: whether any of the batch's is).
    centre = (pos.to(tl.float32) + 0.5) * scale
    if antialias:  # noqa: SIM108  (a constexpr branch: Triton compiles one side)
        fscale = tl.maximum(scale, 1.0)
    else:
        fscale = scale * 0.0 + 1.0
    if CUBIC:  # noqa: SIM108
        support = tl.where(cubic != 0, 2.0 * fscale, fscale)
    else:
        support = fscale
    lo = tl.maximum((centre - support + 0.5).to(tl.int32), 0)
    hi = tl.minimum((centre + support + 0.5).to(tl.int32), size)
    return centre, fscale, lo, hi


@triton.jit
def tap_weight(src, centre, fscale, use, cubic, antialias: tl.constexpr, CUBIC: tl.constexpr):
    # The filter's weight of source pixel `src` for an output pixel centred at `centre`
    # (0 where `use` is false: past the window or the tile): the triangle, or where `cubic`
    # is set the cubic convolution kernel with PIL's a = -0.5 (torch's -0.75 without
    # antialias: ``augment.CUBIC_A``, ``PLAIN_CUBIC_A``).
    t = tl.abs((src.to(tl.float32) - centre + 0.5) / fscale)
    wgt = tl.maximum(1.0 - t, 0.0)
    if CUBIC:
        if antialias:  # noqa: SIM108
            a = -0.5
        else:
            a = -0.75
        near = ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0
        far = (((t - 5.0) * t + 8.0) * t - 4.0) * a
        wgt = tl.where(cubic != 0, tl.where(t < 1.0, near, tl.where(t < 2.0, far, 0.0)), wgt)
    return tl.where(use, wgt, 0.0)


# An int argument that varies from batch to batch (``n_rows``, ``taps``: bounds, not
# strides) is not specialised: Triton would compile the kernel again, on the prefetch thread
# and in the middle of a run, the first time such a value is 1 or a multiple of 16.
@triton.jit(do_not_specialize=["n_rows", "taps"])
def resample_rows(
    images, crop_info, row_image, scratch, n_rows, out_w, taps,
    ANTIALIAS: tl.constexpr, CUBIC: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    # A tile of ROWS scratch rows (window rows, possibly of several images) by BLOCK output
    # columns: each row resampled horizontally to the columns the output keeps.
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    t_ok = t < n_rows
    g = tl.load(row_image + t, mask=t_ok, other=0)
    p = crop_info + g * 17  # augment._P_COLS
    wy, wx, ww = tl.load(p + 0), tl.load(p + 1), tl.load(p + 3)
    cu = tl.load(p + 16)[:, None]
    rw, ox, row0 = tl.load(p + 5), tl.load(p + 7), tl.load(p + 12)
    sc, sy, sx = tl.load(p + 13).to(tl.int64), tl.load(p + 14).to(tl.int64), tl.load(p + 15)
    src = tl.load(images + g).to(tl.pointer_type(tl.uint8))
    y = wy + (t - row0)  # source row of each scratch row
    row = src + y.to(tl.int64) * sy + wx * sx
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    live = t_ok[:, None] & (j < out_w)[None, :]
    scale = ww.to(tl.float32) / rw.to(tl.float32)
    centre, fscale, lo, hi = filter_span(
        j[None, :] + ox[:, None], ww[:, None], scale[:, None], cu, ANTIALIAS, CUBIC
    )
    acc0 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    acc1 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    acc2 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    total = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    for k in range(0, taps):
        x = lo + k
        use = live & (x < hi)
        wgt = tap_weight(x, centre, fscale, use, cu, ANTIALIAS, CUBIC)
        at = row[:, None] + x * sx[:, None]
        acc0 += wgt * tl.load(at, mask=use, other=0).to(tl.float32)
        acc1 += wgt * tl.load(at + sc[:, None], mask=use, other=0).to(tl.float32)
        acc2 += wgt * tl.load(at + 2 * sc[:, None], mask=use, other=0).to(tl.float32)
        total += wgt
    total = tl.where(total > 0, total, 1.0)
    r0, r1, r2 = acc0 / total, acc1 / total, acc2 / total
    if CUBIC:  # PIL clamps each pass to 0..255: the cubic overshoots at edges (a triangle cannot)
        r0 = tl.minimum(tl.maximum(r0, 0.0), 255.0)
        r1 = tl.minimum(tl.maximum(r1, 0.0), 255.0)
        r2 = tl.minimum(tl.maximum(r2, 0.0), 255.0)
    base = scratch + t.to(tl.int64)[:, None] * 3 * out_w + j[None, :]
    tl.store(base, r0, mask=live)
    tl.store(base + out_w, r1, mask=live)
    tl.store(base + 2 * out_w, r2, mask=live)


@triton.jit(do_not_specialize=["taps"])
def resample_cols(
    scratch, crop_info, out, out_h, out_w, taps,
    s_n, s_c, s_h, s_w,
    m0, m1, m2, b0, b1, b2,
    ANTIALIAS: tl.constexpr, CUBIC: tl.constexpr, RAW: tl.constexpr, ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    # A tile of ROWS output rows by BLOCK columns of image g: each output pixel resampled
    # vertically from the scratch rows, rounded, mirrored, normalised and stored.
    g = tl.program_id(0)
    p = crop_info + g * 17  # augment._P_COLS
    wh, rh, oy, cu = tl.load(p + 2), tl.load(p + 4), tl.load(p + 6), tl.load(p + 16)
    flip, out_row, row0 = tl.load(p + 8), tl.load(p + 11), tl.load(p + 12)
    i = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)
    live = (i < out_h)[:, None] & (j < out_w)[None, :]
    scale = wh.to(tl.float32) / rh.to(tl.float32)
    centre, fscale, lo, hi = filter_span((i + oy)[:, None], wh, scale, cu, ANTIALIAS, CUBIC)
    acc0 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    acc1 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    acc2 = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    total = tl.full([ROWS, BLOCK], 0.0, tl.float32)
    for k in range(0, taps):
        y = lo + k
        use = live & (y < hi)
        wgt = tap_weight(y, centre, fscale, use, cu, ANTIALIAS, CUBIC)
        base = scratch + (row0 + y).to(tl.int64) * 3 * out_w + j[None, :]
        acc0 += wgt * tl.load(base, mask=use, other=0.0)
        acc1 += wgt * tl.load(base + out_w, mask=use, other=0.0)
        acc2 += wgt * tl.load(base + 2 * out_w, mask=use, other=0.0)
        total += wgt
    total = tl.where(total > 0, total, 1.0)
    # Round to the uint8 grid, as the resized PIL image (or the CPU path) would be.
    v0 = tl.minimum(tl.maximum(tl.floor(acc0 / total + 0.5), 0.0), 255.0)
    v1 = tl.minimum(tl.maximum(tl.floor(acc1 / total + 0.5), 0.0), 255.0)
    v2 = tl.minimum(tl.maximum(tl.floor(acc2 / total + 0.5), 0.0), 255.0)
    if not RAW:
        v0 = v0 * m0 + b0
        v1 = v1 * m1 + b1
        v2 = v2 * m2 + b2
    jo = tl.where(flip != 0, out_w - 1 - j, j)
    dst = (
        out + out_row.to(tl.int64) * s_n + i.to(tl.int64)[:, None] * s_h
        + jo.to(tl.int64)[None, :] * s_w
    )  # fmt: skip
    ty = out.dtype.element_ty
    tl.store(dst, v0.to(ty), mask=live)
    tl.store(dst + s_c, v1.to(ty), mask=live)
    tl.store(dst + 2 * s_c, v2.to(ty), mask=live)

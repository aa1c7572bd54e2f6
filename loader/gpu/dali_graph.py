"""The DALI pipeline of ``DaliStage``: its graph, and each batch's per-sample inputs.

One graph decodes each sample's crop window (``decoders.image_slice``), resizes it to the
output size (antialiased, rounded to uint8) and flips and normalises it into the output
dtype and layout (``crop_mirror_normalize``), all in DALI's own threads and streams. The
windows are the sampler's, so the samples are the same on every backend; the pixels differ
from the loader's own kernels only by DALI's resampling (the same triangle or cubic filter).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch


class Graph(NamedTuple):
    """What a pipeline is built for: the batch, the output and the mixed decoder's way."""

    batch_size: int
    threads: int
    device: torch.device
    depth: int  # batches in the pipeline at once
    dtype: torch.dtype  # the batch's
    out_dtype: object  # DALI's output type (``dali_dtype``)
    channels_last: bool
    size: tuple[int, int]
    mean: tuple
    std: tuple
    antialias: bool
    centre_crop: bool  # resize the part of each window the output is cropped from
    hw_load: float  # the share of the JPEGs for the hardware engines (CUDA only)
    no_copy: bool  # whether DALI reads the JPEGs where they lie instead of copying them


def interp_types(cubic: np.ndarray) -> np.ndarray:
    """DALI's ``interp_type`` (int32) for each crop row's CUBIC column.

    DALI's cubic is PIL's kernel (Catmull-Rom, a = -0.5, read from a 129-point table) and
    with ``antialias`` is widened by the shrink factor as PIL's is (its resampling
    filters' source; not run here). Unlike PIL it keeps floats between its two passes (no
    clamp to 0..255 there), and without antialias it stays a = -0.5, where torch's plain
    bicubic and the loader's kernels use a = -0.75.
    """
    from nvidia.dali import types

    kinds = np.array([int(types.INTERP_LINEAR), int(types.INTERP_CUBIC)], dtype=np.int32)
    return kinds[(cubic != 0).astype(np.intp)]


def dali_dtype(dtype: torch.dtype) -> tuple:
    """(DALI's output type, the torch dtype it is) for the batch's dtype: bfloat16, which
    DALI does not produce, comes as float32 and is cast on the side stream."""
    from nvidia.dali import types

    pairs = {
        torch.uint8: (types.UINT8, torch.uint8),
        torch.float16: (types.FLOAT16, torch.float16),
    }
    return pairs.get(dtype, (types.FLOAT, torch.float32))


def window_arguments(
    crops: np.ndarray, size: tuple[int, int], centre_crop: bool
) -> dict[str, np.ndarray]:
    """The pipeline's per-sample inputs for crop rows ``crops`` (``CROP_COLUMNS``): the
    window to decode (x, y and w, h), the flip, the filter and, for a centre crop, the part
    of the window resized to the output (y, x from and to, in the window's pixels)."""
    c = crops.astype(np.float32)
    y, x, h, w, rh, rw, oy, ox = (c[:, k] for k in range(8))
    args = {
        "anchor": np.ascontiguousarray(np.stack([x, y], 1)),
        "shape": np.ascontiguousarray(np.stack([w, h], 1)),
        "flip": np.ascontiguousarray(crops[:, 8].astype(np.int32)),
        "interp": interp_types(crops[:, 9]),
    }
    if centre_crop:
        out_h, out_w = size
        sy, sx = h / rh, w / rw  # window pixels per resized pixel
        start = np.stack([oy * sy, ox * sx], 1)
        end = np.stack([(oy + out_h) * sy, (ox + out_w) * sx], 1)
        args.update(roi_start=np.ascontiguousarray(start), roi_end=np.ascontiguousarray(end))
    return args


def build_pipeline(g: Graph):
    """A built asynchronous, pipelined DALI pipeline fed by ``external_source``: "jpegs",
    "anchor", "shape", "flip", "interp" (and "roi_start", "roi_end" for a centre crop)."""
    from nvidia.dali import fn, pipeline_def, types

    cuda = g.device.type == "cuda"
    raw = g.dtype == torch.uint8
    mean = [0.0] * 3 if raw else [m * 255 for m in g.mean]
    std = [1.0] * 3 if raw else [s * 255 for s in g.std]
    out_h, out_w = g.size
    layout = "HWC" if g.channels_last else "CHW"
    mixed = {"hw_decoder_load": g.hw_load} if cuda else {}

    @pipeline_def(
        batch_size=g.batch_size,
        num_threads=g.threads,
        device_id=(g.device.index or torch.cuda.current_device()) if cuda else None,
        prefetch_queue_depth=g.depth,
        exec_async=True,
        exec_pipelined=True,
    )
    def graph():
        def given(name: str, dtype, ndim: int = 1, **kwargs):
            return fn.external_source(name=name, dtype=dtype, ndim=ndim, **kwargs)

        jpegs = given("jpegs", types.UINT8, no_copy=g.no_copy)
        images = fn.decoders.image_slice(
            jpegs, given("anchor", types.FLOAT), given("shape", types.FLOAT),
            device="mixed" if cuda else "cpu", output_type=types.RGB, axis_names="WH",
            normalized_anchor=False, normalized_shape=False, **mixed,
        )  # fmt: skip
        roi = {}
        if g.centre_crop:
            roi = {
                "roi_start": given("roi_start", types.FLOAT),
                "roi_end": given("roi_end", types.FLOAT),
                "roi_relative": False,
            }
        images = fn.resize(
            images, resize_y=out_h, resize_x=out_w, antialias=g.antialias, **roi,
            interp_type=fn.cast(given("interp", types.INT32, ndim=0), dtype=types.INTERP_TYPE),
        )  # fmt: skip
        return fn.crop_mirror_normalize(
            images, dtype=g.out_dtype, output_layout=layout, mean=mean, std=std,
            mirror=given("flip", types.INT32, ndim=0),
        )  # fmt: skip

    pipe = graph()
    pipe.build()
    return pipe

"""BatchSteps: a recipe's steps beyond the crop, run on the GPU path's finished batch.

Where the recipe has any (``Transform.steps``: ColorJitter, RandomGrayscale;
``Transform.erasing``), the stage crops into uint8 instead of normalising in its kernels;
then each step acts on the whole batch on the device (``loader.ops``; timm's policies
fused, ``loader.gpu.fused_layers``), and the batch is normalised, cast, erased (the recipe's
RandomErasing) and laid out in one launch (``loader.gpu.normalise``), all on the stage's
side stream. The draws come from the batch's seed (``loader.ops.draws``), so a resumed epoch
repeats them, and the CPU path makes the same; they and the kernels' tables are made by a
worker into the slot (``loader.gpu.step_tables``), else here, and cross in one copy.
"""

from __future__ import annotations

import torch

from loader.augment import Transform
from loader.gpu import fused_layers
from loader.gpu.host_arrays import upload
from loader.gpu.normalise import affine, levels, normalise_erase
from loader.gpu.step_tables import StepTables


class BatchSteps:
    """The steps of ``spec`` for a batch of ``dtype`` in ``memory_format``."""

    # The last launch (``loader.gpu.normalise``) and timm's fused layers
    # (``loader.gpu.fused_layers``): None, on CUDA and not on the CPU (where Triton's
    # interpreter would run them: tests); True or False, always or never.
    fused: bool | None = None
    fuse_layers: bool | None = None

    def __init__(self, spec: Transform, dtype: torch.dtype, memory_format, stats=None) -> None:
        self.spec, self.steps, self.erasing = spec, spec.steps, spec.erasing
        self.stats = stats  # a ``LoaderStats``: the bytes copied count as ``h2d_bytes``
        self.tables = StepTables(spec)
        self.dtype, self.format = dtype, memory_format
        if self.erasing is not None and not dtype.is_floating_point:
            raise ValueError(
                f"the recipe's RandomErasing erases normalised pixels, but dtype={dtype}; "
                "pass a float dtype (e.g. torch.float16)"
            )
        self._scale, self._bias = affine(spec.mean, spec.std)
        self._affine: tuple | None = None  # (device, scale, bias, levels)

    @property
    def active(self) -> bool:
        return bool(self.steps) or self.erasing is not None

    def __call__(self, x: torch.Tensor, seed: int, views: dict | None = None) -> torch.Tensor:
        """The batch ``x`` (uint8 [N, 3, H, W]) of batch seed ``seed``, stepped, normalised
        and cast; a new tensor. ``views``: the slot's arrays, where a worker made the
        batch's tables (``StepTables.fill``)."""
        n = len(x)
        tables = self.tables
        made = tables.read(views, n) if views and tables.in_slot(views) else tables.make(seed, n)
        fuse_layers = self.fuse_layers if self.fuse_layers is not None else x.is_cuda
        fused = fuse_layers and len(made.layers) > 0 and fused_layers.takes(x)
        last = self.dtype.is_floating_point and (x.is_cuda if self.fused is None else self.fused)
        # What the kernels read, in one copy: the layers' tables and LUTs, the erasing rows.
        sent = ([made.layers, made.luts] if fused else []) + ([made.rows] if last else [])
        on = upload(x.device, *sent, stats=self.stats) if sent else []
        layers, luts = on[:2] if fused else (None, None)
        rows = on[-1] if last else None
        j = 0
        for step, params, count in zip(self.steps, made.params, tables.layers, strict=True):
            if fused and count and fused_layers.takes(x):  # the same pixels, fewer launches
                fill = fused_layers.warp_fill(step)
                for k in range(j, j + count):
                    x = fused_layers.run_layer(x, layers[k], luts[k], fill, made.layers[k, :, 0])
            else:
                x = step.apply(x, params)
            j += count
        if last:  # the rest in one launch
            table = self._on(x.device)[2]
            return normalise_erase(
                x, table, self.dtype, self.format, self.erasing, made.boxes, made.noise, rows
            )
        if self.dtype.is_floating_point:
            scale, bias, _ = self._on(x.device)
            x = torch.addcmul(bias, x.float(), scale).to(self.dtype)
        if self.erasing is not None:
            x = self.erasing.apply(x, made.boxes, seed=made.noise)
        return x.contiguous(memory_format=self.format)

    def _on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scale, bias, the levels' values) on ``device``, made once (from lists each
        batch they would synchronise the stream)."""
        if self._affine is None or self._affine[0] != device:
            scale = torch.tensor(self._scale, device=device).view(1, 3, 1, 1)
            bias = torch.tensor(self._bias, device=device).view(1, 3, 1, 1)
            self._affine = (device, scale, bias, levels(scale, bias))
        return self._affine[1:]

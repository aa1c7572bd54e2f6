"""StepTables: a batch's recipe draws and its kernels' tables, made in a worker.

The GPU stage's thread shares the training process's interpreter with the training loop,
and numpy there holds the GIL the loop waits for: a batch's draws (``loader.ops.draws``),
timm's fused layers' tables (``fused_layers.layer_table``) and the erasing rows took
milliseconds of it a batch (docs/design/augmentations.md). So the worker that fills a
batch's first rows makes them, from the batch seed as the stage would, into the slot's
buffers (``buffers``, ``fill``), and the stage reads them there (``read``); without them (no
workers, or a slot from elsewhere) the stage makes them itself (``make``). Either way the
same function of the seed: the same draws on every path and on resume.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from loader.augment import Transform
from loader.gpu import fused_layers
from loader.gpu.normalise import erase_rows
from loader.ops.draws import draw, split, widths

_COLS = fused_layers.COLS  # a layer table's columns


class Tables(NamedTuple):
    """One batch's: each step's draws, the fused layers' tables and LUTs (one per layer, in
    step order), the erasing's kernel rows and noise seed (``erasing.apply``'s)."""

    params: list[np.ndarray]  # step k's [n, columns] float64
    layers: np.ndarray  # float32 [layers, n, _COLS]
    luts: np.ndarray  # uint8 [layers, n, 256]
    rows: np.ndarray  # int64 [n, 5]: the box (y, x, h, w; w = 0: none) and the noise key
    noise: int

    @property
    def boxes(self) -> np.ndarray:
        return self.rows[:, :4]


class StepTables:
    """The tables of ``spec``'s steps."""

    def __init__(self, spec: Transform) -> None:
        self.spec = spec
        self.widths = widths(spec)
        self.layers = [
            fused_layers.layer_count(s) if fused_layers.fusable(s) else 0 for s in spec.steps
        ]

    @property
    def active(self) -> bool:
        return bool(self.spec.steps) or self.spec.erasing is not None

    def buffers(self, b: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """Name -> (shape, numpy dtype) of the buffers a slot of ``b`` samples holds them in."""
        return {
            "step_params": ((b, max(1, sum(self.widths))), "float64"),
            "layer_tables": ((max(1, sum(self.layers)), b, _COLS), "float32"),
            "layer_luts": ((max(1, sum(self.layers)), b, 256), "uint8"),
            "erase_rows": ((b, 5), "int64"),
            "erase_seed": ((1,), "int64"),
        }

    def make(self, seed: int, n: int) -> Tables:
        """The tables of a batch of ``n`` samples of batch seed ``seed``."""
        draws = draw(self.spec, seed, n)
        h, w = self.spec.size
        made = [
            fused_layers.layer_tables(step, params, h, w)
            for step, params, layers in zip(self.spec.steps, draws.params, self.layers, strict=True)
            if layers
        ]  # fmt: skip
        pairs = [pair for step in made for pair in step]
        layers = np.stack([t for t, _ in pairs]) if pairs else np.zeros((0, n, _COLS), np.float32)
        luts = np.stack([lut for _, lut in pairs]) if pairs else np.zeros((0, n, 256), np.uint8)
        rows = erase_rows(draws.boxes, draws.noise, n)
        return Tables(draws.params, layers, luts, rows, draws.noise)

    def fill(self, slot: dict[str, np.ndarray], seed: int, n: int) -> None:
        """Write the tables of a batch of ``n`` samples of ``seed`` into ``slot``."""
        made = self.make(seed, n)
        if made.params:
            slot["step_params"][:n] = np.concatenate(made.params, 1)
        k = len(made.layers)
        slot["layer_tables"][:k, :n] = made.layers
        slot["layer_luts"][:k, :n] = made.luts
        slot["erase_rows"][:n] = made.rows
        slot["erase_seed"][0] = made.noise

    @staticmethod
    def in_slot(views: dict[str, np.ndarray]) -> bool:
        """Whether a slot (``views``: its arrays) has buffers ``fill`` writes."""
        return "erase_rows" in views

    def read(self, views: dict[str, np.ndarray], n: int) -> Tables:
        """The tables ``fill`` wrote into a slot (``views``: its arrays) for ``n`` samples."""
        params = split(views["step_params"][:n], self.widths)
        k = sum(self.layers)
        return Tables(
            params, views["layer_tables"][:k, :n], views["layer_luts"][:k, :n],
            views["erase_rows"][:n], int(views["erase_seed"][0]),
        )  # fmt: skip

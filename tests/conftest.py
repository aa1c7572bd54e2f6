"""Session-wide source trees and stores of the ingest and dataset tests (see fixtures.py),
a collector that scans only what the module under test made, and (without CUDA) Triton's
CPU interpreter for the GPU kernels, set before any test imports Triton: a Triton imported
without it runs kernels that call its library functions (``tl.sum``...) only compiled."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from fixtures import AWKWARD_OPTIONS, CLEAN_OPTIONS, Tree, make_awkward_tree, make_clean_tree

from ingest.build import build


@pytest.fixture(scope="module", autouse=True)
def _freeze_the_heap_so_far():
    """What earlier modules left alive (torch, Triton, the stores) is moved out of the
    collector's sight, so the many ``gc.collect()`` of the tests scan only this module's
    objects: a full collection of the whole heap took most of the resource tests' time."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture(scope="session")
def awkward_tree(tmp_path_factory: pytest.TempPathFactory) -> Tree:
    return make_awkward_tree(tmp_path_factory.mktemp("awkward") / "src")


@pytest.fixture(scope="session")
def awkward_store(tmp_path_factory: pytest.TempPathFactory, awkward_tree: Tree) -> Path:
    """The awkward tree built in one process; read it, never change it."""
    out = tmp_path_factory.mktemp("awkward-store") / "store"
    build(awkward_tree.root, out, AWKWARD_OPTIONS, workers=1, progress=False)
    return out


@pytest.fixture(scope="session")
def clean_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_clean_tree(tmp_path_factory.mktemp("clean") / "src")


@pytest.fixture(scope="session")
def clean_store(tmp_path_factory: pytest.TempPathFactory, clean_tree: Path) -> Path:
    """The clean tree built in one process; read it, never change it (copy it first)."""
    out = tmp_path_factory.mktemp("clean-store") / "store"
    build(clean_tree, out, CLEAN_OPTIONS, workers=1, progress=False)
    return out

"""A store built with --no-verify on the GPU path: the GPU decoders decode a corrupt JPEG
to garbage without an error, where the CPU path replaces it, so the loader says so once.
Runs with the CPU stand-ins of the GPU decoders here; with nvJPEG and DALI on a GPU."""

from __future__ import annotations

import importlib.util
import logging

import numpy as np
import pytest
import torch
from fixtures import _corrupt_jpeg
from gpu_path_data import CUDA, DEVICE, dali_backend, use_stand_ins

import loader
from ingest.build import BuildOptions, build
from loader.bench.synth import make_image_folder
from loader.gpu import unverified as gpu_unverified

PER_CLASS = 6


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """The same tree, with a truncated and a garbage-body JPEG: (unverified, verified)."""
    root = tmp_path_factory.mktemp("unverified")
    src = root / "src"
    make_image_folder(src, 2, PER_CLASS, seed=31, short_side=(48, 64))
    files = sorted(src.rglob("*.JPEG"))
    files[1].write_bytes(files[1].read_bytes()[:-200])  # truncated
    files[7].write_bytes(_corrupt_jpeg(files[7].read_bytes(), np.random.default_rng(1)))
    unverified, verified = root / "unverified", root / "verified"
    build(src, unverified, BuildOptions(verify=False), workers=1, progress=False)
    build(src, verified, workers=1, progress=False)
    return unverified, verified


def _decoders() -> list[str]:
    names = ["nvjpeg" if CUDA else "tvcpu"]
    if importlib.util.find_spec("nvidia.dali") is not None:
        names.append(dali_backend())
    return names


@pytest.mark.parametrize("decoder", _decoders())
def test_an_unverified_store_on_the_gpu_path_is_said_once(stores, decoder, caplog, monkeypatch):
    use_stand_ins(monkeypatch)
    monkeypatch.setattr(gpu_unverified, "_WARNED", set())
    unverified, verified = stores

    def epoch(store) -> int:
        args = {"device": DEVICE, "decoder": decoder, "dtype": torch.uint8, "transform": "eval"}
        dl = loader.DataLoader(store, batch_size=4, num_workers=0, image_size=32, **args)
        return sum(len(labels) for _, labels in dl)

    with caplog.at_level(logging.WARNING, logger="loader"):
        assert epoch(unverified) == epoch(unverified) == 2 * PER_CLASS  # all delivered
        assert epoch(verified) == 2 * PER_CLASS - 2  # the two corrupt ones rejected
    said = [r.getMessage() for r in caplog.records if "--no-verify" in r.getMessage()]
    assert said == [
        f"DataLoader: {unverified} was built with --no-verify; decoder={decoder!r} decodes "
        "its JPEGs on the GPU, where a corrupt one becomes an image of garbage pixels "
        "without an error (the CPU decoder replaces it): run `ingest verify "
        f"{unverified}` to find any, or rebuild it without --no-verify (logged once)"
    ]


def test_the_cpu_path_says_nothing_of_it(stores, caplog):
    unverified, _ = stores
    with caplog.at_level(logging.WARNING, logger="loader"):
        dl = loader.DataLoader(
            unverified, batch_size=4, num_workers=0, transform="eval", image_size=32,
            device="cpu",
        )  # fmt: skip
        assert sum(len(labels) for _, labels in dl) == 2 * PER_CLASS  # the 2 replaced
    assert not [r for r in caplog.records if "--no-verify" in r.getMessage()]
    assert len(dl.bad_samples) == 2

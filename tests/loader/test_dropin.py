"""The README's drop-in: imagenet/main.py's data code with two swaps, in all its modes.

tests/imagenet_style.py is that script in small. Its stores hold one image per class, so
the targets a rank trains on are the sample indices it was given.
"""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path

import imagenet_style
import pytest
import torch
import torch.utils.data

from ingest.build import build
from loader.bench.synth import make_image_folder

N_TRAIN, N_VAL, B = 24, 11, 5
FAST = "loader.dataloader"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """``data_lmdb/{train,val}``, built as the README says; one image per class."""
    root = tmp_path_factory.mktemp("dropin")
    for split, n in (("train", N_TRAIN), ("val", N_VAL)):
        make_image_folder(root / "src" / split, n, 1, seed=n, short_side=(40, 64))
        build(root / "src" / split, root / "data_lmdb" / split, workers=1, progress=False)
    return root / "data_lmdb"


def run(data: Path, out: Path, *args: str) -> dict:
    """Run the script in this process (one rank); return what it saw."""
    out.mkdir(exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the swap must not warn
        warnings.filterwarnings("ignore", ".*pin_memory.*")  # torch's, without a GPU
        imagenet_style.main([str(data), "--out", str(out), *args])
    return json.loads((out / "rank0.json").read_text())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distributed_sampler_batches(n: int, epoch: int, rank: int, **kwargs) -> list[int]:
    """What torch's DataLoader over a DistributedSampler yields on ``rank`` of 2."""
    sampler = torch.utils.data.DistributedSampler(range(n), 2, rank, **kwargs)
    sampler.set_epoch(epoch)
    dl = torch.utils.data.DataLoader(range(n), batch_size=B, sampler=sampler)
    return [i for batch in dl for i in batch.tolist()]


@pytest.fixture(scope="module")
def two_ranks(data, tmp_path_factory) -> list[dict]:
    """The script on 2 gloo ranks (torch.multiprocessing.spawn), 1 loader worker each, 2
    epochs; the ranks start from --start-epoch 1 as a --resume would set it, so a loader
    that ignored the sampler's set_epoch would read epochs 0 and 1 instead of 1 and 2."""
    out = tmp_path_factory.mktemp("ranks")
    url = f"tcp://127.0.0.1:{free_port()}"
    ranks = ["--world-size", "1", "--rank", "0", "--multiprocessing-distributed"]
    epochs = ["--start-epoch", "1", "--epochs", "3"]
    imagenet_style.main(
        [str(data), "--out", str(out), "--dist-url", url, *ranks, "-j", "1", *epochs]
    )
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_distributed_takes_the_fast_path_with_torchs_lengths(two_ranks):
    for seen in two_ranks:
        assert seen["types"] == [FAST, FAST]
        # DistributedSampler's: 12 train samples per rank; 5 val ones (drop_last=True).
        assert seen["len_sampler"] == [12, 5]
        assert seen["len_loader"] == [3, 1]


def test_distributed_epochs_are_distributed_samplers_exactly_once_each(two_ranks):
    for epoch in (1, 2):
        per_rank = [seen["train"][str(epoch)] for seen in two_ranks]
        assert sorted(per_rank[0] + per_rank[1]) == list(range(N_TRAIN))
        for rank, got in enumerate(per_rank):
            assert got == distributed_sampler_batches(N_TRAIN, epoch, rank)
    assert two_ranks[0]["train"]["1"] != two_ranks[0]["train"]["2"]


def test_distributed_evaluation_counts_each_sample_once(two_ranks):
    for epoch in (0, 1):
        main = [seen["val"][epoch]["main"] for seen in two_ranks]
        assert main == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]  # DistributedSampler's, in order
        for seen in two_ranks:  # every rank's extra pass covers what the sampler left out
            assert seen["val"][epoch]["aux"] == [10]
            assert seen["val"][epoch]["count"] == N_VAL
        assert sorted(main[0] + main[1] + two_ranks[0]["val"][epoch]["aux"]) == list(range(N_VAL))


def test_single_process_order_follows_torch_manual_seed(data, tmp_path):
    a = run(data, tmp_path / "a", "--seed", "1")
    b = run(data, tmp_path / "b", "--seed", "1")
    c = run(data, tmp_path / "c", "--seed", "2")
    d = run(data, tmp_path / "d")
    assert a["types"] == [FAST, FAST]
    assert a["len_sampler"] == [N_TRAIN, N_VAL] and a["len_loader"] == [5, 3]
    for seen in (a, c, d):
        for epoch in ("0", "1"):
            assert sorted(seen["train"][epoch]) == list(range(N_TRAIN))
        assert seen["train"]["0"] != seen["train"]["1"]
        assert [v["main"] for v in seen["val"]] == [list(range(N_VAL))] * 2
    assert a["train"] == b["train"]
    assert a["train"]["0"] != c["train"]["0"] and a["train"]["0"] != d["train"]["0"]


def test_resume_and_evaluate(data, tmp_path):
    first = run(data, tmp_path, "--seed", "3", "--epochs", "1")
    assert list(first["train"]) == ["0"]
    checkpoint = str(tmp_path / "checkpoint.pth.tar")
    resumed = run(data, tmp_path, "--seed", "3", "--resume", checkpoint)
    assert list(resumed["train"]) == ["1"] and sorted(resumed["train"]["1"]) == list(range(24))
    evaluated = run(data, tmp_path, "--evaluate", "--resume", checkpoint)
    assert evaluated["train"] == {} and evaluated["val"][0]["main"] == list(range(N_VAL))


def test_dummy_data_uses_torchs_dataloader_from_the_same_call(data, tmp_path):
    seen = run(data, tmp_path, "--dummy", "--epochs", "1")
    assert seen["types"] == ["torch.utils.data.dataloader"] * 2
    assert len(seen["train"]["0"]) == 20 and len(seen["val"][0]["main"]) == 10

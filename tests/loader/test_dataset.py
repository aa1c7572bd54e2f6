"""LMDBDataset: ImageFolder compatibility, read-only stores, stock DataLoader workers."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from fixtures import REPO
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from ingest import format as fmt
from loader.dataset import LMDBDataset

NOBODY = 65534


def test_same_as_torchvision_imagefolder(clean_tree: Path, clean_store: Path) -> None:
    ours, theirs = LMDBDataset(clean_store), ImageFolder(str(clean_tree))
    assert len(ours) == len(theirs) == 24
    assert ours.classes == theirs.classes == ["class_00", "class_01", "class_02"]
    assert ours.class_to_idx == theirs.class_to_idx
    assert ours.targets == theirs.targets == [0] * 8 + [1] * 8 + [2] * 8
    relative = [(Path(p).relative_to(clean_tree).as_posix(), y) for p, y in theirs.samples]
    assert ours.samples == ours.imgs == relative
    assert ("class_01/nested/img_00006.JPEG", 1) in relative
    assert ("class_02/img_00007.png", 2) in relative
    for i in range(len(theirs)):
        (image, label), (ref_image, ref_label) = ours[i], theirs[i]
        assert image.mode == "RGB" and label == ref_label
        np.testing.assert_array_equal(np.asarray(image), np.asarray(ref_image))


def test_transforms_and_indexing(clean_store: Path) -> None:
    ds = LMDBDataset(clean_store, transform=T.PILToTensor(), target_transform=lambda y: -y)
    image, label = ds[9]
    plain = LMDBDataset(clean_store)
    assert label == -plain[9][1] == -1
    assert torch.equal(image, torch.from_numpy(np.array(plain[9][0])).permute(2, 0, 1))
    assert torch.equal(ds[-1][0], ds[23][0])
    with pytest.raises(IndexError, match="sample index 24 is out of range for a store of 24"):
        ds[24]
    assert not list(clean_store.glob("shard-*/lock.mdb"))  # readers never create one


# Python and its packages live under /root here, unreadable to nobody: the reader
# first runs, as root, every code path with lazy imports (LMDB open, PIL decoders) on
# data of its own, then drops to nobody and reads the store.
READER = """
import hashlib, io, json, os, sys, tempfile

import lmdb
import numpy as np
from PIL import Image

from loader.dataset import LMDBDataset

with tempfile.TemporaryDirectory() as warm:
    lmdb.open(warm).close()
    lmdb.open(warm, readonly=True, lock=False).close()
for kind in ("JPEG", "PNG"):
    buf = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buf, kind)
    Image.open(buf).convert("RGB")

os.setgroups([])
os.setgid({uid})
os.setuid({uid})
root = sys.argv[1]
assert not os.access(root, os.W_OK) and not os.access(root + "/shard-00000", os.W_OK)
ds = LMDBDataset(root)
out = [[hashlib.sha256(np.asarray(im).tobytes()).hexdigest(), y, im.size] for im, y in ds]
print(json.dumps(out))
"""


def test_read_only_store_read_by_an_unprivileged_user(clean_store: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="imfeed-ro-"))  # pytest's tmp dirs are root-only
    try:
        tmp.chmod(0o755)
        store = tmp / "store"
        shutil.copytree(clean_store, store)
        for path in [store, *store.rglob("*")]:
            path.chmod(0o555 if path.is_dir() else 0o444)
        result = subprocess.run(
            [sys.executable, "-c", READER.format(uid=NOBODY), str(store)],
            cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert not list(store.glob("shard-*/lock.mdb"))
        assert sorted(p.name for p in store.iterdir()) == sorted(
            p.name for p in clean_store.iterdir()
        )
    finally:
        shutil.rmtree(tmp)
    ds = LMDBDataset(clean_store)
    expected = [
        [hashlib.sha256(np.asarray(im).tobytes()).hexdigest(), y, list(im.size)] for im, y in ds
    ]
    assert json.loads(result.stdout) == expected
    assert len(expected) == fmt.read_manifest(clean_store)["num_samples"] == 24


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_stock_dataloader_with_worker_processes(clean_store: Path, context: str) -> None:
    transform = T.Compose([T.Resize((40, 48)), T.PILToTensor()])
    ds = LMDBDataset(clean_store, transform=transform)
    # Read everything here first, so that forked workers inherit opened LMDB handles.
    expected = torch.stack([ds[i][0] for i in range(len(ds))])
    loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context=context)
    images, labels = zip(*loader, strict=True)
    assert [len(b) for b in labels] == [5, 5, 5, 5, 4]
    assert torch.cat(labels).tolist() == ds.targets
    batch = torch.cat(images)
    assert batch.shape == (24, 3, 40, 48) and batch.dtype == torch.uint8
    assert torch.equal(batch, expected)

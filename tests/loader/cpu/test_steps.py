"""The CPU path runs a recipe's steps beyond the crop: in the workers image by image, and
RandomErasing on the delivered batch, from the same draws as the GPU path's BatchSteps, so
the two paths' batches agree (the steps run the same torch code, or OpenCV's ops with the
same pixels; the normalisations round alike to within a float32 step) whatever the number
of workers, and after a resume."""

from __future__ import annotations

import pytest
import torch
import torchvision.transforms as T
from loader_data import make_store

import loader
from loader import Transform
from loader.gpu.steps import BatchSteps
from loader.ops.autoaugment import RandAugment, TrivialAugmentWide
from loader.ops.color import ColorJitter, RandomGrayscale
from loader.ops.erasing import RandomErasing
from loader.plan.sampler import batch_seed

SIZE, BATCH, SEED = 24, 8, 5
STEPS = (ColorJitter((0.6, 1.4), (0.6, 1.4), (0.6, 1.4), (-0.1, 0.1)), RandomGrayscale(0.3))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return make_store(tmp_path_factory.mktemp("cpu_steps"))


def _epoch(store, spec, dtype=torch.float32, **kw):
    dl = loader.DataLoader(
        store, batch_size=BATCH, transform=spec, device="cpu", dtype=dtype, seed=SEED,
        with_indices=True, **kw,
    )  # fmt: skip
    return list(dl)


def _cat(batches, k):
    return torch.cat([b[k] for b in batches])


@pytest.mark.parametrize(
    "steps",
    [STEPS, (RandAugment(2, 9), TrivialAugmentWide(fill=(124, 116, 104)))],
    ids=["torch-ops", "opencv-ops"],  # image_steps: the steps that keep torch's, and not
)
@pytest.mark.parametrize("workers", [0, 2])
def test_the_cpu_path_makes_the_gpu_paths_stepped_and_erased_batches(store, workers, steps):
    spec = Transform("train", SIZE, steps=steps, erasing=RandomErasing(0.5, fill="pixel"))
    got = _epoch(store, spec, num_workers=workers)
    plain = _epoch(store, Transform("train", SIZE), dtype=torch.uint8, num_workers=workers)
    assert torch.equal(_cat(got, 2), _cat(plain, 2)) and torch.equal(_cat(got, 1), _cat(plain, 1))
    after = BatchSteps(spec, torch.float32, torch.contiguous_format)
    seeds = [batch_seed(SEED, 0, step, rank=0) for step in range(len(plain))]
    want = torch.cat([after(b[0], s) for b, s in zip(plain, seeds, strict=True)])
    diff = (_cat(got, 0) - want).abs()
    # the LUT's and addcmul's float32 roundings; a level's difference would be 0.017
    assert diff.max() < 1e-5, diff.max()
    erased = want.abs() > 2.7  # noise: past every normalised pixel level (-2.12..2.64)
    assert erased.any()
    assert not torch.equal(_cat(got, 0), _cat(plain, 0).float())


def test_the_draws_do_not_depend_on_the_workers_and_resume_alike(store):
    spec = Transform("train", SIZE, steps=STEPS, erasing=RandomErasing(0.5))
    whole = _epoch(store, spec, num_workers=2)
    assert torch.equal(_cat(whole, 0), _cat(_epoch(store, spec, num_workers=0), 0))
    dl = loader.DataLoader(
        store, batch_size=BATCH, transform=spec, device="cpu", seed=SEED, num_workers=2
    )
    it = iter(dl)
    next(it), next(it)
    state = dl.state_dict()
    del it
    resumed = loader.DataLoader(
        store, batch_size=BATCH, transform=spec, device="cpu", seed=SEED, num_workers=2
    )
    resumed.load_state_dict(state)
    rest = torch.cat([b[0] for b in resumed])
    assert torch.equal(rest, _cat(whole[2:], 0))


def test_a_recipe_with_steps_takes_the_fast_cpu_path(store):
    tf = T.Compose([
        T.RandomResizedCrop(SIZE), T.ColorJitter(0.4, 0.4, 0.4), T.RandomGrayscale(0.2),
        T.ToTensor(), T.RandomErasing(0.25),
    ])  # fmt: skip
    dl = loader.DataLoader(loader.LMDBDataset(store, transform=tf), batch_size=BATCH)
    assert isinstance(dl, loader.DataLoader)
    images, _ = next(iter(dl))
    assert images.shape == (BATCH, 3, SIZE, SIZE) and images.dtype == torch.float32


def test_erasing_needs_a_float_batch(store):
    spec = Transform("train", SIZE, erasing=RandomErasing(0.5))
    with pytest.raises(ValueError, match=r"erases normalised pixels, but dtype=torch\.uint8"):
        loader.DataLoader(store, batch_size=BATCH, transform=spec, device="cpu", dtype="uint8")

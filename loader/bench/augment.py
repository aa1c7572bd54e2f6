"""The augmentation every pipeline runs, as torchvision writes it, and the hand-off of a batch
to the training loop; apart from the registry so that each pipeline's module imports them
without importing the registry that imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from loader.bench.settings import MEAN, SIZE, STD, Settings

if TYPE_CHECKING:
    import torch


def torch_transform(s: Settings) -> Callable:
    """torchvision's standard transforms for the run: train or eval, float or raw uint8."""
    import torchvision.transforms as T

    if s.eval:
        geometry = [T.Resize(int(SIZE / 0.875)), T.CenterCrop(SIZE)]
    else:
        geometry = [T.RandomResizedCrop(SIZE), T.RandomHorizontalFlip()]
        if s.recipe == "randaugment":
            geometry.append(T.RandAugment(num_ops=2, magnitude=9))
    if s.dtype == "uint8":
        return T.Compose([*geometry, T.PILToTensor()])
    return T.Compose([*geometry, T.ToTensor(), T.Normalize(MEAN, STD)])


def tensor_transform(s: Settings) -> Callable:
    """The same transforms on a decoded uint8 CHW tensor (torchvision's v2 API): for a
    peer whose reader decodes to tensors rather than PIL images."""
    import torch
    import torchvision.transforms.v2 as T

    if s.eval:
        geometry = [T.Resize(int(SIZE / 0.875), antialias=True), T.CenterCrop(SIZE)]
    else:
        geometry = [T.RandomResizedCrop(SIZE, antialias=True), T.RandomHorizontalFlip()]
        if s.recipe == "randaugment":
            geometry.append(T.RandAugment(num_ops=2, magnitude=9))
    if s.dtype == "uint8":
        return T.Compose(geometry)
    return T.Compose([*geometry, T.ToDtype(torch.float32, scale=True), T.Normalize(MEAN, STD)])


def loader_options(s: Settings) -> dict:
    """The torch-DataLoader options every pipeline built on one shares: the run's batch
    size and workers, kept across epochs, pinned for a GPU, whole batches only (one batch
    shape, as DALI's readers: a new one re-tunes cuDNN)."""
    return {
        "batch_size": s.batch_size, "num_workers": s.workers,
        "persistent_workers": s.workers > 0, "pin_memory": s.device != "cpu", "drop_last": True,
    }  # fmt: skip


def deliver(
    images: torch.Tensor, labels: torch.Tensor, s: Settings
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch as the training loop needs it: on the device, in the run's dtype and layout,
    labels as int64."""
    import torch

    images = images.to(s.device, non_blocking=True).to(getattr(torch, s.dtype))
    layout = torch.channels_last if s.channels_last else torch.contiguous_format
    images = images.contiguous(memory_format=layout)  # no copy where it is already
    return images, labels.to(s.device, non_blocking=True).long()

"""``loader.profile`` around a real training loop: ResNet-50 (bf16 autocast, channels_last,
batch 256) fed by torch's DataLoader over ImageFolder (PIL) and by ``loader.DataLoader``;
prints each report (the README's H200 example comes from here).

    python3 benchmarks/profile_example.py FOLDER STORE [--steps 35] [--workers 16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

import torch
import torchvision
from torchvision import transforms

import loader
from loader.augment import IMAGENET_MEAN, IMAGENET_STD


def train(dl, steps: int, warmup: int = 10) -> str:
    model = torchvision.models.resnet50().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    with loader.profile(dl, warmup=warmup) as prof:
        for step, (images, labels) in enumerate(prof):
            images = images.cuda(non_blocking=True).to(memory_format=torch.channels_last)
            labels = labels.cuda(non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(images), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step + 1 == warmup + steps:
                break
    return prof.report()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder")
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=35)
    ap.add_argument("--workers", type=int, default=16)
    a = ap.parse_args()
    norm = transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)
    tf = transforms.Compose([transforms.RandomResizedCrop(224), transforms.RandomHorizontalFlip(),
                             transforms.ToTensor(), norm])  # fmt: skip
    torch_dl = torch.utils.data.DataLoader(
        torchvision.datasets.ImageFolder(a.folder, tf), batch_size=256, shuffle=True,
        num_workers=a.workers, pin_memory=True, drop_last=True, persistent_workers=True,
    )  # fmt: skip
    ours = loader.DataLoader(
        a.store, batch_size=256, shuffle=True, num_workers=a.workers, transform="train",
        device="cuda", dtype=torch.bfloat16, channels_last=True, drop_last=True,
    )  # fmt: skip
    for name, dl in [
        ("torch DataLoader + ImageFolder (PIL)", torch_dl),
        ("loader.DataLoader", ours),
    ]:
        print(f"== {name}\n{train(dl, a.steps)}\n", flush=True)


if __name__ == "__main__":
    main()

"""A small training script written as pytorch/examples' imagenet/main.py, after the README's
swap: ``ImageFolder`` -> ``LMDBDataset`` and ``torch.utils.data.DataLoader`` ->
``loader.DataLoader``, nothing else changed in the data code. tests/loader/test_dropin.py runs it
(single process, --resume, --evaluate, --dummy, and 2 gloo ranks on the CPU) and reads
what each rank saw from ``--out/rank<R>.json``. Its model is tiny; the targets identify
the samples (the test stores hold one image per class).
"""

from __future__ import annotations

import argparse
import json
import os
import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.utils.data
import torch.utils.data.distributed
import torchvision.datasets as datasets
import torchvision.transforms as transforms
from torch.utils.data import Subset

import loader
from loader import LMDBDataset

parser = argparse.ArgumentParser(description="imagenet/main.py, in small")
parser.add_argument("data", metavar="DIR")
parser.add_argument("-j", "--workers", default=0, type=int)
parser.add_argument("--epochs", default=2, type=int)
parser.add_argument("--start-epoch", default=0, type=int)
parser.add_argument("-b", "--batch-size", default=5, type=int)
parser.add_argument("--resume", default="", type=str)
parser.add_argument("-e", "--evaluate", action="store_true")
parser.add_argument("--world-size", default=-1, type=int)
parser.add_argument("--rank", default=-1, type=int)
parser.add_argument("--dist-url", default="tcp://127.0.0.1:23456", type=str)
parser.add_argument("--dist-backend", default="gloo", type=str)
parser.add_argument("--seed", default=None, type=int)
parser.add_argument("--multiprocessing-distributed", action="store_true")
parser.add_argument("--dummy", action="store_true")
parser.add_argument("--procs", default=2, type=int, help="processes per node (CPU: no GPUs)")
parser.add_argument("--out", required=True, help="where each rank writes what it saw")


def main(argv: list[str] | None = None) -> None:
    args = parser.parse_args(argv)
    if args.seed is not None:
        random.seed(args.seed)
        torch.manual_seed(args.seed)
    args.distributed = args.world_size > 1 or args.multiprocessing_distributed
    if args.multiprocessing_distributed:
        args.world_size = args.procs * args.world_size
        mp.spawn(main_worker, nprocs=args.procs, args=(args.procs, args))
    else:
        main_worker(None, 1, args)


def main_worker(gpu, ngpus_per_node, args) -> None:
    if args.distributed:
        if args.multiprocessing_distributed:
            args.rank = args.rank * ngpus_per_node + gpu
        dist.init_process_group(
            backend=args.dist_backend,
            init_method=args.dist_url,
            world_size=args.world_size,
            rank=args.rank,
        )
    checkpoint_path = os.path.join(args.out, "checkpoint.pth.tar")
    seen = {"rank": max(args.rank, 0), "train": {}, "val": [], "checkpoint": checkpoint_path}
    model = nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 64))
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 0.1)
    if args.resume:
        checkpoint = torch.load(args.resume)
        args.start_epoch = checkpoint["epoch"]
        model.load_state_dict(checkpoint["state_dict"])

    # Data loading code: as imagenet/main.py's, after the swap
    if args.dummy:
        train_dataset = datasets.FakeData(20, (3, 32, 32), 64, transforms.ToTensor())
        val_dataset = datasets.FakeData(10, (3, 32, 32), 64, transforms.ToTensor())
    else:
        traindir = os.path.join(args.data, "train")
        valdir = os.path.join(args.data, "val")
        normalize = transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])
        train_dataset = LMDBDataset(
            traindir,
            transforms.Compose(
                [
                    transforms.RandomResizedCrop(224),
                    transforms.RandomHorizontalFlip(),
                    transforms.ToTensor(),
                    normalize,
                ]
            ),
        )
        val_dataset = LMDBDataset(
            valdir,
            transforms.Compose(
                [
                    transforms.Resize(256),
                    transforms.CenterCrop(224),
                    transforms.ToTensor(),
                    normalize,
                ]
            ),
        )

    if args.distributed:
        train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset)
        val_sampler = torch.utils.data.distributed.DistributedSampler(
            val_dataset, shuffle=False, drop_last=True
        )
    else:
        train_sampler = None
        val_sampler = None

    train_loader = loader.DataLoader(
        train_dataset,
        batch_size=args.batch_size,
        shuffle=(train_sampler is None),
        num_workers=args.workers,
        pin_memory=True,
        sampler=train_sampler,
    )
    val_loader = loader.DataLoader(
        val_dataset,
        batch_size=args.batch_size,
        shuffle=False,
        num_workers=args.workers,
        pin_memory=True,
        sampler=val_sampler,
    )
    seen["types"] = [type(train_loader).__module__, type(val_loader).__module__]
    seen["len_sampler"] = [len(train_loader.sampler), len(val_loader.sampler)]
    seen["len_loader"] = [len(train_loader), len(val_loader)]

    if args.evaluate:
        seen["val"].append(validate(val_loader, model, criterion, args))
    else:
        for epoch in range(args.start_epoch, args.epochs):
            if args.distributed:
                train_sampler.set_epoch(epoch)
            seen["train"][epoch] = train(train_loader, model, criterion, optimizer)
            seen["val"].append(validate(val_loader, model, criterion, args))
            if not args.distributed or args.rank == 0:
                state = {"epoch": epoch + 1, "state_dict": model.state_dict()}
                torch.save(state, checkpoint_path)
    with open(os.path.join(args.out, f"rank{seen['rank']}.json"), "w") as f:
        json.dump(seen, f)
    if args.distributed:
        dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer) -> list[int]:
    model.train()
    targets = []
    for images, target in train_loader:
        loss = criterion(model(images), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        targets += target.tolist()
    return targets


def validate(val_loader, model, criterion, args) -> dict:
    """What imagenet/main.py's validate() counts: a main pass (all-reduced across ranks)
    and, when the sampler left samples out, an extra pass over them on every rank."""

    def run_validate(loader_, targets):
        with torch.no_grad():
            for images, target in loader_:
                criterion(model(images), target)
                targets += target.tolist()

    model.eval()
    main, aux = [], []
    run_validate(val_loader, main)
    count = torch.tensor([float(len(main))])
    if args.distributed:
        dist.all_reduce(count, dist.ReduceOp.SUM)
    if args.distributed and (len(val_loader.sampler) * args.world_size < len(val_loader.dataset)):
        aux_val_dataset = Subset(
            val_loader.dataset,
            range(len(val_loader.sampler) * args.world_size, len(val_loader.dataset)),
        )
        aux_val_loader = loader.DataLoader(
            aux_val_dataset,
            batch_size=args.batch_size,
            shuffle=False,
            num_workers=args.workers,
            pin_memory=True,
        )
        run_validate(aux_val_loader, aux)
    return {"main": main, "aux": aux, "count": int(count.item()) + len(aux)}


if __name__ == "__main__":
    main()

"""The training check (GPU only): torchvision ResNet-18/50, bf16 autocast, channels_last,
trained for a fixed number of steps fed by a pipeline, or by one synthetic batch already
on the GPU (the ceiling: what the model consumes when data costs nothing)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

from loader.bench.settings import SIZE, Settings
from loader.telemetry.profiler import profile

MODELS = ("resnet18", "resnet50")


class Synthetic:
    """The same random batch on the GPU, over and over: the model's ceiling."""

    def __init__(self, s: Settings) -> None:
        import torch

        g = torch.Generator(device="cpu").manual_seed(0)
        images = torch.randn(s.batch_size, 3, SIZE, SIZE, generator=g)
        images = images.to(s.device, getattr(torch, s.dtype) if s.dtype != "uint8" else None)
        if s.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        self.batch = images, torch.randint(0, 1000, (s.batch_size,), generator=g).to(s.device)

    def epoch(self) -> Iterator:
        return itertools.repeat(self.batch, 1000)

    def close(self) -> None:
        self.batch = None


def forever(pipe) -> Iterator:
    """Batches of ``pipe`` across as many epochs as asked for."""
    while True:
        yield from pipe.epoch()


SETTLE_STEPS = 1100  # untimed steps past the warm-up, at most, while our loader settles:
# its first trial, and a second where the ways are close (two of about 250 batches each,
# with two ways; 520 each with four: DALI's two, each with cpu_share="auto" and without)


def train_check(batches: Iterator, model_name: str, s: Settings, pipe=None) -> dict:
    """Train ``model_name`` on ``batches`` for ``s.train_warmup`` untimed steps (more while
    ``pipe``'s loader is ``settling``: a trial of its ways is not timed), then ``s.train_steps``
    timed; the figures of those (img/s, share of step time waiting for data; with ``pipe``
    one of ours, where its time went meanwhile, warm-up steps included)."""
    import torch

    step = model_step(model_name, s.device)
    before = loader_times(pipe)
    untimed = 0
    for batch in itertools.islice(batches, s.train_warmup):
        step(*batch)
        untimed += 1
    while untimed < s.train_warmup + SETTLE_STEPS and settling(getattr(pipe, "dl", None)):
        step(*next(batches))
        untimed += 1
    if s.device != "cpu":
        torch.cuda.synchronize()  # the warm-up's queued work is not timed
    with profile(itertools.islice(batches, s.train_steps)) as prof:
        for images, labels in prof:
            step(images, labels)
    st = prof.stats
    return (
        {
            "img_per_s": round(st.images_per_s, 1),
            "wait_share": round(st.wait_share, 4),
            "steps": st.steps,
            "untimed_steps": untimed,
            "images": st.images,
            "seconds": round(st.seconds, 3),
            "cores_busy": None if st.cores_busy is None else round(st.cores_busy, 2),
            "gpu_utilization": st.gpu_utilization,
        }
        | per_image(before, loader_times(pipe), (untimed + st.steps) * s.batch_size)
        | picked_way(pipe)
    )


def model_step(model_name: str, device):
    """One SGD step of torchvision's ``model_name`` (1000 classes, channels_last, bf16
    autocast) on a batch of images and labels, wherever they are: what the training
    checks run (``benchmarks/soak.py`` too)."""
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    model = getattr(torchvision.models, model_name)(num_classes=1000)
    model = model.to(device, memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    kind = "cpu" if str(device) == "cpu" else "cuda"  # the CLI trains on CUDA; tests on the CPU

    def step(images, labels) -> None:
        images = images.to(device, non_blocking=True)
        if not images.is_floating_point():
            images = images.float()
        images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(kind, dtype=torch.bfloat16):
            loss = loss_fn(model(images), labels.to(device, non_blocking=True) % 1000)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return step


def settling(dl) -> bool:
    """Whether ``dl`` (our loader where it picks among ways: ``decoder="dali"`` on CUDA,
    ``cpu_share="auto"``) has yet to finish a trial of its ways, its first or one under
    way (``loader.gpu.tuning.picker``); False for any other (None: a peer's pipeline)."""
    stats = _stats(dl)
    return stats.get("way_trials") == 0 or bool(stats.get("way_trialing"))


def _stats(dl) -> dict:
    """``dl.stats()`` for our loader; empty for anything else (None: a peer's pipeline)."""
    return dl.stats() if hasattr(dl, "stats") else {}


def loader_times(pipe) -> dict | None:
    """Our loader's cumulative stage times (``dl.stats()``'s seconds), None for a peer."""
    dl = getattr(pipe, "dl", None)
    if not hasattr(dl, "stats"):
        return None
    return {k: v for k, v in dl.stats().items() if k.endswith("_s") and isinstance(v, float)}


def picked_way(pipe) -> dict:
    """``{"way": way, "way_trials": n, "way_paces_ms": {way: ms}}``: how our loader makes
    batches after its trials, and each way's pace in the last (``loader.gpu.tuning.picker``); the
    workers' ``cpu_share`` and what steers it with "auto" (``loop_wait_share``,
    ``held_share``, ``loop_waits_held``); empty for any other pipeline."""
    stats = _stats(getattr(pipe, "dl", None))
    keys = ("way", "way_trials", "way_trial_causes", "way_paces_ms", "way_drifts_ms", "cpu_share",
            "loop_wait_share", "held_share", "loop_waits_held")  # fmt: skip
    return {k: stats[k] for k in keys if k in stats}


def decoded_counts(pipe) -> dict | None:
    """Our loader's cumulative samples decoded on each side, None for a peer."""
    dl = getattr(pipe, "dl", None)
    if not hasattr(dl, "stats"):
        return None
    stats = dl.stats()
    return {side: int(stats.get(f"{side}_decoded", 0)) for side in ("gpu", "cpu")}


def decoded_between(before: dict | None, after: dict | None) -> dict:
    """``{"decoded": {"gpu": n, "cpu": n}}`` between two ``decoded_counts``; empty for a
    peer."""
    if before is None or after is None:
        return {}
    return {"decoded": {side: after[side] - before[side] for side in after}}


def per_image(before: dict | None, after: dict | None, images: int) -> dict:
    """``{"loader_us_per_image": {stage: us}}`` spent between two ``loader_times``: where
    our loader's time went (worker times add up over the workers); empty for a peer."""
    if before is None or after is None or not images:
        return {}
    spent = {
        k.removesuffix("_s"): round((v - before.get(k, 0.0)) / images * 1e6, 1)
        for k, v in after.items()
    }
    return {"loader_us_per_image": spent}

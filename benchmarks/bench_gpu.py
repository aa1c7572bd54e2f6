"""The GPU path on a CUDA machine, side by side with its peers, in one run.

Same images, same augmentation (RandomResizedCrop 224 + flip + normalise, float16 or
bfloat16, channels_last), same batch size and workers, page cache warm:

1. ``pil``: torch DataLoader over torchvision ImageFolder (PIL), batches copied to the GPU;
2. ``ours-cpu``: ``loader.DataLoader(decoder="cpu")``: decode in the workers;
3. ``ours-gpu``: ``decoder="nvjpeg"``, ``cpu_share=0``: every baseline JPEG on the GPU;
4. ``ours-gpu-auto``: ``decoder="nvjpeg"``, ``cpu_share="auto"``: the workers decode a
   share sized from measured rates;
5. ``dali-file`` and ``dali-ram`` when DALI is installed: DALI's file reader, and DALI fed
   JPEG bytes held in RAM through ``external_source``, both with
   ``decoders.image_random_crop`` (mixed), resize, ``crop_mirror_normalize``.

Every pipeline reads ``--epochs`` epochs after a warm-up (rounds in rotating order); img/s
is the median, "cores busy" the machine's busy CPU time over the wall time (/proc/stat).
With ``--train-check``: ResNet-50 and ResNet-18 (torchvision, bf16 autocast,
channels_last, SGD) trained on synthetic on-GPU data, then fed by each loader: the share
of the synthetic throughput each loader sustains and the share of step time spent
waiting for data. Writes ``--out``/gpu-<cpus>cpu.json and a table.

    python3 benchmarks/bench_gpu.py --images 20000 --batch-size 256 --workers 16 \
        --train-check [--photos DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

import torch
from common import REPO, image_files, machine, warm

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def cpu_busy() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, now) from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), time.perf_counter()


def make_data(args) -> tuple[Path, Path]:
    from ingest.build import build
    from ingest.format import MANIFEST
    from ingest.synth import make_image_folder

    work = Path(args.workdir)
    src, store = work / "src", work / "store"
    per_class = args.images // args.classes
    stamp = src / f".made-{args.classes}x{per_class}"
    if not stamp.exists():
        make_image_folder(src, args.classes, per_class, seed=0, photos=args.photos,
                          quality=(85, 95))  # fmt: skip
        stamp.touch()
    if not (store / MANIFEST).exists():
        build(src, store, workers=args.workers, progress=False)
    return src, store


# -- pipelines: each a function (args, src, store) -> iterable of (images, labels) on cuda --


def pil(args, src, store):
    import torchvision
    import torchvision.transforms as T

    tf = T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), T.ToTensor(),
                    T.Normalize(MEAN, STD)])  # fmt: skip
    ds = torchvision.datasets.ImageFolder(str(src), transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=args.batch_size, shuffle=True,
                                     num_workers=args.workers, pin_memory=True, drop_last=True,
                                     persistent_workers=True, prefetch_factor=4)  # fmt: skip
    fmt = torch.channels_last

    def epoch():
        for x, y in dl:
            x = x.cuda(non_blocking=True).to(args.dtype, memory_format=fmt)
            yield x, y.cuda(non_blocking=True)

    return epoch


def ours(decoder: str, share):
    def make(args, src, store):
        import loader

        dl = loader.DataLoader(str(store), batch_size=args.batch_size, shuffle=True,
                               num_workers=args.workers, drop_last=True, transform="train",
                               dtype=args.dtype, channels_last=True, device="cuda",
                               pin_memory=True, decoder=decoder, cpu_share=share,
                               persistent_workers=True)  # fmt: skip
        make.loader = dl
        return lambda: iter(dl)

    return make


def dali(kind: str):
    def make(args, src, store):
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        files = image_files(src)
        classes = sorted({p.parent.name for p in files})
        labels = [classes.index(p.parent.name) for p in files]
        out_type = types.FLOAT16 if args.dtype == torch.float16 else types.FLOAT

        @pipeline_def(batch_size=args.batch_size, num_threads=args.workers, device_id=0)
        def pipe():
            if kind == "file":
                jpegs, label = fn.readers.file(file_root=str(src), random_shuffle=True,
                                               name="Reader")  # fmt: skip
            else:
                jpegs, label = fn.external_source(source=ram_source(files, labels, args),
                                                  num_outputs=2, batch=True,
                                                  dtype=[types.UINT8, types.INT32])  # fmt: skip
            images = fn.decoders.image_random_crop(jpegs, device="mixed",
                                                   output_type=types.RGB,
                                                   random_area=[0.08, 1.0],
                                                   random_aspect_ratio=[3 / 4, 4 / 3])  # fmt: skip
            images = fn.resize(images, resize_x=224, resize_y=224)
            images = fn.crop_mirror_normalize(images, dtype=out_type, output_layout="HWC",
                                              mean=[255 * m for m in MEAN],
                                              std=[255 * s for s in STD],
                                              mirror=fn.random.coin_flip())  # fmt: skip
            return images, label.gpu()

        p = pipe()
        p.build()
        policy = LastBatchPolicy.DROP
        if kind == "file":
            it = DALIGenericIterator(p, ["x", "y"], reader_name="Reader",
                                     last_batch_policy=policy, auto_reset=True)  # fmt: skip
        else:
            it = DALIGenericIterator(p, ["x", "y"], size=len(files) // args.batch_size
                                     * args.batch_size, last_batch_policy=policy,
                                     auto_reset=True)  # fmt: skip

        def epoch():
            for out in it:
                # HWC memory is what channels_last NCHW holds: a view, no copy.
                yield out[0]["x"].permute(0, 3, 1, 2), out[0]["y"]

        return epoch

    return make


def ram_source(files, labels, args):
    import numpy as np

    blobs = [np.frombuffer(p.read_bytes(), np.uint8) for p in files]
    targets = np.asarray(labels, dtype=np.int32)
    rng = np.random.default_rng(0)
    state = {"order": rng.permutation(len(files)), "at": 0}

    def source(info=None):
        b = args.batch_size
        if state["at"] + b > len(files):
            state["order"], state["at"] = rng.permutation(len(files)), 0
        idx = state["order"][state["at"] : state["at"] + b]
        state["at"] += b
        return [blobs[i] for i in idx], [targets[i : i + 1] for i in idx]

    return source


PIPELINES = {
    "pil": pil,
    "ours-cpu": ours("cpu", "auto"),
    "ours-gpu": ours("nvjpeg", 0.0),
    "ours-gpu-auto": ours("nvjpeg", "auto"),
    "dali-file": dali("file"),
    "dali-ram": dali("ram"),
}


def run_epoch(epoch, limit: int | None = None) -> tuple[int, float, float]:
    """(images, seconds, cores busy) of one pass (all batches, or the first ``limit``)."""
    busy0, t0 = cpu_busy()
    n = 0
    for k, (x, _) in enumerate(epoch()):
        n += x.shape[0]
        if limit is not None and k + 1 >= limit:
            break
    torch.cuda.synchronize()
    busy1, t1 = cpu_busy()
    return n, t1 - t0, (busy1 - busy0) / (t1 - t0)


# -- training check -------------------------------------------------------------------------


def model_step(name: str, dtype):
    import torchvision

    model = getattr(torchvision.models, name)().cuda().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn(model(x), y % 1000)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def train(step, batches, steps: int, warmup: int = 10) -> dict:
    """img/s over ``steps`` steps after ``warmup``, and the share of time waiting for data."""
    it = iter(batches)
    for _ in range(warmup):
        step(*next(it))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    waited, n = 0.0, 0
    for _ in range(steps):
        w0 = time.perf_counter()
        x, y = next(it)
        waited += time.perf_counter() - w0
        step(x, y)
        n += x.shape[0]
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return {"img_per_s": n / wall, "wait_share": waited / wall}


def forever(epoch):
    while True:
        yield from epoch()


def train_check(args, made: dict) -> dict:
    out = {}
    for model in ("resnet50", "resnet18"):
        step = model_step(model, args.dtype)
        x = torch.randn(args.batch_size, 3, 224, 224, device="cuda", dtype=args.dtype)
        x = x.contiguous(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (args.batch_size,), device="cuda")
        busy0, t0 = cpu_busy()
        synthetic = train(step, itertools.repeat((x, y)), args.train_steps)
        synthetic["cores_busy"] = (cpu_busy()[0] - busy0) / (time.perf_counter() - t0)
        out[model] = {"synthetic": synthetic}
        for name, epoch in made.items():
            busy0, t0 = cpu_busy()
            fed = train(step, forever(epoch), args.train_steps)
            fed["cores_busy"] = (cpu_busy()[0] - busy0) / (time.perf_counter() - t0)
            fed["share"] = fed["img_per_s"] / synthetic["img_per_s"]
            out[model][name] = fed
            print(f"  {model} fed by {name}: {fed['img_per_s']:.0f} img/s, "
                  f"{100 * fed['share']:.1f}% of synthetic, waiting "
                  f"{100 * fed['wait_share']:.1f}%", flush=True)  # fmt: skip
        del step
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    ap.add_argument("--pipelines", default=",".join(PIPELINES))
    ap.add_argument("--train-check", action="store_true")
    ap.add_argument("--train-steps", type=int, default=60)
    ap.add_argument("--photos", default=None, help="folder of JPEG photographs to cut from")
    ap.add_argument("--workdir", default=str(REPO / "bench-data" / "gpu"))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    args.dtype = getattr(torch, args.dtype)
    src, store = make_data(args)
    warm(image_files(src) + list(store.rglob("*.mdb")))
    made, skipped = {}, {}
    for name in args.pipelines.split(","):
        try:
            made[name] = PIPELINES[name](args, src, store)
            run_epoch(made[name], limit=12)  # warm-up: workers, decoders, kernels
        except Exception as e:  # a peer that is missing or fails is listed, never fatal
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            made.pop(name, None)
            print(f"skipped {name}: {skipped[name]}", flush=True)
    rounds = {name: [] for name in made}
    for r in range(args.epochs):
        names = list(made)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            n, secs, cores = run_epoch(made[name])
            rounds[name].append({"img_per_s": n / secs, "cores_busy": cores})
            print(f"round {r} {name}: {n / secs:.0f} img/s, {cores:.1f} cores busy", flush=True)
    results = {
        name: {
            "img_per_s": statistics.median(x["img_per_s"] for x in runs),
            "cores_busy": statistics.median(x["cores_busy"] for x in runs),
            "rounds": runs,
        }
        for name, runs in rounds.items()
    }
    for name in ("ours-gpu", "ours-gpu-auto", "ours-cpu"):
        dl = getattr(PIPELINES[name], "loader", None)
        if name in results and dl is not None:
            results[name]["stats"] = dl.stats()
    report = {"machine": machine_info(), "args": {k: str(v) for k, v in vars(args).items()},
              "results": results, "skipped": skipped}  # fmt: skip
    if args.train_check:
        report["training"] = train_check(args, made)
    report["summary"] = summary(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu-{os.cpu_count()}cpu.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps(report["summary"], indent=1), flush=True)
    print(f"wrote {path}")


def summary(report: dict) -> dict:
    res = report["results"]
    ours_names = [n for n in res if n.startswith("ours-gpu")]
    best = max(ours_names, key=lambda n: res[n]["img_per_s"], default=None)
    dalis = [n for n in res if n.startswith("dali")]
    best_dali = max(dalis, key=lambda n: res[n]["img_per_s"], default=None)
    out = {"ours_best": best}
    if best:
        out["cpu_cores_busy"] = res[best]["cores_busy"]
        if "pil" in res:
            out["vs_pil"] = res[best]["img_per_s"] / res["pil"]["img_per_s"]
        if best_dali:
            out["dali_best"] = best_dali
            out["vs_dali"] = res[best]["img_per_s"] / res[best_dali]["img_per_s"]
    training = report.get("training", {})
    for model in ("resnet50", "resnet18"):
        fed = [v for k, v in training.get(model, {}).items() if k.startswith("ours-gpu")]
        if fed:
            out[f"{model}_share"] = max(v["share"] for v in fed)
    return out


def machine_info() -> dict:
    info = machine()
    info["cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import torchvision

        info["torchvision"] = torchvision.__version__
    except ImportError:
        pass
    try:
        import nvidia.dali

        info["dali"] = nvidia.dali.__version__
    except ImportError:
        info["dali"] = None
    try:
        import subprocess

        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        info["driver"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return info


if __name__ == "__main__":
    main()

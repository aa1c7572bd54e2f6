"""Helpers of the GPU path's tests, shared by both GPU decoders' suites
(loader/gpu/test_gpu_path.py, loader/gpu/test_gpu_dali.py): the loader they build, what they
read of its epochs, and the checks both run (rows read where they lie, slots kept until
their GPU work is done, batches never overwritten, nothing held longer, closing at exit).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import torch
from fixtures import TESTS, held_over_epochs
from gpu_path_data import (
    BACKEND,
    CUDA,
    DEVICE,
    NUM_SAMPLES,
    SIZE,
    pil_resized_crop,
)
from PIL import Image

pytest.importorskip("triton")

import loader
from ingest import format as fmt
from loader.augment import Transform, plan_crops
from loader.gpu.stage import GpuStage
from loader.gpu.tuning.share import WindowShare
from loader.plan.sampler import batch_seed
from loader.store import Store

B = 8  # 23 samples: batches of 8, 8, 7
EVAL = Transform("eval", SIZE)
TRAIN = Transform("train", SIZE)
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def make(store, **kwargs) -> loader.DataLoader:
    args = {
        "batch_size": B, "transform": EVAL, "device": DEVICE, "decoder": BACKEND,
        "with_indices": True, "num_workers": 2, "shuffle": True, "seed": 5,
        "dtype": torch.uint8,
    }  # fmt: skip
    return loader.DataLoader(store, **{**args, **kwargs})


def batch_seeds(n: int) -> list[int]:
    """The seeds of ``make``'s first epoch's ``n`` batches (seed 5, rank 0)."""
    return [int(batch_seed(5, 0, step, rank=0)) for step in range(n)]


def epoch(dl) -> list[tuple]:
    return [tuple(t.cpu() for t in batch) for batch in dl]


def flat(batches, k: int) -> torch.Tensor:
    return torch.cat([b[k] for b in batches])


def mean_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().mean())


def pil_reference(store, spec, batches, seed: int) -> torch.Tensor:
    """What torchvision's PIL pipeline makes of each delivered sample, with the windows
    the sampler planned for its batch (as ``PixelBatches.plan`` draws them)."""
    st = Store(store)
    out = []
    for step, (_, _, indices) in enumerate(batches):
        idx = indices.numpy()
        rng = np.random.default_rng(batch_seed(seed, 0, step, rank=0))
        crops = plan_crops(spec, st.index["height"][idx], st.index["width"][idx], rng)
        for i, crop in zip(idx.tolist(), crops, strict=True):
            data, kind = st.image(i)
            if kind == "raw":  # a pixel record: its pixels, gray ones as RGB
                h, w = int(st.index["height"][i]), int(st.index["width"][i])
                rgb = np.frombuffer(data, np.uint8).reshape(h, w, -1)
                rgb = rgb if rgb.shape[2] == 3 else rgb.repeat(3, axis=2)
            else:
                rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
            mode = "bicubic" if crop[9] else "bilinear"  # the row says (spec: maybe random)
            ref = pil_resized_crop(rgb, crop, spec.size, mode)
            out.append(torch.from_numpy(ref).permute(2, 0, 1))
    return torch.stack(out)


def record_ways_and_shares(stage) -> list[list]:
    """Hold ``stage``'s share at 0.5, never steered (never told whether the loop waits),
    and record [the workers' rows, the way] of each batch as it is finished."""
    stage.loop = WindowShare(10**6)
    stage.routing.share = 0.5
    finished: list[list] = []

    def account(report, on_gpu, on_cpu, decode_s, mapped, windows, real=stage._account):
        real(report, on_gpu, on_cpu, decode_s, mapped, windows)
        finished.append([on_cpu])

    def steer(waited, busy, way, real=stage._steer):
        real(waited, busy, way)
        finished[-1].append(way)

    stage._account, stage._steer = account, steer
    return finished


def assert_half_shared_by_way(stage, finished: list[list], batches: list) -> list[str]:
    """Each batch of a way "+cpu" had half its GPU-decodable samples (rounded) decoded by
    the workers, the others none of them (``finished``: ``record_ways_and_shares``'s, in
    the order of ``batches``); the ways, batch by batch."""
    for (on_cpu, way), batch in zip(finished, batches, strict=True):
        gpu = int(stage.producer._gpu_ok[batch[2].numpy()].sum())  # the rest: the workers'
        share = round(0.5 * gpu) if way.endswith("+cpu") else 0
        assert on_cpu == len(batch[2]) - gpu + share
    return [way for _, way in finished]


def cpu_rows(store, indices) -> set[int]:
    """Rows of a batch that the workers decode whatever the share (PNG, progressive)."""
    index = Store(store).index
    fmts, flags = index["format"][indices.numpy()], index["flags"][indices.numpy()]
    jpeg = (fmts == fmt.FORMAT_CODES["jpeg"]) & ((flags & fmt.FLAG_PROGRESSIVE) == 0)
    return set(np.flatnonzero(~jpeg).tolist())


def gpu_threads() -> list[str]:
    """The loader's GPU-path threads still alive (prefetch, decode)."""
    return [t.name for t in threading.enumerate() if t.name.startswith("imfeed-gpu-")]


def assert_rows_read_where_they_lie(make, store, monkeypatch, persistent: bool) -> None:
    """The workers' rows, gathered by a kernel from the ring's registered memory
    (``loader.gpu.mapped``) for three epochs (without ``persistent_workers``, workers forked
    after the registration write them), are bit for bit those copied through a pinned
    buffer; closing the loader undoes the registration."""
    got = make(store, cpu_share=0.5, persistent_workers=persistent)
    batches = [epoch(got) for _ in range(3)]
    stats, mapped = got.stats(), got._gpu_stage.uploads.rows_mapped
    assert stats["mapped_rows"] == stats["cpu_decoded"] > 0
    got.close()
    rt = torch.cuda.cudart()  # not registered any more: it registers anew
    assert int(rt.cudaHostRegister(mapped.array.data_ptr(), mapped.array.nbytes, 0)) == 0
    assert int(rt.cudaHostUnregister(mapped.array.data_ptr())) == 0
    monkeypatch.setattr(GpuStage, "map_ring", lambda self, tensors: None)
    want = make(store, cpu_share=0.5, persistent_workers=persistent)
    for one in batches:
        same_batches(one, epoch(want))
    assert "mapped_rows" not in want.stats() and want.stats()["cpu_decoded"] > 0


def assert_holds_nothing_more(dl, abandon: bool, epochs: int = 8) -> None:
    """``epochs`` epochs of ``dl``, whole or each left after 2 batches (as a bounded loop
    leaves them: its threads stop once it is dropped), hold exactly the descriptors,
    threads and workers the second held; closed, it keeps no thread and no worker."""

    def settle() -> None:  # read whole, an epoch's iteration and threads carry on
        wait_for_no_gpu_threads(keep=0 if abandon else 1)

    held = held_over_epochs(dl, epochs, abandon, settle=settle)
    assert held[-1] == held[1], held
    dl.close()
    wait_for_no_gpu_threads()
    assert not gpu_threads() and dl.worker_pids == []


def wait_for_no_gpu_threads(seconds: float = 10, keep: int = 0) -> None:
    """Wait (at most ``seconds``) until no GPU-path thread is left, or with ``keep=1``
    until none is there twice (one iteration's threads only: no old one still stopping)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        names = gpu_threads()
        if len(names) <= keep * len(set(names)):
            return
        time.sleep(0.01)


class _Pending:
    """A batch's event whose GPU work completes after ``queries`` queries (None: only when
    waited for); on completing it notes whether the batch's slot still holds what it held
    when the batch was finished. On a GPU it stands in front of the stage's real event
    (``real``): the training stream waits for that one, and completing waits for it too."""

    def __init__(self, views: dict, seen: list, queries: int | None, real=None) -> None:
        self.views, self.seen, self.left, self.done = views, seen, queries, False
        self.before = {k: np.array(v, copy=True) for k, v in views.items()}
        self.real = real
        # The prefetch thread (giving slots back) and, on a GPU, the training loop (handing
        # the batch off) both ask: it completes once, whoever asks.
        self.lock = threading.RLock()

    def wait(self, stream) -> None:
        if self.real is not None:
            self.real.wait(stream)

    def query(self) -> bool:
        with self.lock:
            if self.left is not None:
                self.left -= 1
                if self.left < 0:
                    self.synchronize()
            return self.done

    def synchronize(self) -> None:
        with self.lock:
            if self.done:
                return
            if self.real is not None:
                self.real.synchronize()
            self.done = True
            unchanged = all(np.array_equal(self.before[k], v) for k, v in self.views.items())
            self.seen.append(unchanged)


def assert_slots_kept_until_done(dl, stage_class, monkeypatch, queries: int | None = 3):
    """``finish`` returns once a batch's GPU work is queued, and DALI may read the JPEGs in
    the slot until it is done (``dali_stage.NO_COPY``): over two epochs of ``dl``, each
    slot is refilled only after its batch's event completed (after ``queries`` queries, or
    never until waited for: the ring runs out, and a batch waits for a slot), and every
    sample comes once."""
    seen: list[bool] = []
    made = []  # (persistent workers: and the first batches of a third epoch)
    finish = stage_class.finish

    def pending_finish(self, started, waited=0.0):
        images, labels, indices, event = finish(self, started, waited)
        made.append(len(indices))
        return images, labels, indices, _Pending(started.views, seen, queries, event)

    monkeypatch.setattr(stage_class, "finish", pending_finish)
    try:
        for _ in range(2):
            got = sorted(int(i) for _images, _labels, indices in dl for i in indices)
            assert got == list(range(NUM_SAMPLES))
    finally:
        dl.close()
    assert len(made) >= 2 * len(dl) and seen == [True] * len(made)


def assert_never_overwritten(dl, stream: torch.cuda.Stream | None = None) -> None:
    """Hold four delivered batches over three epochs of ``dl`` (``with_indices``) while
    the device is kept busy, then check they are unchanged (bit for bit: a NaN equals
    itself), and that every batch was finite when delivered (a NaN there is pixels not
    yet written: wrong, whatever happens to them later). The training loop runs on
    ``stream`` where given (else the default stream, which some copies wait for
    implicitly where a stream of the user's own would not)."""
    held, copies, not_finite = [], [], []
    with torch.cuda.stream(stream):
        for e in range(3):
            for k, (images, labels, _) in enumerate(dl):
                if len(held) < 4:
                    held.append((images, labels))
                    copies.append((images.clone(), labels.clone()))
                if images.is_floating_point():  # read after the loop: the host never waits
                    not_finite.append((e, k, (~images.isfinite()).flatten(1).any(1)))
                # keep the device busy so that a missing wait would show
                torch.cuda._sleep(1_000_000)
    torch.cuda.synchronize()
    not_finite = [(e, k, r.nonzero().flatten().tolist()) for e, k, r in not_finite if r.any()]
    assert not not_finite, f"(epoch, batch, rows) delivered with NaN or inf: {not_finite}"
    for k, ((images, labels), (i0, l0)) in enumerate(zip(held, copies, strict=True)):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[images.element_size()]
        changed = (images.view(bits) != i0.view(bits)).flatten(1).any(1).nonzero().flatten()
        assert not changed.tolist(), f"batch {k}: rows {changed.tolist()} changed"
        assert torch.equal(labels, l0), f"batch {k}: labels changed"


def same_batches(got: list[tuple], want: list[tuple]) -> None:
    """Batch for batch: the same samples, labels and pixels (bit for bit)."""
    assert [len(b[0]) for b in got] == [len(b[0]) for b in want]
    for k in (2, 1, 0):
        assert torch.equal(flat(got, k), flat(want, k)), k


def all_freed(refs: list[weakref.ref], timeout: float = 10.0) -> bool:
    """Whether every referent of ``refs`` goes within ``timeout`` (a prefetch thread may
    hold one for the batch it is on)."""
    deadline = time.monotonic() + timeout
    while any(r() is not None for r in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


AT_EXIT = """
import atexit, sys
sys.path.insert(0, {tests!r})
import pytest, torch, loader
from gpu_path_data import use_stand_ins
from gpu_checks import make, TRAIN
import loader.decode as registry
mp = pytest.MonkeyPatch()
use_stand_ins(mp)
mp.setitem(registry._BACKENDS, "dalicpu", "gpu_path_data:DaliCpuDecoder")
seen = []
atexit.register(lambda: print("workers at the earlier hook:", seen[0]._workers.pool))
dl = make({store!r}, transform=TRAIN, decoder={decoder!r}, persistent_workers=True)
seen.append(dl)
for _ in dl:  # the prefetch thread goes on into the next epoch
    pass
print("read")
"""


def exits_without_closing(store, decoder: str) -> subprocess.CompletedProcess:
    """A script that reads an epoch and exits without closing its loader."""
    code = AT_EXIT.format(tests=str(TESTS), store=str(store), decoder=decoder)
    env = {**os.environ, "TRITON_INTERPRET": "1"} if not CUDA else None
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )

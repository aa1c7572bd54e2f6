"""The executor a DataLoader runs: the producer its workers run, the ring they fill and,
on the GPU path, the GPU stage that finishes each batch.

The decoder decides the path: one that runs in the workers ("cpu") makes pixels there
(``loader.cpu``); the others have the workers gather encoded bytes (and decode a CPU share)
and the GPU decode and augment them (``loader.gpu``), with more ring slots in flight.
"""

from __future__ import annotations

from typing import NamedTuple

from loader.cpu.batches import PixelBatches
from loader.decode import runs_in_workers, runs_whole_stage
from loader.gpu.dali_stage import DaliStage
from loader.gpu.encoded import EncodedBatches
from loader.gpu.slots import batches_on_gpu, ring_slots
from loader.gpu.stage import GpuStage
from loader.ring import Ring


class Executor(NamedTuple):
    producer: PixelBatches | EncodedBatches
    ring: Ring
    gpu_stage: GpuStage | None  # None on the CPU path


def build_executor(
    store, transform, decoder: str, device, output, stats, settings, channels_last: bool,
    cpu_share,
) -> Executor:  # fmt: skip
    """The parts of the path ``decoder`` takes, sized from ``settings`` (a ``Settings``)."""
    batch_size, num_workers = settings.batch_size, settings.num_workers
    gpu_stage: GpuStage | None = None
    if runs_in_workers(decoder):
        if transform.erasing is not None and not output.dtype.is_floating_point:
            raise ValueError(
                f"the recipe's RandomErasing erases normalised pixels, but dtype={output.dtype}"
                "; pass a float dtype (e.g. torch.float32)"
            )
        producer = PixelBatches(store, transform, batch_size, decoder, planar=not channels_last)
        slots = 1 if num_workers == 0 else num_workers * settings.prefetch_factor
    else:  # workers gather encoded bytes (and decode a CPU share); the GPU does the rest
        producer = EncodedBatches(store, transform, batch_size)
        stage = DaliStage if runs_whole_stage(decoder) else GpuStage
        gpu_stage = stage(
            producer, transform, output.dtype, channels_last, device, decoder, cpu_share,
            num_workers, stats,
        )  # fmt: skip
        # and one finished, whose slot waits for its GPU work (GpuEpochIterator)
        on_gpu = batches_on_gpu(gpu_stage.concurrent_calls) + 1
        slots = ring_slots(batch_size, num_workers, settings.prefetch_factor, on_gpu)
    ring = Ring(producer.buffers(), slots, shared=num_workers > 0)
    if gpu_stage is not None:
        gpu_stage.map_ring(ring.tensors)
    return Executor(producer, ring, gpu_stage)

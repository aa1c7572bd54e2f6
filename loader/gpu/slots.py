"""How many ring slots and tasks the GPU path uses: enough batches in flight that every
worker holds a task and the GPU decoder always has a call waiting, few enough that the
ring's shared memory stays small."""

from __future__ import annotations

from loader.plan.tasks import chunk_size

_MIN_GATHER_CHUNK = 64  # samples per worker task on the GPU path
_MAX_SLOTS = 16  # each slot holds a batch's bytes and a batch of CPU-decoded pixels


def gather_chunk(batch_size: int, num_workers: int) -> int:
    """Samples per worker task on the GPU path: gathering bytes is cheap, so fewer, larger
    tasks (fewer pipe messages, each costing the prefetch thread a GIL hand-off)."""
    return max(chunk_size(batch_size, num_workers), _MIN_GATHER_CHUNK)


def ring_slots(batch_size: int, num_workers: int, prefetch_factor: int, on_gpu: int = 2) -> int:
    """Ring slots of the GPU path: ``on_gpu`` batches in the GPU stage's hands (being
    finished, decoding, queued for the decoder), and enough batches in the workers' hands
    for every worker to hold a task."""
    if num_workers == 0:
        return 1
    chunks = -(-batch_size // gather_chunk(batch_size, num_workers))  # tasks per batch
    busy_workers = -(-num_workers // chunks) + on_gpu
    return max(on_gpu + 1, 2 * prefetch_factor, min(busy_workers, _MAX_SLOTS))


def batches_on_gpu(concurrent_calls: int) -> int:
    """Batches the GPU stage holds at once: the one being finished, and one submitted per
    decode thread, so that the decoder always has a call waiting."""
    return 1 + max(1, concurrent_calls)

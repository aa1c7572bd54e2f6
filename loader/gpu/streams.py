"""The GPU stages' side streams, lent from a pool, and the events that close their work.

The pool exists for torch's caching allocator: it reuses a freed block only for
allocations on the stream the block was made on, so a loader built again (a rebuild after
a preemption) must get the streams of the one before it, or that one's cached blocks serve
no one. Off CUDA (the CPU, in tests) there are no streams and events are completed
stand-ins.
"""

from __future__ import annotations

import contextlib
import threading

import torch


class StreamPool:
    """Side streams by (device, role), given back when their stage is released or let go,
    and lent again to the next stage made. Any thread."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, str], list] = {}
        self._lock = threading.Lock()

    def lend(self, device: torch.device, role: str) -> torch.cuda.Stream:
        """A stream of ``role`` on ``device``: one given back, else a new one (of high
        priority: data before training work)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            free = self._free.get((index, role))
            if free:
                return free.pop()
        return torch.cuda.Stream(index, priority=-1)

    def give_back(self, lent: dict) -> None:
        """Take back the streams of ``lent`` (role: stream), which is emptied: given once."""
        with self._lock:
            while lent:
                role, stream = lent.popitem()
                self._free.setdefault((stream.device.index, role), []).append(stream)


STREAMS = StreamPool()  # the process's pool, shared by every stage


def on_side_stream(device: torch.device, stream) -> contextlib.AbstractContextManager:
    """Make ``stream`` (on ``device``) current inside the block; nothing where it is None."""
    if stream is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


class Done:
    """A completed event, where there is no CUDA stream (the CPU, in tests)."""

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return 0.0


def recorded_event(device: torch.device):
    """A timing event recorded now on the current stream (a completed stand-in on CPU)."""
    if device.type != "cuda":
        return Done()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

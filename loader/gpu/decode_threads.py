"""DecodeThreads: the threads that call the GPU decoder for the prefetch thread.

The decoder blocks the thread calling it for a whole batch (releasing the GIL): calls
submitted ahead, one per thread, already wait inside the decoder when the current one
ends, where a single thread one batch ahead first waited for the GIL.
"""

from __future__ import annotations

import queue
import threading
import time

from loader.gpu.calls import Call


class DecodeThreads:
    """``count`` daemon threads running submitted calls (started in order); ``submit``
    returns a ``Call``."""

    def __init__(self, count: int = 1) -> None:
        self._count = max(1, count)
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def submit(self, fn) -> Call:
        call = Call(fn)
        if self._stopping.is_set():  # cancelled or stopped: nothing would ever run it
            call.cancel()
            return call
        if not self._threads:
            for k in range(self._count):
                thread = threading.Thread(
                    target=_serve,
                    args=(self._calls, self._stopping),
                    name=f"imfeed-gpu-decode-{k}",
                    daemon=True,
                )
                thread.start()
                self._threads.append(thread)
        self._calls.put(call)
        return call

    def cancel(self) -> None:
        """Cancel the calls not started yet, and any submitted later."""
        self._stopping.set()

    def stop(self, timeout: float) -> bool:
        """Let the threads finish the calls they are in, cancel the others and end; False
        if one is still busy after ``timeout``."""
        self._stopping.set()
        for _ in self._threads:
            self._calls.put(None)
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)


def _serve(calls: queue.SimpleQueue, stopping: threading.Event) -> None:
    while (call := calls.get()) is not None:
        if stopping.is_set():
            call.cancel()
        else:
            call.run()
        # Not held until the next call: the caller may have let go of it (the stage).
        del call

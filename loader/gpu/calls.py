"""Call: a call whose outcome one thread waits for while another makes it.

The few parts of a ``concurrent.futures.Future`` the GPU path uses (a batch's decode, run
in a decode thread of ``loader.gpu.prefetch``), but the outcome is let go of as it is
taken: an error's traceback holds the frames of the thread that waited for it, whose
locals hold the call, so a Future keeping the error made a cycle that kept the stage, the
iterator and the loader alive until a full collection (``tests/test_gpu_path.py``).
"""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError


class Call:
    """A call made once, by ``run`` in some thread, its outcome taken once by ``result``
    in another (or made at once: ``of``)."""

    def __init__(self, fn=None) -> None:
        self.fn = fn
        self._done = threading.Event()
        self._outcome: tuple | None = None  # (True, value) or (False, error)

    @classmethod
    def of(cls, fn) -> Call:
        """``fn`` called here (its error raised here)."""
        call = cls()
        call._outcome = (True, fn())
        call._done.set()
        return call

    def run(self) -> None:
        """Make the call (once), in the calling thread."""
        fn, self.fn = self.fn, None
        if fn is None or self._done.is_set():
            return
        try:
            outcome = (True, fn())
        except BaseException as e:  # the waiting thread raises it
            outcome = (False, e)
        del fn  # (the stage, in the loader)
        self._outcome = outcome
        del outcome
        self._done.set()
        # An error's traceback holds this frame (its callees' caller): not the call, which
        # holds the error until it is taken (a cycle, where it never is).
        del self

    def cancel(self) -> None:
        """Where it has not run: it never will, and ``result`` raises CancelledError."""
        if not self._done.is_set():
            self.fn, self._outcome = None, (False, CancelledError())
            self._done.set()

    def cancelled(self) -> bool:
        outcome = self._outcome
        return outcome is not None and isinstance(outcome[1], CancelledError)

    def result(self, timeout: float | None = None):
        """The call's value, or its error raised; taken once."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the call was not done within {timeout} s")
        outcome, self._outcome = self._outcome, None
        if outcome is None:
            raise RuntimeError("imfeed bug: a call's outcome was taken twice")
        ok, value = outcome
        del outcome
        if ok:
            return value
        try:
            raise value
        finally:
            del value

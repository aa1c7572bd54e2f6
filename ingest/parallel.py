"""A pool of forked workers: tasks to idle workers, results as they end, failures surfaced.

The build's tasks are coarse (verify a range of samples, write a whole shard), so the
parent only hands out task descriptions and takes back small results (plans, shard
entries): the records themselves never pass through it. The workers are forked at once,
before any thread the caller starts next (a progress bar's), and die with the parent
(``PR_SET_PDEATHSIG``): a worker never goes on writing into OUT after the build died.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Hashable, Iterator
from multiprocessing.connection import Connection, Pipe, wait
from typing import Any

_PR_SET_PDEATHSIG = 1  # prctl option (Linux)


def can_fork() -> bool:
    return hasattr(os, "fork")


class WorkerError(RuntimeError):
    """A task raised an error that cannot travel back as it is (its traceback is the message)."""


class WorkerDied(WorkerError):
    """A worker died in a task (killed, out of memory); the message says how."""


class InlinePool:
    """The same interface with no worker: each task runs in this process when submitted."""

    def __init__(self) -> None:
        self._done: list[tuple[Hashable, Any]] = []

    @property
    def idle(self) -> int:
        return 0 if self._done else 1

    @property
    def busy(self) -> int:
        return len(self._done)

    def submit(self, key: Hashable, fn: Callable, *args) -> None:
        self._done.append((key, fn(*args)))

    def wait(self) -> list[tuple[Hashable, Any]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ForkPool(InlinePool):
    """``workers`` forked processes, each running one task at a time.

    ``submit`` gives a task to an idle worker (there must be one: see ``idle``); ``wait``
    blocks until at least one task ends and returns ``[(key, result)]``. An exception in
    a task is raised by ``wait``: as itself when it can be pickled (an OSError, an LMDB
    error, the build's own errors), else as WorkerError with the worker's traceback; a
    worker that dies is reported as WorkerDied, with its exit status. ``close`` stops the workers.
    """

    def __init__(self, workers: int) -> None:
        self._workers: list[tuple[int, Connection]] = []
        self._free: list[int] = []
        self._running: dict[int, Hashable] = {}
        try:
            for k in range(workers):
                self._workers.append(_start())
                self._free.append(k)
        except BaseException:
            self.close()
            raise

    @property
    def idle(self) -> int:
        return len(self._free)

    @property
    def busy(self) -> int:
        return len(self._running)

    def submit(self, key: Hashable, fn: Callable, *args) -> None:
        k = self._free.pop()
        pid, conn = self._workers[k]
        try:
            conn.send((fn, args))
        except OSError:  # died while idle (the out-of-memory killer): as one dead in a task
            raise WorkerDied(f"ingest worker {k} (pid {pid}) died: {_exit_status(pid)}") from None
        self._running[k] = key

    def wait(self) -> list[tuple[Hashable, Any]]:
        by_conn = {self._workers[k][1]: k for k in self._running}
        done = []
        for conn in wait(list(by_conn)):
            k = by_conn[conn]
            done.append((self._running.pop(k), self._receive(k)))
            self._free.append(k)
        return done

    def _receive(self, k: int) -> Any:
        pid, conn = self._workers[k]
        try:
            ok, value = conn.recv()
        except (EOFError, OSError):
            raise WorkerDied(f"ingest worker {k} (pid {pid}) died: {_exit_status(pid)}") from None
        if ok:
            return value
        error, text = value
        if error is not None:
            raise error
        raise WorkerError(f"ingest worker {k} (pid {pid}) failed:\n{text}")

    def close(self) -> None:
        for pid, conn in self._workers:
            conn.close()  # a worker waiting for a task sees the end of its pipe and exits
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)  # one in a task stops now
        for pid, _ in self._workers:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._workers, self._free, self._running = [], [], {}


def ordered(pool: InlinePool, fn: Callable, arglist: list[tuple]) -> Iterator:
    """``fn(*args)`` for each ``args`` of ``arglist`` on the pool's workers; the results
    in the order of ``arglist``. Consume it to the end: it shares the pool's workers."""
    results: dict[int, Any] = {}
    submitted = 0
    for k in range(len(arglist)):
        while pool.idle and submitted < len(arglist):
            pool.submit(submitted, fn, *arglist[submitted])
            submitted += 1
        while k not in results:
            results.update(pool.wait())
        yield results.pop(k)


@contextlib.contextmanager
def inherited_objects_frozen() -> Iterator[None]:
    """Fork workers inside this block, each calling ``freeze_inherited()`` first: they
    never finalise what they inherit.

    A garbage collection in a forked worker would run the parent's destructors on its
    copies (a CUDA tensor or event, a DALI pipeline: the worker aborts). The collector is
    off during the block, so nothing is collected between the fork and the worker's
    freeze; the parent's own generations are left alone (a freeze of the caller's stays
    as it was, and nothing of the parent is exempted from collection for good).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_inherited() -> None:
    """First thing in a worker forked inside ``inherited_objects_frozen``: what it inherited
    is never collected there; what it makes itself is, as usual."""
    gc.freeze()
    gc.enable()


def _start() -> tuple[int, Connection]:
    parent_end, child_end = Pipe()
    parent = os.getpid()
    with inherited_objects_frozen():
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            freeze_inherited()
            status = 1
            try:
                parent_end.close()
                status = _serve(child_end, parent)
            finally:
                os._exit(status)
    child_end.close()
    return pid, parent_end


def _serve(conn: Connection, parent: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    # The parent stops us with SIGTERM: die quietly, whatever handler the parent had
    # installed (Ray's prints a stack trace from C++).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _die_with(parent)
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return 0  # the parent is done with us
        try:
            reply = (True, fn(*args))
        except BaseException as e:
            reply = (False, (_travels(e), traceback.format_exc()))
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return 0


def _die_with(parent: int) -> None:
    """Have the kernel kill this worker when the parent dies (even of kill -9)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above took effect
        os._exit(1)


def _travels(e: BaseException) -> BaseException | None:
    """``e`` when it survives pickling (so the parent raises it as it is), else None."""
    try:
        copy = pickle.loads(pickle.dumps(e))
    except Exception:  # not picklable, or not rebuilt from its args
        return None
    return copy if type(copy) is type(e) and str(copy) == str(e) else None


def _exit_status(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"

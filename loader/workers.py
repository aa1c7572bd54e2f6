"""Worker processes that run batch tasks into a shared-memory ring, and notice when one dies.

Each worker owns a duplex pipe: the main process sends it ``(slot, step, args)`` tasks, it
writes (part of) a batch into ring slot ``slot`` and answers with the slot number and a
small report. A batch crosses processes as one shared buffer, never as a tensor per sample
(that exhausts torch's file-descriptor sharing and has hung 16-worker loaders). The main
process waits on the pipes and on the workers' process sentinels together, so a worker that
is killed surfaces at once as an error naming it, never as a hang.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from ingest import format as fmt
from ingest.parallel import freeze_inherited, inherited_objects_frozen
from loader.decode import mark_worker_process
from loader.ring import SHM, Ring

_PARENT_CHECK_S = 2.0  # how often an idle worker checks that the main process still exists
_JOIN_TIMEOUT_S = 5.0


def _worker_loop(
    wid: int, producer, tensors: dict, conn, init_fn, parent: int, nice: int = 0
) -> None:
    """Body of worker ``wid``: run tasks from ``conn`` until told to stop or orphaned."""
    freeze_inherited()  # never finalise the training process's objects (CUDA ones abort)
    if nice:  # the training process's threads first; the workers take the cores left
        with contextlib.suppress(OSError):  # a sandbox that forbids it: as it was
            os.nice(nice)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    mark_worker_process()
    torch.set_num_threads(1)  # the workers are the parallelism
    views = {name: t.numpy() for name, t in tensors.items()}
    try:
        if init_fn is not None:
            init_fn(wid)
    except Exception:
        conn.send(("error", None, None, "worker_init_fn failed:\n" + traceback.format_exc()))
        return
    while True:
        if not conn.poll(_PARENT_CHECK_S):
            if os.getppid() != parent:  # the main process is gone: do not linger
                return
            continue
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        slot, step, args = task
        try:
            report = producer.fill({k: v[slot] for k, v in views.items()}, *args)
            conn.send(("ok", slot, step, report))
        except fmt.StoreError as e:  # the store is unusable: the same one line as without workers
            try:
                conn.send(("store", slot, step, e.with_traceback(None)))
            except Exception:  # an argument that does not pickle: its message, then
                conn.send(("store", slot, step, fmt.StoreError(str(e))))
        except Exception:
            conn.send(("error", slot, step, traceback.format_exc()))


def death_cause(exitcode: int | None) -> str:
    """A readable cause for a worker's exit code."""
    if exitcode is None:
        return "closed its pipe while still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = ""
        if name == "SIGKILL":
            hint = (
                " (often the kernel's out-of-memory killer: see `dmesg`; lower num_workers"
                " or batch_size)"
            )
        elif name == "SIGBUS":
            hint = (
                f" (often shared memory running out: see `df {SHM}`; in Docker, give it "
                "more with `--shm-size`; or a store file damaged in place: check the store "
                "with `ingest verify`)"
            )
        return f"killed by signal {name}{hint}"
    return f"exited with code {exitcode}"


class WorkerPool:
    """``num_workers`` processes running ``producer.fill`` into ``ring``.

    Args:
        producer: picklable object with ``fill(slot_views, *args) -> report``.
        ring: the shared buffers the workers write into.
        num_workers: processes to start.
        context: a multiprocessing context ("fork" or "spawn" style).
        worker_init_fn: called with the worker id in each worker, as in torch.
        nice: added to each worker's niceness (``os.nice``) as it starts.
    """

    def __init__(
        self,
        producer,
        ring: Ring,
        num_workers: int,
        context,
        worker_init_fn: Callable[[int], None] | None = None,
        nice: int = 0,
    ) -> None:
        self._procs: list[mp.process.BaseProcess] = []
        self._sentinels: dict[int, int] = {}  # a worker's process sentinel -> its number
        self._conns = []
        # A loop's thread may drain the pool while the prefetch thread waits on it: a pipe
        # is read by one thread at a time.
        self._reading = threading.Lock()
        self.outstanding = [0] * num_workers
        self._done: list[tuple[int, int, object]] = []  # results read, not yet handed out
        self._stopping = False  # close() began: what fails from now on is its doing
        try:
            with inherited_objects_frozen():  # a forked worker must not free CUDA objects
                self._start(producer, ring, num_workers, context, worker_init_fn, nice)
        except BaseException:
            self.close(graceful=False)
            raise

    def _start(
        self, producer, ring: Ring, num_workers: int, context, worker_init_fn, nice: int
    ) -> None:
        for wid in range(num_workers):
            here, there = context.Pipe(duplex=True)
            proc = context.Process(
                target=_worker_loop,
                name=f"imfeed-worker-{wid}",
                daemon=True,
                args=(wid, producer, ring.tensors, there, worker_init_fn, os.getpid(), nice),
            )
            proc.start()
            there.close()
            self._procs.append(proc)
            self._sentinels[proc.sentinel] = wid
            self._conns.append(here)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def submit(self, task: tuple[int, int, tuple]) -> None:
        """Send ``(slot, step, args)`` to the least busy worker: it runs
        ``producer.fill(slot's buffers, *args)``.

        When no worker is idle by the counts, results already sent are read first, so that
        a worker that has finished counts as idle: otherwise ties go to the lowest-numbered
        workers, whose queues grow while others idle (tasks of uneven length, the GPU
        path's CPU share above all). With an idle worker there is nothing to read for.
        """
        with self._unless_stopped():
            if min(self.outstanding) > 0:
                self._collect(0)
            wid = min(range(len(self.outstanding)), key=self.outstanding.__getitem__)
            try:
                self._conns[wid].send(task)
            except OSError:  # BrokenPipeError: the worker is gone
                self._raise_dead(wid)
            self.outstanding[wid] += 1

    def check_alive(self) -> None:
        """Raise if any worker has exited."""
        with self._unless_stopped():
            for wid, proc in enumerate(self._procs):
                if proc.exitcode is not None:
                    self._raise_dead(wid)

    def receive(self, timeout: float) -> list[tuple[int, int, object]]:
        """Wait up to ``timeout`` s for finished tasks; return their (step, slot, report).

        Raises:
            RuntimeError: a worker died, or a task failed in a worker (with its traceback).
        """
        with self._unless_stopped():
            self._collect(0 if self._done else timeout)
            done, self._done = self._done, []
        return done

    def _collect(self, timeout: float) -> None:
        """Read the results that arrive within ``timeout`` s into ``_done``."""
        sentinels = self._sentinels
        ready = wait([*self._conns, *sentinels], timeout)
        with self._reading:  # another thread may have waited too, and read a pipe since
            for wid, conn in enumerate(self._conns):
                if conn in ready and conn.poll(0):  # before the sentinels: a failing
                    self._done.append(self._message(wid))  # worker reports, then exits
            for obj in ready:
                if obj in sentinels:
                    self._raise_dead(sentinels[obj])

    @contextlib.contextmanager
    def _unless_stopped(self):
        """Around a use of the workers: where ``close`` stops them meanwhile (on another
        thread), what that does to the use (a worker killed by SIGTERM, a pipe closed) is
        said as the stop it is."""
        # Waiting on no pipes would return nothing forever: a hang, not an error.
        if not self._procs:
            raise _stopped()
        try:
            yield
        except (_Died, OSError, EOFError, ValueError):  # not a worker's own error: it stands
            if self._stopping:
                raise _stopped() from None
            raise

    def _message(self, wid: int) -> tuple[int, int, object]:
        try:
            kind, slot, step, payload = self._conns[wid].recv()
        except (EOFError, OSError):
            self._raise_dead(wid, read=False)
        if kind == "store":
            raise payload
        if kind == "error":
            where = f"on batch {step}" if step is not None else "while starting"
            raise RuntimeError(f"DataLoader worker {wid} failed {where}:\n{payload}")
        self.outstanding[wid] -= 1
        return step, slot, payload

    def _raise_dead(self, wid: int, read: bool = True) -> None:
        proc = self._procs[wid]
        if read and self._conns[wid].poll(0):
            self._message(wid)  # raises the worker's own error, if it sent one
        proc.join(0.5)  # reap it, so that its exit code is known
        raise _Died(
            f"DataLoader worker {wid} (pid {proc.pid}) died: {death_cause(proc.exitcode)}; "
            "the epoch cannot continue"
        )

    def close(self, graceful: bool = True) -> None:
        """Stop the workers: ask them to exit when ``graceful``, else terminate them."""
        self._stopping = True
        for conn in self._conns:
            try:
                if graceful:
                    conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if graceful:
                proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.terminate()
                # A stopped worker (SIGSTOP, a debugger) acts on SIGTERM only once continued.
                with contextlib.suppress(OSError):
                    os.kill(proc.pid, signal.SIGCONT)
                proc.join(_JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._done, self._sentinels = [], [], [], {}


class _Died(RuntimeError):
    """A worker exited (killed, crashed, or stopped by ``close``)."""


def _stopped() -> RuntimeError:
    return RuntimeError(
        "the DataLoader's workers were stopped (close(), or the interpreter is exiting); "
        "start a new iteration"
    )

"""ordered_map(): run a function over items in forked workers, results back in item order.

multiprocessing.Pool pickles every result and unpickles it in a helper thread of the
parent: for records of ~100 KB that costs the parent more CPU than writing them. Here each
worker owns a pipe and writes frames (a small msgpack header and the payload bytes as they
are); the parent reads them with one copy. Worker k takes chunks k, k+W, k+2W... so the
parent knows which pipe holds the next item and needs no reorder buffer, and a full pipe
holds back only the worker that ran ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import struct
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgpack

_HEAD = struct.Struct("<BII")  # kind, header length, payload length
_OK, _ERROR = 0, 1
_PIPE_BYTES = 1 << 20  # room for a worker to run ahead of the parent
_F_SETPIPE_SZ = 1031  # fcntl command (Linux)

Result = tuple[Any, bytes]  # (msgpack-able header, payload)


def can_fork() -> bool:
    return hasattr(os, "fork")


def ordered_map(
    fn: Callable[[Any], Result], items: Sequence, workers: int, chunk: int = 16
) -> Iterator[Result]:
    """Iterate ``fn(item)`` for each item, in order, computed by ``workers`` forked processes.

    The workers start at once (before any thread the caller starts next, e.g. a progress
    bar's), and stop when the iterator is exhausted, closed or garbage-collected.

    ``fn`` returns ``(header, payload)``: a msgpack-able header and bytes. An exception in
    ``fn`` is re-raised here as RuntimeError with the worker's traceback; a worker that
    dies is reported with its exit status. Workers are stopped when the iterator is
    closed or abandoned (e.g. on Ctrl-C).
    """
    procs = [_start(fn, items, k, workers, chunk) for k in range(workers)]
    return _collect(procs, len(items), chunk)


def _collect(procs: list, n: int, chunk: int) -> Iterator[Result]:
    workers = len(procs)
    try:
        for c in range(-(-n // chunk)):
            pid, pipe = procs[c % workers]
            for _ in range(min(chunk, n - c * chunk)):
                yield _read(pipe, pid, c % workers)
    finally:
        _stop(procs)


def _start(fn: Callable, items: Sequence, k: int, workers: int, chunk: int):
    rfd, wfd = os.pipe()
    with contextlib.suppress(OSError):  # the default pipe size only means less read-ahead
        fcntl.fcntl(wfd, _F_SETPIPE_SZ, _PIPE_BYTES)
    pid = os.fork()
    if pid == 0:  # the worker: never returns
        os.close(rfd)
        status = _work(fn, items, k, workers, chunk, wfd)
        os._exit(status)
    os.close(wfd)
    return pid, os.fdopen(rfd, "rb", buffering=_PIPE_BYTES)


def _work(fn: Callable, items: Sequence, k: int, workers: int, chunk: int, wfd: int) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    # The parent stops us with SIGTERM: die quietly, whatever handler the parent had
    # installed (Ray's prints a stack trace from C++).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # The parent is the pipeline's single consumer: when all cores are busy, let it run
    # first, or every worker ends up blocked on a full pipe while it waits for a core.
    with contextlib.suppress(OSError):
        os.nice(2)
    out = os.fdopen(wfd, "wb", buffering=_PIPE_BYTES)
    try:
        for start in range(k * chunk, len(items), workers * chunk):
            for item in items[start : start + chunk]:
                header, payload = fn(item)
                meta = msgpack.packb(header, use_bin_type=True)
                out.write(_HEAD.pack(_OK, len(meta), len(payload)))
                out.write(meta)
                out.write(payload)
            out.flush()
        return 0
    except BrokenPipeError:
        return 0  # the parent stopped reading: nothing left to do
    except BaseException:
        text = traceback.format_exc().encode()
        out.write(_HEAD.pack(_ERROR, len(text), 0) + text)
        out.flush()
        return 1
    finally:
        with contextlib.suppress(OSError):
            out.close()


def _read(pipe, pid: int, k: int) -> Result:
    head = pipe.read(_HEAD.size)
    if len(head) < _HEAD.size:
        raise RuntimeError(f"ingest worker {k} (pid {pid}) died: {_exit_status(pid)}")
    kind, nmeta, npayload = _HEAD.unpack(head)
    meta = pipe.read(nmeta)
    if kind == _ERROR:
        raise RuntimeError(f"ingest worker {k} (pid {pid}) failed:\n{meta.decode()}")
    payload = pipe.read(npayload)
    if len(meta) != nmeta or len(payload) != npayload:
        raise RuntimeError(f"ingest worker {k} (pid {pid}) died: {_exit_status(pid)}")
    return msgpack.unpackb(meta, raw=False), payload


def _exit_status(pid: int) -> str:
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return "exit status unknown"
    if os.WIFSIGNALED(status):
        return f"killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exited with status {os.WEXITSTATUS(status)}"


def _stop(procs: list) -> None:
    for pid, pipe in procs:
        pipe.close()  # a worker still writing gets EPIPE and exits
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    for pid, _ in procs:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)

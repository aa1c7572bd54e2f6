"""GpuEpochIterator: the epoch iterator of the GPU path, with a CUDA prefetch thread.

A background thread runs the whole producing side: it plans and dispatches batches to the
workers, collects the gathered slots, runs each through the ``GpuStage`` (decode and
augmentation on side streams) and puts the finished batch into a bounded queue
(``prefetch_factor`` batches). The GPU decoder blocks the thread that calls it for the
whole batch (releasing the GIL), so decode threads of their own call it: the prefetch
thread hands them batches ahead and finishes the oldest one meanwhile.

The training loop only takes finished batches: its stream waits on the batch's event
(``wait_event``: never the whole device) and the tensors are marked as used by that
stream (``record_stream``), so the allocator never hands their memory to the side stream
while the training loop may still read them. The plan advances on delivery, as on the CPU
path, so ``state_dict()`` counts what the user received.

The thread holds the iterator only weakly while it waits on the queue, so an iterator the
user abandons is collected, stops its thread and frees the workers as on the CPU path.

With ``persistent_workers=True`` an epoch's end does not stop the thread: it goes on into
the first batches of the epoch that follows (the loader's plan one epoch on, as it will be
unless the loop moves it elsewhere) while the training loop finishes the last ones, so the
next epoch starts with batches ready instead of waiting for the workers and the decoder to
start again (on an H200, DDP ResNet-50 waited 42-48 ms at each epoch's start, with the GPU
idle). The loader keeps the finished iterator (``DataLoader._carry``); the next iteration
takes it on if its plan is the one the thread guessed, and otherwise drops those batches.
Nothing is counted before it is delivered, so ``state_dict()`` is unchanged by this.

Errors in the thread (a dead worker, a CUDA error, a damaged store) reach the training
loop as the exception itself, naming the stage.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref

import torch

from loader.epoch import EpochIterator, LoaderGone, chunk_size
from loader.gpu.stage import Call

_JOIN_S = 30.0  # longest wait for the thread to finish the batch it is on
_PUT_POLL_S = 0.1
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


class GpuStageError(RuntimeError):
    """A failure in the GPU stage (decode, augmentation, copy), naming it."""


class GpuEpochIterator(EpochIterator):
    """See the module docstring; ``DataLoader.__iter__`` returns one on the GPU path."""

    def __init__(self, loader) -> None:
        super().__init__(loader)
        self._chunk = gather_chunk(loader.batch_size, loader.num_workers)
        self._stage = loader._gpu_stage
        self._stage.epoch_started()
        self._stats = loader._stats
        self._queue: queue.Queue = queue.Queue(maxsize=loader.prefetch_factor)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One batch queued per decode thread beside the one being finished: the next call
        # already waits inside the decoder (GIL released) when the current one ends, where
        # a single thread one batch ahead first waited for the GIL behind this thread
        # (on the H200, loader alone: 13-15k img/s that way, 18.7-24.5k this way).
        threads = self._stage.concurrent_calls
        self._decoder = _DecodeThreads(threads) if self._ring.slots > 1 else None
        self._depth = 1 if self._decoder is None else batches_on_gpu(threads)
        self._started: collections.deque = collections.deque()  # (slot, Started, waited)
        # Finished batches' slots, until their GPU work is done: (slot, event or None).
        self._in_use: collections.deque = collections.deque()
        self._thread_failed = False
        self._closer: threading.Thread | None = None  # the thread that closes the iterator
        self._out = loader._plan.step  # the key of the next batch the thread finishes

    def _next(self):
        if self._closed:
            return super()._next()  # raises as the CPU path does
        if self._thread is None:
            self._thread = threading.Thread(
                target=_run,
                args=(weakref.ref(self), self._queue, self._stop, self._stage.device),
                name="imfeed-gpu-prefetch", daemon=True,
            )  # fmt: skip
            self._thread.start()
        t0 = time.perf_counter()
        try:
            kind, payload = self._take_finished()
        except BaseException:  # Ctrl-C while waiting: stop the thread and the workers now
            self._close(finished=False, failed=True)
            raise
        waited = time.perf_counter() - t0
        self._stats.add(wait_s=waited)
        if kind == "end":
            self._epoch_over(carrying=payload)  # payload: the thread went on into the next
            raise StopIteration
        if kind == "error":
            self._close(finished=False, failed=True)
            try:
                raise payload
            finally:  # its traceback holds this frame: not the frame the error
                del payload
        images, labels, indices, event, bad = payload
        self._stage.note_handoff(waited)
        if images.device.type == "cuda":
            try:
                self._hand_over(images, labels, event)
            except BaseException:  # the thread and the workers do not outlive a failed handoff
                self._close(finished=False, failed=True)
                raise
        self._loader._note_bad(bad)
        self._stats.add(batches=1, samples=len(indices))  # counted as delivered
        next(self._official)
        with_indices = self._loader.with_indices
        self._delivered()
        if with_indices:
            return images, labels, torch.from_numpy(indices)
        return images, labels

    def _hand_over(self, images, labels, event) -> None:
        """Make the training stream wait for the batch's GPU work (the host does not)."""
        stream = torch.cuda.current_stream(images.device)
        starved = stream.query()  # nothing left queued: the model waited for this batch
        # A batch whose GPU work is done needs no wait, and skipping it keeps the GIL:
        # ``Event.wait`` lets it go (``query`` does not), and beside the prefetch thread the
        # training loop may then take up to a switch interval (5 ms) to get it back.
        pending = not event.query()
        self._stats.add(starved_handoffs=int(starved), pending_handoffs=int(pending))
        if pending:
            stream.wait_event(event)
        images.record_stream(stream)
        labels.record_stream(stream)

    def _take_finished(self) -> tuple[str, object]:
        timeout = self._loader.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        while True:
            wait = 1.0 if deadline is None else min(1.0, max(deadline - time.monotonic(), 0))
            try:
                return self._queue.get(timeout=wait)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return "error", GpuStageError("the GPU prefetch thread ended unexpectedly")
                if deadline is not None and time.monotonic() >= deadline:
                    return "error", RuntimeError(
                        f"DataLoader timed out after {timeout} seconds waiting for a batch "
                        f"(timeout={timeout}; the GPU path: the workers or the GPU stage)"
                    )

    def _produce_one(self) -> tuple:
        """Thread side: the next finished batch, or raise StopIteration at the epoch's end."""
        if self._carries and self._tasks.ended_before(self._out):
            raise _EpochEnd  # every batch of the loop's epoch is out: tell it, and go on
        cpu0 = time.thread_time()
        try:
            # The next batches decode while this one finishes; but a batch the workers have
            # not delivered yet is not waited for while one is decoded or decoding: a slow
            # batch holds up neither those before it nor their ring slots.
            while True:
                while len(self._started) < self._depth:
                    if self._started and not self._next_ready():
                        break
                    try:
                        self._started.append(self._start_next())
                    except StopIteration:
                        break
                if self._started:
                    break
                # Nothing to start: the epoch is over, or (carrying on) the thread is a
                # whole epoch ahead of the loop, and waits for it to start the next one.
                raise _AheadOfLoop if self._carries else StopIteration
            slot, started, waited = self._started.popleft()
            self._out += 1
            event = None
            try:
                images, labels, indices, event = self._stage.finish(started, waited)
            finally:
                self._in_use.append((slot, event))
            self._stage.note_finished()
        except torch.cuda.OutOfMemoryError:
            raise  # torch's own message says what to do
        except RuntimeError as e:
            if not _from_the_gpu(e):  # (``raise e from e`` made the error its own cause,
                raise  # a cycle holding its traceback's frames, this iterator among them)
            raise _named(e, self._stage.device) from e
        # The thread's own CPU time: what it takes from the training loop's interpreter.
        self._stats.add(prefetch_cpu_s=time.thread_time() - cpu0)
        return images, labels, indices, event, started.report.bad

    def _start_next(self) -> tuple:
        """Thread side: wait for the workers' next slot and start its decode."""
        t0 = time.perf_counter()
        slot, report = self._produce()
        waited = time.perf_counter() - t0
        self._next_step += 1
        submit = None if self._decoder is None else self._decoder.submit
        try:
            started = self._stage.start(self._ring.slot(slot), report, submit)
        except BaseException:
            self._free.append(slot)
            raise
        return slot, started, waited

    # Slots go back to the workers once the GPU work of their batch is done, not when
    # ``finish`` has queued it: DALI reads the JPEGs in the slot (``dali_stage.NO_COPY``)
    # until its output for them is consumed, and an asynchronous pipeline may still be at
    # it; a kernel gathers the workers' rows from it (``loader.gpu.mapped``). Only a batch
    # that has no slot else waits for one (``_produce``).

    def _dispatch(self) -> None:
        self._give_back_slots()
        super()._dispatch()

    def _dispatching(self) -> bool:
        return not self._stop.is_set() and super()._dispatching()

    def _produce(self):
        if not self._free and not self._placed(self._next_step):
            self._give_back_slots(wait=True)
        return super()._produce()

    def _next_ready(self) -> bool:
        ready = super()._next_ready()  # True also where the batch has no slot yet
        held = self._pool is not None and self._in_use and not self._placed(self._next_step)
        return ready and not held

    def _placed(self, step: int) -> bool:
        """Whether batch ``step`` has its slot (with the workers, or filled)."""
        return self._pool is not None and (step in self._pending or step in self._ready)

    def _give_back_slots(self, wait: bool = False, every: bool = False) -> None:
        """Free the slots whose batch's GPU work is done, in order; with ``wait``, at least
        one, waiting for it; with ``every``, all of them, waiting as needed."""
        while self._in_use:
            slot, event = self._in_use[0]
            if event is not None and not event.query():
                if not (wait or every):
                    return
                event.synchronize()
                wait = False
            self._in_use.popleft()
            self._free.append(slot)

    def _take(self, results) -> None:
        """On every poll of the workers: the prefetch thread leaves promptly once told to
        stop, after booking what it received (the training thread, draining the workers at
        close, must find every chunk either booked or still to come), unless it is the
        one closing: where it let go of the iterator last, it drains them itself."""
        super()._take(results)
        here = threading.current_thread()
        if self._stop.is_set() and here is self._thread and here is not self._closer:
            raise _Stopped

    def _orphaned(self) -> None:
        self._stop.set()  # the thread ends at its next poll, without waiting for it here
        if self._decoder is not None:
            self._decoder.cancel()
            self._decoder.stop(0.0)

    def _close_counted(self, finished: bool, failed: bool) -> None:
        self._closer = threading.current_thread()
        self._stop.set()
        if self._decoder is not None:
            self._decoder.cancel()  # what it has not started, it never will
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
            # A thread still inside a hung call must not share the workers' pipes with a
            # drain: stop the workers without waiting for them.
            failed = failed or thread.is_alive() or self._thread_failed
        # A decode still reading a slot's bytes must end before the ring may go.
        decodes_ended = self._decoder is None or self._decoder.stop(_JOIN_S)
        failed = failed or not decodes_ended
        ended = thread is None or not thread.is_alive() or thread is threading.current_thread()
        if ended:
            self._stage.settle()  # so must what the stage still holds (DALI's batches)
            self._give_back_slots(every=True)  # and the GPU work of the batches finished
        self._stage.abandoned |= not (ended and decodes_ended)
        super()._close_counted(finished, failed)


def _from_the_gpu(e: RuntimeError) -> bool:
    """Whether ``e`` is a CUDA, nvjpeg, DALI or Triton error."""
    return any(word in str(e) for word in ("CUDA", "nvjpeg", "nvJPEG", "DALI", "triton"))


def _named(e: RuntimeError, device) -> GpuStageError:
    """A GPU error (``_from_the_gpu``), named as the GPU stage's."""
    return GpuStageError(f"the GPU stage (decode + augmentation on {device}) failed: {e}")


class _DecodeThreads:
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


class _Stopped(Exception):
    """The prefetch thread was told to stop while it waited for the workers."""


class _EpochEnd(Exception):
    """The prefetch thread finished the loop's epoch, and goes on into the next one."""


class _AheadOfLoop(Exception):
    """The prefetch thread made every batch it may before the loop starts the next epoch."""


def _run(ref: weakref.ref, out: queue.Queue, stop: threading.Event, device) -> None:
    """The prefetch thread: produce batches into ``out`` until the epoch ends or ``stop``."""
    if device.type == "cuda":  # as torch's pin-memory thread: its own current device
        torch.cuda.set_device(device)
    held = 0.0  # how long the last batch waited for room in ``out``: the loop's pace
    while not stop.is_set():
        it = ref()
        if it is None:
            return
        if held:  # noted once (a thread a whole epoch ahead comes back here to wait)
            it._stage.note_held(held)
            held = 0.0
        try:
            item = ("batch", it._produce_one())
        except _EpochEnd:
            item = ("end", True)  # and on into the next epoch
        except _AheadOfLoop:  # wait for the loop, without keeping the iterator alive
            tasks = it._tasks
            del it
            while not (stop.is_set() or ref() is None or tasks.wait(_PUT_POLL_S)):
                pass
            continue
        except StopIteration:
            item = ("end", False)
        except BaseException as e:  # reaches the training loop, raised there
            # What fails once told to stop (``_Stopped``, a decode cancelled by the close)
            # is the stop's doing, and a parked iteration whose loader was freed has no
            # loop to tell: nothing to hand on.
            if stop.is_set() or isinstance(e, LoaderGone):
                return
            item = ("error", e)
            # A chunk that failed will never come: closing must not wait for it (a flag,
            # not the exception: its traceback would hold the iterator in a cycle).
            it._thread_failed = True
        del it  # wait without keeping the iterator alive
        last = item[0] == "error" or item == ("end", False)
        held = _hand(out, item, stop, ref)
        # An error's traceback holds this frame: were the frame to hold the error, the
        # cycle would keep the iterator, its loader and the GPU stage (DALI's pipelines,
        # their device memory) alive after the loader is gone, until a full collection.
        del item
        if last or held is None:
            return


def _hand(out: queue.Queue, item: tuple, stop: threading.Event, ref: weakref.ref) -> float | None:
    """Put ``item`` into ``out``: the seconds it waited for room (0.0 where there was
    some), or None where the thread is to end instead: told to stop, or its iterator gone
    while ``out`` was full."""
    if stop.is_set():
        return None
    try:
        out.put_nowait(item)
        return 0.0
    except queue.Full:
        t0 = time.perf_counter()
    while not stop.is_set():
        try:
            out.put(item, timeout=_PUT_POLL_S)
            return time.perf_counter() - t0
        except queue.Full:
            if ref() is None:
                return None
    return None

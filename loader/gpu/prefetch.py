"""GpuEpochIterator: the epoch iterator of the GPU path, with a CUDA prefetch thread.

A background thread runs the producing side: it dispatches batches to the workers, runs
each gathered slot through the GPU stage (decode threads call the decoder, which blocks for
a whole batch, so that the next call already waits inside it) and puts finished batches
into a bounded queue. The training loop only takes them: its stream waits on the batch's
event (never the whole device) and ``record_stream`` keeps the allocator from reusing the
tensors' memory meanwhile. The thread holds the iterator only weakly while it waits, so an
abandoned iterator is collected and stops. With ``persistent_workers=True`` the thread goes
on into the next epoch's first batches while the loop finishes the last ones (the session
keeps the iterator; ``loader.session``). Errors in the thread reach the loop, naming the stage.
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref

import torch

from loader.epoch import EpochIterator, LoaderGone
from loader.gpu.decode_threads import DecodeThreads
from loader.gpu.slots import batches_on_gpu, gather_chunk

_JOIN_S = 30.0  # longest wait for the thread to finish the batch it is on
_PUT_POLL_S = 0.1


class GpuStageError(RuntimeError):
    """A failure in the GPU stage (decode, augmentation, copy), naming it."""


class GpuEpochIterator(EpochIterator):
    """See the module docstring; ``DataLoader.__iter__`` returns one on the GPU path."""

    def __init__(self, session) -> None:
        super().__init__(session)
        settings = session.settings
        self._chunk = gather_chunk(settings.batch_size, settings.num_workers)
        self._stage = session.gpu_stage
        self._stage.epoch_started()
        self._stats = session.stats
        self._queue: queue.Queue = queue.Queue(maxsize=settings.prefetch_factor)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # One batch queued per decode thread beside the one being finished: the next call
        # already waits inside the decoder (GIL released) when the current one ends, where
        # a single thread one batch ahead first waited for the GIL behind this thread
        threads = self._stage.concurrent_calls
        self._decoder = DecodeThreads(threads) if self._ring.slots > 1 else None
        self._depth = 1 if self._decoder is None else batches_on_gpu(threads)
        self._started: collections.deque = collections.deque()  # (slot, Started, waited)
        # Finished batches' slots, until their GPU work is done: (slot, event or None).
        self._in_use: collections.deque = collections.deque()
        self._thread_failed = False
        self._closer: threading.Thread | None = None  # the thread that closes the iterator
        self._out = session.plan.step  # the key of the next batch the thread finishes

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
        self._session.delivery.note_bad(bad)
        self._stats.add(batches=1, samples=len(indices))  # counted as delivered
        next(self._official)
        with_indices = self._session.settings.with_indices
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
        timeout = self._session.settings.timeout
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
        held = self.pool is not None and self._in_use and not self._placed(self._next_step)
        return ready and not held

    def _placed(self, step: int) -> bool:
        """Whether batch ``step`` has its slot (with the workers, or filled)."""
        return self.pool is not None and (step in self._pending or step in self._ready)

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

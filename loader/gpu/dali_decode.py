"""The DALI decoder: batched JPEG decode of only each sample's crop window, through DALI.

``fn.decoders.image_slice`` on DALI's "mixed" device decodes a batch on the hardware JPEG
engines and nvjpeg's CUDA decoder side by side, and only the region it is given:
RandomResizedCrop keeps 8-100% of an image, so most of a full decode would be thrown
away. The regions are the sampler's windows, so the samples are the same on every backend.
With ``decoder="dali"`` the whole stage runs in one DALI pipeline
(``loader.gpu.dali_stage``); this decoder serves the batches that pipeline fails on.

DALI is optional (``pip install 'imfeed[dali]'``), imported when the decoder is made. Each
concurrent caller gets a synchronous pipeline of its own, whose output is copied on the
caller's stream into one tensor of torch's allocator, so DALI's buffers are free again
once the copy is done.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import math
import queue
import re

import numpy as np
import torch

from ingest.cores import half_the_cores
from ingest.cstderr import filtered
from loader.gpu.nvjpeg import raise_if_not_the_data

# nvImageCodec (inside DALI) prints to stderr, whatever DALI's log level, for each stream it
# cannot parse and, when a pipeline is built, for the optional codec libraries (nvTIFF,
# nvJPEG2000) it did not find: its default messenger writes a colour code, "[ERROR] " (or
# another level), the code that resets the colour, "[codec] " and the message. It writes
# the colour codes apart from the line, so a capture may begin or end between them: a line
# of colour codes alone is its too. Its JPEG parser's complaints come alone on a line
# ("Invalid marker", for a stream cut short), or after its tag ("[jpeg_parser] "). A line
# of another form (a user's "[WARNING] ...", written while a capture is open) is let through.
LIBRARY_LINES = re.compile(
    r"^\s*(\x1b\[[0-9;]*m)?\[(FATAL ERROR|ERROR|WARNING|INFO|DEBUG|TRACE)\] \x1b\[0m\["
    r"|^Failed to load nv|^Note: If using nvImageCodec|^(\x1b\[[0-9;]*m)+\s*$"
    r"|^(\x1b\[[0-9;]*m)*(\[jpeg_parser\] )?(Invalid marker|Unexpected end-of-stream"
    r"|Unexpected signature"
    r"|Failed to read EXIF block|Unexpected number of channels)\s*$"
)

# The share of the JPEGs DALI gives its hardware engines (the rest go to nvjpeg's CUDA
# decoder, whose Huffman stage runs on DALI's CPU threads): all of them, and 4 threads,
# decoded fastest.
HW_DECODER_LOAD = 1.0
MAX_THREADS = 4  # DALI's CPU threads per pipeline: they share the cores with training
PIPELINES = 2  # pipelines, one per concurrent caller


class DaliDecoder:
    """Decodes the crop windows of lists of JPEG byte tensors into uint8 [3, h, w] tensors.

    Args:
        device: the CUDA device to decode on (the CPU only in tests: DALI's CPU decoder).
        antialias: accepted for the registry's common signature; resizing is not done here.
        batch_size: the most images one call decodes.
        threads: DALI's CPU threads (default: ``MAX_THREADS``, fewer on a small machine).
        hw_decoder_load: share of the JPEGs for the hardware engines.

    Raises:
        ValueError: DALI is not installed, or no CUDA device.
    """

    name = "dali"
    in_workers = False
    devices = ("cuda",)
    crop_windows = True  # decode_batch takes each image's window and decodes only that
    takes_numpy = True  # the bytes may come as numpy arrays (what DALI is fed)
    concurrent_calls = PIPELINES
    whole_stage = True  # the loader's DaliStage runs it all in one pipeline; this serves
    # the batches that pipeline fails on

    def __init__(
        self,
        device: torch.device | str | None = None,
        antialias: bool = True,
        batch_size: int = 256,
        threads: int | None = None,
        hw_decoder_load: float = HW_DECODER_LOAD,
    ) -> None:
        del antialias
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("decoder='dali' decodes on a CUDA device; use decoder='cpu'")
        try:
            importlib.import_module("nvidia.dali")
        except ImportError:
            raise ValueError(
                "decoder='dali' needs NVIDIA DALI: pip install 'imfeed[dali]', or use "
                "decoder='nvjpeg'"
            ) from None
        self.batch_size = int(batch_size)
        self.threads = threads or half_the_cores(MAX_THREADS)
        self.hw_decoder_load = float(hw_decoder_load)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()  # pipelines no call is using
        for _ in range(self.concurrent_calls):
            self._idle.put(_Pipeline())

    def release(self) -> None:
        """Let go of the pipelines built that no call is using: built again when next
        needed."""
        idle = []
        with contextlib.suppress(queue.Empty):
            while True:
                idle.append(self._idle.get_nowait())
        for _ in idle:
            self._idle.put(_Pipeline())

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        cuda = self.device.type == "cuda"
        mixed = {"hw_decoder_load": self.hw_decoder_load} if cuda else {}

        @pipeline_def(
            batch_size=self.batch_size,
            num_threads=self.threads,
            device_id=(self.device.index or 0) if cuda else None,
            prefetch_queue_depth=1,
            exec_async=False,  # run() decodes the batch it is given, in the caller's thread
            exec_pipelined=False,
        )
        def graph():
            jpegs = fn.external_source(name="jpegs", dtype=types.UINT8, ndim=1)
            anchor = fn.external_source(name="anchor", dtype=types.FLOAT, ndim=1)
            shape = fn.external_source(name="shape", dtype=types.FLOAT, ndim=1)
            return fn.decoders.image_slice(
                jpegs, anchor, shape, device="mixed" if cuda else "cpu",
                output_type=types.RGB, axis_names="WH",
                normalized_anchor=False, normalized_shape=False, **mixed,
            )  # fmt: skip

        pipe = graph()
        pipe.build()
        return pipe

    def decode_batch(
        self, encoded: list[torch.Tensor], windows: np.ndarray
    ) -> list[torch.Tensor | None]:
        """Decode window ``windows[k]`` (y, x, h, w) of every JPEG of ``encoded`` (uint8
        CPU tensors or numpy arrays).

        Returns:
            One RGB tensor [3, h, w] per input (views of one buffer allocated on the
            current stream, ready in stream order), or None where that input could not be
            decoded (the caller retries those on the CPU).

        Raises:
            RuntimeError: the device failed (out of memory, a CUDA error).
        """
        if not encoded:
            return []
        windows = np.asarray(windows, dtype=np.int64)[:, :4]
        own = self._idle.get()  # a pipeline of this call's own
        try:
            try:
                return self._decode(own, encoded, windows)
            except RuntimeError as e:
                raise_if_not_the_data(e)
                own.pipe = None  # start afresh after a failed run
                # One bad stream fails the whole batch: find it by decoding one by one.
                return [self._one(own, data, w) for data, w in zip(encoded, windows, strict=True)]
        finally:
            self._idle.put(own)

    def _one(self, own: _Pipeline, data: torch.Tensor, window: np.ndarray):
        try:
            return self._decode(own, [data], window[None])[0]
        except RuntimeError as e:
            raise_if_not_the_data(e)
            own.pipe = None
            return None

    def _decode(self, own: _Pipeline, encoded: list[torch.Tensor], windows: np.ndarray) -> list:
        if own.copied is not None:  # DALI may reuse its buffers once they are copied
            own.copied.synchronize()
            own.copied = None
        if own.pipe is None:
            with filtered(LIBRARY_LINES):  # optional codecs it did not find, among others
                own.pipe = self._build()
        pipe = own.pipe
        pipe.feed_input("jpegs", jpeg_batch([_as_numpy(t) for t in encoded]))
        pipe.feed_input("anchor", np.ascontiguousarray(windows[:, [1, 0]], dtype=np.float32))
        pipe.feed_input("shape", np.ascontiguousarray(windows[:, [3, 2]], dtype=np.float32))
        with filtered(LIBRARY_LINES):  # its complaints about a bad stream: a None here
            (out,) = pipe.run()
        images, own.copied = self._to_torch(out, windows)
        return images

    def _to_torch(self, out, windows: np.ndarray) -> tuple[list[torch.Tensor | None], object]:
        """Copy DALI's ragged output into one tensor; a sample of the wrong shape is None.
        Also returns an event after the copy (None where the copy is done on return)."""
        shapes = [tuple(s) for s in out.shape()]
        sizes = [math.prod(s) for s in shapes]
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
        copied = None
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            _wait_for(out, stream, self.device)
            copy_into(buffer, out, stream)
            copied = torch.cuda.Event()
            copied.record(stream)
        else:
            copy_into(buffer, out, None)
        return hwc_views(buffer, shapes, sizes, windows[:, 2:4]), copied


def jpeg_batch(arrays: list[np.ndarray]):
    """``arrays`` (1-D uint8) as one DALI batch, wrapped where they lie: ``feed_input``
    given the list checks each array in Python (its type, shape, layout), which takes
    about twice as long."""
    from nvidia.dali.tensors import TensorCPU, TensorListCPU

    return TensorListCPU([TensorCPU(a) for a in arrays], "", contiguous=False)


def _as_numpy(data) -> np.ndarray:
    return data if isinstance(data, np.ndarray) else data.numpy()


def hwc_views(
    buffer: torch.Tensor, shapes: list[tuple], sizes: list[int], expected: np.ndarray
) -> list:
    """[3, h, w] views of images stored back to back in ``buffer`` as HWC pixels, of
    DALI's ``shapes`` (``sizes`` elements each); None where a shape is not the
    ``expected`` (h, w) with 3 channels.

    The views are made in one call (a nested tensor over the buffer, unbound): a view and
    a permute per image are 512 torch calls a batch, each letting the GIL go, several
    times slower beside a busy Python thread. Where that private torch call is missing,
    it falls back to the calls per image.
    """
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    ok = [s == (h, w, 3) for s, (h, w) in zip(shapes, expected.tolist(), strict=True)]
    good = np.flatnonzero(ok)
    views: list = []
    if len(good):
        h, w = (np.asarray(expected, dtype=np.int64)[good, k] for k in (0, 1))
        sizes3 = np.stack([np.full_like(h, 3), h, w], axis=1)
        strides3 = np.stack([np.ones_like(w), 3 * w, np.full_like(w, 3)], axis=1)
        try:
            nested = torch._nested_view_from_buffer(
                buffer, torch.from_numpy(sizes3), torch.from_numpy(strides3),
                torch.from_numpy(np.ascontiguousarray(offsets[good])),
            )  # fmt: skip
            views = list(nested.unbind())
        except (AttributeError, RuntimeError):  # not in this torch: one view at a time
            views = [
                buffer[o : o + 3 * y * x].view(y, x, 3).permute(2, 0, 1)
                for o, y, x in zip(offsets[good].tolist(), h.tolist(), w.tolist(), strict=True)
            ]
    images: list = [None] * len(shapes)
    for k, view in zip(good.tolist(), views, strict=True):
        images[k] = view
    return images


class _Pipeline:
    """One DALI pipeline (built on first use, None again after a failed run) and the event
    after the last copy out of its buffers."""

    def __init__(self) -> None:
        self.pipe = None
        self.copied = None


def copy_into(target: torch.Tensor, out, stream: torch.cuda.Stream | None) -> None:
    """Copy DALI's output ``out`` (dense, as many bytes as ``target``) into ``target``:
    queued on ``stream``, or done on return where there is none (the CPU).

    DALI takes the stream as a ``ctypes.c_void_p``. Given the plain int of
    ``stream.cuda_stream``, it finds no handle in it and copies on the legacy default
    stream, which a torch side stream does not wait for: what ``stream`` did next could
    read the target before the copy wrote it (batches came with NaN where their rows went
    through a temporary)."""
    pointer = ctypes.c_void_p(target.data_ptr())
    if stream is None:
        out.copy_to_external(pointer)
    else:
        out.copy_to_external(pointer, ctypes.c_void_p(stream.cuda_stream), non_blocking=True)


def _wait_for(out, stream: torch.cuda.Stream, device: torch.device) -> None:
    """Make ``stream`` wait for the work DALI did on its own stream to produce ``out``."""
    handle = getattr(out, "stream", None)
    if callable(handle):
        handle = handle()
    if not handle:
        return  # DALI finished its work before returning (or used the legacy stream)
    event = torch.cuda.Event()
    event.record(torch.cuda.ExternalStream(int(handle), device=device))
    stream.wait_event(event)

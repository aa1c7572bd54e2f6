"""Each pipeline in a process of its own, serving timed passes on request.

A pass reads whole epochs (one, or more until ``min_pass_seconds`` have passed); the
warm-up (workers start, caches fill; our DALI stage's first trial of its ways, over up to
``WARMUP_PASSES`` passes) comes first (``rounds`` orders them). Processes are forks of a
fork server, so that none inherits CUDA state. Whatever a pipeline's libraries print goes
to its log file, never to the terminal; a pipeline that fails or dies is reported with the
reason and the others go on.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import time
import traceback
from pathlib import Path

from loader.bench import busy, tracker
from loader.bench.pipelines import PEERS, build
from loader.bench.settings import Settings
from loader.bench.train import (
    decoded_between,
    decoded_counts,
    forever,
    loader_times,
    per_image,
    picked_way,
    settling,
    train_check,
)
from loader.telemetry.proctree import PeakMemory, tree_cpu_seconds

READY_TIMEOUT = 600.0  # seconds for a pipeline to start (imports, DALI's first batches)
PASS_TIMEOUT = 1800.0  # seconds for one pass or training check before it counts as hung
WARMUP_PASSES = 6  # at most, while our DALI stage tries its ways (``settling``: 262 batches)


def _reason(e: BaseException) -> str:
    """``e`` in a line: its message's first line, and its last where it has more (a torch
    DataLoader worker's error is "Caught OSError in DataLoader worker process 1." over the
    worker's traceback, whose last line says what failed)."""
    lines = [line.strip()[:200] for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {' ... '.join(dict.fromkeys(lines[:1] + lines[-1:]))}"


def _to_log(path: str) -> None:
    """Send this process's stdout and stderr (Python's and C libraries') to ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _gpu_memory_mib() -> float | None:
    """GPU memory this process holds (NVML when available, else torch's reserved memory)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory:
                return round(p.usedGpuMemory / (1 << 20), 1)
    except Exception:  # NVML missing or blind to this pid (containers): torch's figure
        pass
    return round(torch.cuda.max_memory_reserved() / (1 << 20), 1)


def timed_pass(pipe, s: Settings) -> dict:
    """Whole epochs of ``pipe``, one or more until ``s.min_pass_seconds`` have passed (in
    a pass of a fraction of a second, an epoch's start or a hiccup weighs the most):
    images, epochs, wall and CPU seconds of the process tree, memory (and where the
    loader's time went, what decoded, the way our DALI stage kept)."""
    memory = PeakMemory().start()
    before, counted = loader_times(pipe), decoded_counts(pipe)
    machine0 = busy.machine_busy_seconds()
    cpu0, t0, n, epochs, first = tree_cpu_seconds(), time.perf_counter(), 0, 0, None
    while not epochs or time.perf_counter() - t0 < s.min_pass_seconds:
        for _images, labels in pipe.epoch():
            n += int(labels.shape[0])
            first = first or time.perf_counter() - t0
        epochs += 1
        if n == 0:
            break
    if s.device != "cpu":
        import torch

        torch.cuda.synchronize()  # the last batches are finished, not merely queued
    seconds = time.perf_counter() - t0
    cpu = tree_cpu_seconds() - cpu0
    others = busy.others(machine0, busy.machine_busy_seconds(), cpu)
    if hasattr(pipe, "rest"):
        pipe.rest()
    if n == 0:
        raise RuntimeError("an epoch gave no batches")
    return (
        {
            "images": n,
            "epochs": epochs,
            "seconds": round(seconds, 4),
            "first_batch_seconds": round(first or seconds, 4),  # a start's cost shows here
            "cpu_seconds": round(cpu, 3),
            "other_cpu_seconds": others,  # other processes' and VMs' (steal), same time
            "memory_mib": memory.stop(),
            "gpu_memory_mib": _gpu_memory_mib(),
        }
        | per_image(before, loader_times(pipe), n)
        | decoded_between(counted, decoded_counts(pipe))
        | picked_way(pipe)  # how our loader made batches by the pass's end, and why
    )


def serve(name: str, s: Settings, conn, log: str) -> None:
    """In a process of its own: build pipeline ``name``, then answer requests until "stop"."""
    _to_log(log)
    # A child of the fork server inherits its start method: a torch DataLoader would start a
    # fork server of its own, with nothing imported, for its workers. The platform's default
    # instead, as in a user's script.
    mp.set_start_method(None, force=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the whole group: the run says it
        _serve(name, s, conn, log)


def _serve(name: str, s: Settings, conn, log: str) -> None:
    try:
        pipe = build(name, s)
    except Exception as e:
        traceback.print_exc()
        conn.send({"error": f"{_reason(e)} (see {log})"})
        return
    made = getattr(pipe, "made", None)  # a peer's conversion of the images
    conn.send({"ready": True} | ({"made": made} if made else {}))
    stream = None
    while (request := conn.recv())[0] != "stop":
        try:
            if request[0] == "warm-up":  # passes until a trial of our ways is not under way
                answer = timed_pass(pipe, s)
                first = answer["first_batch_seconds"]  # the pipeline's start, in pass 0
                for _ in range(WARMUP_PASSES - 1):
                    if not settling(getattr(pipe, "dl", None)):
                        break
                    answer = timed_pass(pipe, s) | {"first_batch_seconds": first}
            elif request[0] == "pass":
                answer = timed_pass(pipe, s)
            else:  # ("train", model)
                stream = stream or forever(pipe)
                answer = train_check(stream, request[1], s, pipe)
        except Exception as e:
            traceback.print_exc()
            answer = {"error": f"{_reason(e)} (see {log})"}
        conn.send(answer)
        if "error" in answer:
            break
    pipe.close()


def _context():
    """A fork server that has imported torch once: each pipeline's process is a cheap fork
    of it, and none inherits CUDA state (the server never touches CUDA)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.utils.data", "loader"])
    tracker.start_quietly()
    return ctx


class Server:
    """The main side of one pipeline's process."""

    def __init__(self, name: str, s: Settings, log_dir: Path) -> None:
        ctx = _context()
        self.name, self.log = name, log_dir / f"{name}.log"
        self.made = None  # a peer's conversion, from its ready message
        self.conn, there = ctx.Pipe()
        # Not a daemon: a daemon may not start the worker processes a loader needs.
        self.proc = ctx.Process(target=serve, args=(name, s, there, str(self.log)))
        self.proc.start()
        there.close()

    def ask(self, request: tuple | None, timeout: float | None) -> dict:
        """Send ``request`` (None: only wait for the ready message) and return the answer;
        ``{"error": ...}`` when the process fails, dies or does not answer in time (with
        ``timeout`` None: waits as long as the process lives)."""
        try:
            if request is not None:
                self.conn.send(request)
            if timeout is None:
                while not self.conn.poll(1.0) and self.proc.is_alive():
                    pass
            elif not self.conn.poll(timeout):
                self.kill()
                return {"error": f"no answer in {timeout:.0f} s (see {self.log})"}
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            self.proc.join(5)
            return {"error": f"its process died (exit code {self.proc.exitcode}; see {self.log})"}

    def stop(self, wait: bool = True, patience: float = 60.0) -> None:
        """Ask the process to finish; with ``wait``, join it (killed after ``patience`` s)."""
        with contextlib.suppress(OSError):  # already gone: nothing to stop
            self.conn.send(("stop",))
        if wait:
            self.proc.join(patience)
            self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def stop_all(servers: dict, patience: float = 60.0) -> None:
    """Stop every server, all at once (each closes its pipeline meanwhile; one that does not
    finish in ``patience`` s is killed, as all are on a second Ctrl-C)."""
    try:
        for server in servers.values():
            server.stop(wait=False)
        for server in servers.values():
            server.stop(patience=patience)
    except KeyboardInterrupt:
        for server in servers.values():
            server.kill()


def drop_empty_logs(log_dir: Path, names: list[str]) -> None:
    """Remove the logs of the pipelines ``names`` that printed nothing (and the folder,
    when empty); never another file of the folder (it may be the user's own)."""
    for name in names:
        log = log_dir / f"{name}.log"
        if log.is_file() and log.stat().st_size == 0:
            log.unlink()
    with contextlib.suppress(OSError):  # not empty: keep it
        log_dir.rmdir()


def start(names: list[str], s: Settings, log_dir: Path, say) -> tuple[dict, dict]:
    """Start a process per pipeline; return ({name: Server} ready, {name: reason} failed).

    The peers first, one at a time: each converts the images to its format when it starts
    (once; later runs reuse it), and that conversion is timed alone."""
    log_dir.mkdir(parents=True, exist_ok=True)
    servers, failed, started = {}, {}, {}
    peers = [n for n in names if n in PEERS]
    try:
        for group in [[n] for n in peers] + [[n for n in names if n not in PEERS]]:
            started = {}
            for name in group:
                started[name] = Server(name, s, log_dir)
            for name, server in started.items():
                # A peer converting a large folder takes as long as it takes (killed midway,
                # its writer's processes would go on and the conversion never finish).
                answer = server.ask(None, None if name in PEERS else READY_TIMEOUT)
                if "error" in answer:
                    failed[name] = answer["error"]
                    server.kill()
                    say(f"  {name}: skipped ({failed[name]})")
                    continue
                server.made, servers[name] = answer.get("made"), server
                if server.made and not server.made["reused"]:
                    say(f"  {name}: converted in {server.made['convert_seconds']:.1f} s, "
                        f"{server.made['mib']:.0f} MiB")  # fmt: skip
    except BaseException:  # stopped (Ctrl-C) or failed: no process of it goes on
        for server in [*servers.values(), *started.values()]:
            server.kill()
        raise
    return {n: servers[n] for n in names if n in servers}, failed


def train(servers: dict, models: tuple[str, ...], say) -> tuple[dict, dict]:
    """Each model fed by each pipeline in turn (one process on the GPU at a time)."""
    results = {name: {} for name in servers}
    failed = {}
    for model in models:
        for name, server in servers.items():
            if name in failed:
                continue
            answer = server.ask(("train", model), PASS_TIMEOUT)
            if "error" in answer:
                failed[name] = f"training check failed: {answer['error']}"
                say(f"  {name}: {failed[name]}")
                continue
            results[name][model] = answer
            say(
                f"  {model} fed by {name:<14} {answer['img_per_s']:9.1f} img/s, "
                f"waiting for data {answer['wait_share']:.0%} of step time"
            )
    return results, failed

"""The hardware and software fingerprint written with every result."""

from __future__ import annotations

import importlib
import os
import platform
import statistics
import sys
import threading


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cores_mhz(cpuinfo: str, cores) -> float | None:
    """The mean clock in MHz that ``cpuinfo`` (the text of /proc/cpuinfo) gives ``cores``
    (processor numbers); None where it gives none of them."""
    mhz, processor = {}, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            processor = int(value)
        elif key == "cpu MHz" and processor is not None:
            mhz[processor] = float(value)
    got = [mhz[c] for c in cores if c in mhz]
    return round(statistics.fmean(got), 1) if got else None


class Sampling:
    """While in a ``with`` block, ``sample()`` every ``every`` seconds in a daemon thread,
    from the block's start; a ``sample`` that returns False ends it early."""

    name = "imfeed-sampling"

    def __init__(self, every: float) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> bool | None:
        raise NotImplementedError

    def _run(self) -> None:
        while self.sample() is not False and not self._stop.wait(self.every):
            pass


class CoreClock(Sampling):
    """While in a ``with`` block, the clock of ``cores`` sampled every ``every`` seconds
    from /proc/cpuinfo; ``mhz``: the median of the samples (None where the kernel gives
    none). All cores busy run at a lower clock than a few: what a figure measured on half
    the machine does not show."""

    name = "imfeed-core-clock"

    def __init__(self, cores, every: float = 0.25) -> None:
        super().__init__(every)
        self.cores = sorted(cores)
        self.samples: list[float] = []

    def sample(self) -> bool:
        try:
            with open("/proc/cpuinfo") as f:
                mhz = cores_mhz(f.read(), self.cores)
        except OSError:
            return False
        if mhz is None:
            return False
        self.samples.append(mhz)
        return True

    @property
    def mhz(self) -> float | None:
        return round(statistics.median(self.samples), 1) if self.samples else None


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception:  # not installed, or broken: either way not usable here
        return None


def _dali_version() -> str | None:
    """DALI's version from its package metadata (importing DALI takes seconds)."""
    from importlib.metadata import distributions

    for dist in distributions():
        if (dist.metadata["Name"] or "").lower().startswith("nvidia-dali"):
            return dist.version
    return None


def gpu_info() -> dict:
    """GPU name, count, driver and CUDA versions (None each without a CUDA device)."""
    import torch

    info = {"gpu": None, "gpus": 0, "driver": None, "cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        return info
    info["gpus"] = torch.cuda.device_count()
    info["gpu"] = torch.cuda.get_device_name(0)
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        info["driver"] = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # NVML is optional: the driver version is then unknown
        pass
    return info


def fingerprint() -> dict:
    """CPU model and count, GPU, driver, CUDA and the versions of every library involved."""
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        **gpu_info(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": _version("torch"),
        "torchvision": _version("torchvision"),
        "dali": _dali_version(),
        "opencv": _version("cv2"),
        "numpy": _version("numpy"),
        "pillow": _version("PIL"),
        "imfeed": _imfeed_version(),
    }


def _imfeed_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("imfeed")
    except Exception:  # running from a checkout that was never installed
        return None

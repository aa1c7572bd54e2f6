"""The hardware and software fingerprint written with every result."""

from __future__ import annotations

import importlib
import os
import platform
import sys


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

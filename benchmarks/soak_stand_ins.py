"""``benchmarks/soak.py`` on the GPU path without a GPU: the tests' CPU stand-ins of the GPU
decoders (``decoder="tvcpu"``: torchvision's CPU decode) and Triton's interpreter for the
augmentation kernels, so that the GPU path's own code (prefetch thread, stage, picker,
closes and rebuilds) runs for as long as asked on any machine.

Usage (the interpreter is slow: small outputs):
    python3 benchmarks/soak_stand_ins.py STORE --seconds 150 --device cpu --decoder tvcpu \\
        --cpu-share auto --model none --batch-size 8 --workers 2 --size 16 \\
        --dtype float16 --resume-every 3 --out soak.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests"), str(HERE)]  # checkout first

import pytest
import soak
from gpu_path_data import use_stand_ins

if __name__ == "__main__":
    use_stand_ins(pytest.MonkeyPatch())
    sys.exit(soak.main())

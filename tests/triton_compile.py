"""Triton kernels compiled for sm_90 without a GPU: the interpreter runs code the compiler
refuses (a branch giving a value of another type), so the GPU path's tests compile each
launch they make, with its argument types, in a process without the interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

module, launches, options = json.loads(sys.argv[1])
kernels = importlib.import_module(module)
for name, sig, consts in launches:
    source = ASTSource(fn=getattr(kernels, name), signature=sig, constexprs=consts)
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
print("compiled")
"""


def assert_compiles_for_hopper(module: str, launches: list, tmp_path, **options) -> None:
    """Each (kernel name, signature, constexprs) of ``launches`` in ``module`` compiles for
    sm_90 with ``options`` (Triton's cache in ``tmp_path``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE, json.dumps([module, launches, options])],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-2000:]

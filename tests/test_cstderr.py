"""Capturing what C code writes to fd 2: all of it (worker processes), or only a library's
own lines with everything else written back (the training process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap


def run(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter (fd 2 is then a pipe this test reads)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=60, check=True,
    )  # fmt: skip


def test_captured_takes_everything_written_to_fd_2():
    got = run("""
        import os
        from ingest.cstderr import captured
        with captured() as text:
            os.write(2, b"Corrupt JPEG data: 12 extraneous bytes\\n  second line\\n")
        print(text)
        with captured() as text:
            pass
        print(text)
        """)
    assert got.stdout.splitlines() == [
        "['Corrupt JPEG data: 12 extraneous bytes second line']",
        "[]",
    ]
    assert got.stderr == ""


def test_filtered_keeps_the_library_lines_and_writes_the_rest_back():
    got = run("""
        import os, re
        from ingest.cstderr import filtered
        noise = re.compile(r"^\\x1b\\[0;31m\\[ERROR\\]")
        with filtered(noise) as lines:
            os.write(2, b"\\x1b[0;31m[ERROR] \\x1b[0m[jpeg_parser] Invalid marker\\n")
            os.write(2, b"epoch 3: 50%\\n")
            os.write(2, b"\\x1b[0;31m[ERROR] \\x1b[0m[jpeg_parser] Bad length\\n")
        print(len(lines), lines[1].endswith("Bad length"))
        """)
    assert got.stdout == "2 True\n"
    assert got.stderr == "epoch 3: 50%\n"
    assert re.search("Invalid marker", got.stdout + got.stderr) is None

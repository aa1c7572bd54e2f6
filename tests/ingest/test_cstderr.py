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


def test_overlapping_calls_restore_stderr_and_drop_only_the_library_lines():
    """Two decode threads: A enters, B enters, A leaves, B leaves (the order that left fd 2
    pointing at the scratch file for good)."""
    got = run("""
        import os, re, threading
        from ingest.cstderr import filtered
        noise = re.compile(r"^NOISE")
        before = os.fstat(2).st_ino
        a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
        def a():
            with filtered(noise):
                a_in.set(); b_in.wait(10)
                os.write(2, b"NOISE from a\\n")
            a_out.set()
        def b():
            a_in.wait(10)
            with filtered(noise):
                b_in.set(); a_out.wait(10)
                os.write(2, b"NOISE from b\\nkept from b\\n")
        threads = [threading.Thread(target=a), threading.Thread(target=b)]
        [t.start() for t in threads]; [t.join() for t in threads]
        print(os.fstat(2).st_ino == before)
        os.write(2, b"after\\n")
        """)
    assert got.stdout == "True\n"
    assert got.stderr == "kept from b\nafter\n"


def test_a_fork_while_another_thread_holds_the_lock_leaves_the_child_able_to_capture():
    got = run("""
        import os, threading, time
        from ingest import cstderr
        held = threading.Event()
        def hold():
            with cstderr._LOCK:  # another thread, mid-redirection
                held.set()
                time.sleep(0.3)
        t = threading.Thread(target=hold)
        t.start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            with cstderr.captured() as text:
                os.write(2, b"libjpeg: premature end\\n")
            os.write(1, (repr(text) + "\\n").encode())
            os._exit(0)
        os.waitpid(pid, 0)
        t.join()
        """)
    assert got.stdout == "['libjpeg: premature end']\n"


def test_a_process_forked_mid_redirection_writes_to_the_real_stderr():
    got = run("""
        import os, re
        from ingest.cstderr import filtered
        go_r, go_w = os.pipe()
        with filtered(re.compile(r"^NOISE")):  # a DALI call in another thread, say
            pid = os.fork()
            if pid == 0:
                os.read(go_r, 1)  # until the parent's call is over
                os.write(2, b"from the child\\n")
                os._exit(0)
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        """)
    assert got.stderr == "from the child\n"


def test_still_names_the_stderr_a_call_in_flight_saved_aside():
    """A count of the process's descriptors while another thread is inside a C call's
    redirection sees one more: the real stderr, saved aside; ``still`` names it."""
    done = run("""
        import os
        from ingest import cstderr
        real = os.readlink("/proc/self/fd/2")
        with cstderr.still() as saved:
            assert saved == set()
        with cstderr.captured(), cstderr.still() as saved:
            (fd,) = saved
            assert os.readlink(f"/proc/self/fd/{fd}") == real
            assert os.readlink("/proc/self/fd/2") != real
        with cstderr.still() as saved:
            assert saved == set() and os.readlink("/proc/self/fd/2") == real
        print("ok")
    """)
    assert done.stdout == "ok\n"

"""Who holds the GIL, and where: a summary of ``py-spy record --gil --threads -f raw``.

    py-spy record --gil --threads -r 500 -f raw -o gil.txt -- python3 SCRIPT ...
    python3 benchmarks/gil_share.py gil.txt [TOP]

py-spy samples only the thread holding the GIL (``--gil``), so a thread's share of the
samples is its share of the interpreter. Threads are named by the outermost frame of ours
they run (the GPU prefetch thread's ``_run``, a script's ``main``); per thread, the
functions of the GIL's holder by their own samples (the leaf) and by those under them.
"""

from __future__ import annotations

import collections
import re
import sys

_FRAME = re.compile(r"^(?P<name>.*) \((?P<where>[^()]*)\)$")


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    where = m["where"].rsplit("site-packages/", 1)[-1].replace("/work/main/", "")
    return f"{m['name']} ({where})"


def _role(frames: list[str]) -> str:
    for f in frames:
        if "prefetch.py" in f and f.startswith("_run "):
            return "gpu-prefetch"
        if "decode_threads.py" in f:
            return "decode-thread"
        if "pin_memory" in f or "_pin_memory_loop" in f:
            return "pin-memory"
    return "main" if any(f.startswith("<module> ") for f in frames) else "other"


def main() -> None:
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25
    by_role = collections.Counter()
    leaf = collections.defaultdict(collections.Counter)
    inclusive = collections.defaultdict(collections.Counter)
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = [_short(f) for f in stack.split(";")[1:]]  # the first is the thread
        n = int(count)
        role = _role(frames)
        by_role[role] += n
        leaf[role][frames[-1] if frames else "?"] += n
        for f in set(frames):
            inclusive[role][f] += n
    total = sum(by_role.values())
    print(f"{total} samples holding the GIL")
    for role, n in by_role.most_common():
        print(f"  {role}: {n} ({n / total:.1%})")
    for role, n in by_role.most_common():
        print(f"\n== {role}: {n} samples; by own samples")
        for f, k in leaf[role].most_common(top):
            print(f"  {k:6d} {k / n:6.1%}  {f}")
        print(f"== {role}: by samples under")
        for f, k in inclusive[role].most_common(top):
            print(f"  {k:6d} {k / n:6.1%}  {f}")


if __name__ == "__main__":
    main()

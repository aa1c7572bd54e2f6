"""imfeed-bench from this checkout, with the maintainers' defaults: the project's photographs
(``../shared/photos`` when the checkout sits beside it), data under ``bench-data/peers``,
results into ``benchmarks/results``. Any option of ``imfeed-bench`` may follow, e.g.

    python3 benchmarks/bench_peers.py --name cpu-2cpu-peers
    python3 benchmarks/bench_peers.py --images 20000 --batch-size 256 --workers 16 \\
        --dtype float16 --channels-last --train-check --name gpu-h200
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout first (not an installed copy).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import REPO, photos_dir

from loader.bench.cli import main

if __name__ == "__main__":
    defaults = ["--workdir", str(REPO / "bench-data" / "peers")]
    defaults += ["--out", str(REPO / "benchmarks" / "results")]
    defaults += ["--photos", str(photos_dir())] if photos_dir() else []
    sys.exit(main(defaults + sys.argv[1:]))

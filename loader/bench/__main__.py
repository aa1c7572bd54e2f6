"""``python3 -m loader.bench`` is ``imfeed-bench``."""

import sys

from loader.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())  # its status, as imfeed-bench's

"""``python3 -m loader.bench`` is ``imfeed-bench``."""

from loader.bench.cli import main

if __name__ == "__main__":
    main()

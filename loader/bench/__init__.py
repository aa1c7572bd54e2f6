"""``imfeed-bench``: loader throughput side by side with its peers, on the user's machine.

Run ``imfeed-bench --help``. Nothing here is imported by ``import loader``.
"""

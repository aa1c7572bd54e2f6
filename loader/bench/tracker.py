"""multiprocessing's resource tracker, started for the pipelines' processes (they share it)
without its warning at exit about the shared memory and semaphores the peers leave behind
(Streaming's, LitData's): it removes them then, and the warning, printed on the terminal
after the run, is the peers' doing, not the run's.
"""

from __future__ import annotations

import sys
from multiprocessing import resource_tracker

# Its message: "resource_tracker: There appear to be 6 leaked shared_memory objects ..."
FILTER = "ignore:resource_tracker:UserWarning"


def start_quietly() -> None:
    """Start the tracker (a no-op where it runs already) with ``FILTER`` as its last -W
    option: it takes the parent's options as -W flags, which outrank PYTHONWARNINGS."""
    sys.warnoptions.append(FILTER)
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions.pop()

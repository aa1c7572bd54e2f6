"""Convert an ImageFolder tree into a store: ``build`` and its ``BuildOptions``.

The local driver is ``local.py``, the Ray one ``ray.py``; both run the same tasks
(``tasks.py``) over the same core (``run.py``, ``process.py``) and give the same store.
"""

from ingest.build.local import build
from ingest.build.options import BuildOptions

__all__ = ["BuildOptions", "build"]

"""The warning, once per store, that a store built with ``--no-verify`` meets a GPU decoder.

The GPU decoders decode a corrupt JPEG to garbage without an error, where the CPU path's
strict decode finds and replaces it; decoding every JPEG on the CPU as well would forgo
the GPU path, so the check is left to ``ingest verify``.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # the unverified stores this process was told of


def warn_unverified(store, decoder: str) -> None:
    """Log once per store (by its real path) that ``store``, built with --no-verify, is
    decoded on the GPU by ``decoder``."""
    root = os.path.realpath(store.root)
    if store.manifest.get("options", {}).get("verify", True) is not False or root in _WARNED:
        return
    _WARNED.add(root)
    log.warning(
        "DataLoader: %s was built with --no-verify; decoder=%r decodes its JPEGs on the GPU, "
        "where a corrupt one becomes an image of garbage pixels without an error (the CPU "
        "decoder replaces it): run `ingest verify %s` to find any, or rebuild it without "
        "--no-verify (logged once)", store.root, decoder, store.root,
    )  # fmt: skip

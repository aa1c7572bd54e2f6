"""`ingest cache ls` and `ingest cache clear`: show and remove this user's shard caches."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from ingest import format as fmt
from ingest.format import cachedir as cd

MiB = 1 << 20


def cache_ls(args: argparse.Namespace) -> int:
    """Print every cached store under ``args.root``: one line each, then its processes."""
    caches = cd.list_caches(args.root) if cd.base_dir(args.root, create=False).is_dir() else []
    if args.json:
        print(json.dumps(caches, indent=1))
        return 0
    if not caches:
        print(f"ingest cache: nothing cached under {args.root}")
        return 0
    for c in caches:
        shards = f"{c['shards']}/{c['store_shards'] or '?'} shards"
        keep = ", kept for the next run" if c["keep"] else ""
        stale = " (stale: that store is gone or was rebuilt since)" if c["stale"] else ""
        print(f"{c['id']}  {c['store']}  {shards}, {c['bytes'] / MiB:.1f} MiB{keep}{stale}")
        for name, up in c["users"].items():
            print(f"  user {name}: {'alive' if up else 'dead'}")
        for name, up in c["copying"].items():
            print(f"  copy {name}: owner {'alive' if up else 'dead'}")
    return 0


def cache_clear(args: argparse.Namespace) -> int:
    """Remove the caches under ``args.root`` (that of one store when ``args.out`` is given);
    exit 1 when some were left alone because live processes use them."""
    ident = None if args.out is None else _ident(args.out)
    if not cd.base_dir(args.root, create=False).is_dir():
        print(f"ingest cache: nothing cached under {args.root}")
        return 0
    removed, busy = cd.clear(args.root, ident, force=args.force)
    for name in removed:
        print(f"ingest cache: removed {name}")
    for name, users in busy.items():
        print(
            f"ingest cache: {name} is in use by process(es) {', '.join(users)}: left in "
            "place; stop them first, or pass --force",
            file=sys.stderr,
        )
    if not removed and not busy:
        what = f"for {args.out}" if args.out else f"under {args.root}"
        print(f"ingest cache: nothing cached {what}")
    return 1 if busy else 0


def _ident(out: str) -> str:
    """The cache id of the store at ``out``, or ``out`` itself when it is an id."""
    path = Path(out)
    if (path / fmt.MANIFEST).is_file():
        return cd.store_id((path / fmt.MANIFEST).read_bytes())
    if path.exists() or not re.fullmatch(r"[0-9a-f]{20}", out):  # a path, not an id
        fmt.read_manifest(path)  # raises the StoreError that says what is wrong
    return out

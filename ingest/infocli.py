"""`ingest info`: what a store holds, from its manifest, and its files' problems at a glance
(a ``stat`` each; ``ingest verify`` reads them)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter

from ingest import format as fmt


def summary(manifest: dict) -> dict:
    """The facts `ingest info` prints, as one JSON-able dict."""
    keys = ("num_samples", "num_classes", "classes", "num_rejected", "num_ignored", "num_seen",
            "ignored_by_reason", "record_bytes", "stats", "options", "version")  # fmt: skip
    out = {k: manifest[k] for k in keys}
    out["shards"] = [
        {k: s[k] for k in ("name", "first", "count", "record_bytes", "file_bytes")}
        for s in manifest["shards"]
    ]
    out["file_bytes"] = sum(s["file_bytes"] for s in manifest["shards"])
    return out


def store_info(args: argparse.Namespace) -> int:
    """Print what the store at ``args.store`` holds (its manifest's facts, as JSON with
    ``args.json``) and, on stderr, its files' problems; the command's status."""
    manifest = fmt.read_manifest(args.store)
    info = summary(manifest)
    problems = _file_problems(args.store, manifest)
    info["problems"] = list(problems.values())
    status = _say_problems(args.store, info["problems"])
    if args.json:
        print(json.dumps(info, indent=1))
        return status
    mib = 1 << 20
    print(f"store      {args.store} (format v{info['version']})")
    print(f"samples    {info['num_samples']} in {info['num_classes']} classes")
    print(f"shards     {len(info['shards'])}, {info['file_bytes'] / mib:.1f} MiB on disk, "
          f"{info['record_bytes'] / mib:.1f} MiB of records")  # fmt: skip
    per = info["record_bytes"] / max(info["num_samples"], 1) / 1000
    encoding = info["options"].get("encoding", "jpeg") if isinstance(info["options"], dict) else "?"
    print(f"encoding   {fmt.shown(str(encoding))}, {per:.1f} KB of record a sample")
    print(f"seen       {info['num_seen']} = kept {info['num_samples']} + rejected "
          f"{info['num_rejected']} + ignored {info['num_ignored']}")  # fmt: skip
    # A rejects file not as the manifest says is told already, and has no reasons to read.
    reasons = Counter() if "rejects" in problems else _reject_reasons(args.store)
    rows = [
        *info["stats"].items(),
        *((f"ignored: {reason}", n) for reason, n in info["ignored_by_reason"].items()),
        *((f"rejected: {reason}", n) for reason, n in reasons.most_common()),
    ]
    for name, count in rows:  # a store's text, untrusted: without control characters
        print(f"  {fmt.shown(str(name)):<40} {count}")
    return status


def _file_problems(store: str, manifest: dict) -> dict[str | int, str]:
    """What is wrong with the store's files at a glance, by file ("index", "paths",
    "rejects" or a shard's number): where each lies, its kind and its size against the
    manifest (a ``stat`` each, not ``ingest verify``'s read of them)."""
    problems = {}
    for what in (*(k for k in ("index", "paths", "rejects") if k in manifest),
                 *range(len(manifest["shards"]))):  # fmt: skip
        try:
            fmt.store_file(store, manifest, what)
        except fmt.StoreError as e:
            problems[what] = str(e)
    return problems


def _say_problems(store: str, problems: list[str]) -> int:
    """One line on stderr for the files' problems (the summary is the manifest's); the
    command's status."""
    if not problems:
        return 0
    more = f"{len(problems)} of its files are not as its manifest says; the first: "
    print(f"ingest info: error: {more if len(problems) > 1 else ''}{problems[0]}",
          file=sys.stderr)  # fmt: skip
    return 1


def _reject_reasons(store: str) -> Counter:
    """Rejected files by the first part of their reason (before any colon or bracket)."""
    reasons = (r.get("reason", "?") for r in fmt.read_rejects(store, fmt.read_manifest(store)))
    return Counter(re.split(r"[:(]", str(r), maxsplit=1)[0].strip() for r in reasons)

"""Source paths as a store keeps them (str, or bytes where not UTF-8) and as messages and
JSON lines show them (a store is untrusted: no terminal escapes)."""

from __future__ import annotations

import json
import os


def path_value(rel: str) -> str | bytes:
    """A source path as a store keeps it: the str when it is valid Unicode, else the file
    name's bytes (a name that is not UTF-8 arrives from os.walk with surrogate escapes)."""
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        return os.fsencode(rel)
    return rel


def path_text(value: str | bytes) -> str:
    """A stored path as ``os.walk`` gives it (undecodable bytes as surrogate escapes)."""
    return value if isinstance(value, str) else os.fsdecode(value)


def shown(rel: str | bytes) -> str:
    """A path for messages: undecodable bytes and control characters (a terminal's escape
    sequences, line breaks: a store is untrusted) shown as ``\\xNN``."""
    text = os.fsencode(path_text(rel)).decode("utf-8", "backslashreplace")
    return text.translate(_CONTROLS)


_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(32), *range(127, 160))}


def json_line(obj: dict) -> str:
    """One JSON line, readable UTF-8 where possible; lone surrogates (paths that are not
    UTF-8) escaped as ``\\udcNN``, which json.loads turns back into the same str."""
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8").decode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj)

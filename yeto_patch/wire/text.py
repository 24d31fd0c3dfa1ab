"""Text a peer sent, made safe to log, and the rule for island ids.

Peers are untrusted: anything they send (an ERROR's message, an island id, a field echoed in an error) goes
through :func:`printable` before it reaches a log, so it cannot forge log lines (newlines, CR), drive a
terminal (ANSI escapes), break a log handler (lone surrogates) or flood the log (length bound).
"""
from __future__ import annotations

import logging
import numbers

__all__ = ["printable", "check_island_id", "MAX_ISLAND_ID", "EscapeArgs"]

MAX_ISLAND_ID = 256


def printable(s, limit: int = 200) -> str:
    """``s`` (anything; str() of it) with every character that is not printable (controls, newlines, CR, ESC,
    format characters such as bidi overrides, lone surrogates, unassigned code points) escaped as ``\\xNN`` /
    ``\\uNNNN`` / ``\\UNNNNNNNN``, and cut to ``limit`` characters (``...(+N chars)`` names the rest)."""
    try:
        text = s if isinstance(s, str) else str(s)
    except Exception:  # noqa: BLE001 - a hostile object's __str__
        text = f"<unprintable {type(s).__name__}>"
    cut = len(text) - limit if limit is not None and len(text) > limit else 0
    if cut:
        text = text[:limit]
    out = []
    for ch in text:
        if ch.isprintable() and ch != "\\":
            out.append(ch)
        elif ch == "\\":
            out.append("\\\\")
        else:
            o = ord(ch)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000 else f"\\U{o:08x}")
    if cut:
        out.append(f"...(+{cut} chars)")
    return "".join(out)


def check_island_id(island) -> str:
    """An island id is a str of 1..256 printable characters (str.isprintable: no controls, newlines, format
    characters or surrogates; spaces allowed) that encodes as UTF-8. Raises ValueError naming what is wrong
    (the id itself escaped)."""
    if not isinstance(island, str):
        raise ValueError(f"island_id must be a string, got {type(island).__name__}")
    if not 1 <= len(island) <= MAX_ISLAND_ID:
        raise ValueError(f"island_id must have 1..{MAX_ISLAND_ID} characters, got {len(island)}")
    if not island.isprintable():
        raise ValueError(f"island_id {printable(island, 80)!r} contains control, format or unpaired "
                         "surrogate characters")
    try:
        island.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"island_id {printable(island, 80)!r} is not encodable as UTF-8") from None
    return island


class EscapeArgs(logging.Filter):
    """A logger filter that passes every argument of a record (the parts that may come from peers; the format
    string is ours) through :func:`printable` with ``limit`` characters, exceptions included."""

    def __init__(self, limit: int = 2000):
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and args:
            record.args = tuple(a if isinstance(a, numbers.Number) else
                                printable(a, self.limit) for a in args)
        return True

"""How one ``YETO_*`` variable's text becomes a value: the parsers ``config.TABLE`` is written with.

Each parser is a ``Parser`` (``parse(name, raw, default)`` raising ``ConfigError`` naming the variable, ``fmt`` for
doctor, ``accepts`` for the docs). They hold no state and know no variable; which variable uses which parser, and
the rules between variables, are config.py's. This module imports nothing heavy and nothing else of yeto-patch
but ``wire.codec_names`` (stdlib only: the one list of codec names).
"""
from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple

from .wire import codec_names

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.I)
MAX_SYNCER_SHARDS = 1024


class ConfigError(ValueError):
    """A YETO_* variable has a value yeto-patch cannot use; the message names the variable."""


# --------------------------------------------------------------------------------------------------- parsers
class Parser(NamedTuple):
    """How one variable's text becomes a value: ``parse(name, raw, default)`` (raw is never None; it raises
    ConfigError naming the variable), ``fmt(value)`` for doctor, ``accepts`` for the docs."""
    parse: Callable[[str, str, Any], Any]
    fmt: Callable[[Any], Any]
    accepts: str


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _fmt_int(n) -> str:
    return f"10^{len(str(n)) - 1}" if n >= 10**6 and str(n).strip("0") == "1" else str(n)


def boolean() -> Parser:
    def parse(name, raw, default):
        v = raw.strip().lower()
        if v in TRUE_WORDS:
            return True
        if v in FALSE_WORDS:
            return False
        raise ConfigError(f"{name}={raw!r} is not a boolean: use 1/0 (also true/false, yes/no, on/off)")
    return Parser(parse, int, "1/0")


def integer(lo: int, hi: int, what: str) -> Parser:
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        try:
            v = int(raw.strip(), 10)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer: {what}, an integer in [{lo}, {hi}]") from None
        if not lo <= v <= hi:
            raise ConfigError(f"{name}={v} is out of range: {what}, an integer in [{lo}, {hi}]")
        return v
    return Parser(parse, lambda v: v, f"{lo}..{_fmt_int(hi)}")


def number(lo: float, hi: float, what: str) -> Parser:
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        try:
            v = float(raw.strip())
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a number: {what}, a number in [{lo}, {hi}]") from None
        if not (lo <= v <= hi):  # also refuses nan
            raise ConfigError(f"{name}={raw.strip()} is out of range: {what}, a number in [{lo}, {hi}]")
        return v
    return Parser(parse, lambda v: v, f"{lo:g}..{hi:g}")


def size(lo: int, hi: int, what: str) -> Parser:
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        m = _SIZE_RE.match(raw)
        if not m:
            raise ConfigError(f"{name}={raw!r} is not a size: {what}, bytes as an integer with an optional "
                              f"K/M/G suffix (binary: 64M = 64MiB), between {_fmt_bytes(lo)} and {_fmt_bytes(hi)}")
        v = int(m.group(1)) << (10 * " kmgt".index(m.group(2).lower() or " "))
        if not lo <= v <= hi:
            raise ConfigError(f"{name}={raw.strip()} is out of range: {what}, between {_fmt_bytes(lo)} "
                              f"and {_fmt_bytes(hi)}")
        return v
    return Parser(parse, _fmt_bytes, f"{_fmt_bytes(lo)}..{_fmt_bytes(hi)}, K/M/G")


def or_auto(inner: Parser) -> Parser:
    """``inner``, or ``auto`` (also empty): None, a value a rule decides later (``_resolve`` or the island)."""
    def parse(name, raw, default):
        if raw.strip().lower() in ("auto", ""):
            return None
        return inner.parse(name, raw, default)
    return Parser(parse, lambda v: "auto" if v is None else inner.fmt(v), f"auto, {inner.accepts}")


def sync_every(auto_h: int) -> Parser:
    """H (an integer), or ``auto`` / ``auto:N``: H follows the fleet's pace, N (default ``auto_h``) at full pace; the
    value is ``(H, auto)`` until ``_resolve`` splits it."""
    inner = integer(1, 10**9, "H, optimizer steps between boundaries of one fragment")

    def parse(name, raw, default):
        v = raw.strip().lower()
        if v == "auto" or v.startswith("auto:"):
            try:
                return (inner.parse(name, v[5:], auto_h) if v != "auto" else auto_h, True)
            except ConfigError:
                raise ConfigError(f"{name}={raw!r} is not accepted: auto, auto:N or N, with N an integer in "
                                  f"[1, 10^9] (H, optimizer steps between boundaries of one fragment)") from None
        return (inner.parse(name, raw, default), False)
    return Parser(parse, lambda v: v, f"{inner.accepts}, auto, auto:N")


def duration() -> Parser:
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        m = re.match(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$", raw, re.I)
        v = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2).lower()] if m else None
        if v is None or not 1 <= v <= 7 * 86400:
            raise ConfigError(f"{name}={raw!r} is not a usable timeout: seconds between 1 and 604800, optionally "
                              f"with an s/m/h suffix (e.g. 600, 90s, 10m)")
        return v
    return Parser(parse, lambda v: "%gs" % v, "1..604800 s, s/m/h")


def choice(choices) -> Parser:
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        v = raw.strip()
        for c in choices:
            if v.lower() == c.lower():
                return c
        raise ConfigError(f"{name}={raw!r} is not accepted: use one of {', '.join(choices)}")
    return Parser(parse, lambda v: v, ", ".join(choices))


def codec() -> Parser:
    """A codec name (wire.codec_names: the dense names or ``topk:F+intB``), case and spacing free, canonical."""
    def parse(name, raw, default):
        if raw.strip() == "":
            return default
        v = codec_names.canonical(raw)
        if v is None:
            raise ConfigError(f"{name}={raw!r} is not accepted: use one of {codec_names.describe()}")
        return v
    return Parser(parse, lambda v: v,
                  f"{', '.join(codec_names.PLAIN)}, int8, int4(-log), int1, {codec_names.SPARSE_FORM}")


def text(accepts: str = "text") -> Parser:
    """Stripped text; blank means unset (None)."""
    return Parser(lambda name, raw, default: raw.strip() or None, lambda v: v, accepts)


def island_id(name, raw, default):
    v = raw.strip()
    if v and not _ID_RE.match(v):
        raise ConfigError(f"{name}={v!r} is not accepted: 1-64 characters of A-Z a-z 0-9 . _ : @ -")
    return v or None



def address(name, raw, default):
    """'host:port' or '[v6]:port', or a comma-separated list of them (a sharded syncer, in shard order) -> the
    same, normalised and comma-joined; blank -> None; ConfigError naming the variable."""
    parts = [p for p in re.split(r"[,\s;]+", raw.strip()) if p]
    if not parts:
        return None
    if len(parts) > MAX_SYNCER_SHARDS:
        raise ConfigError(f"{name} lists {len(parts)} addresses; at most {MAX_SYNCER_SHARDS} syncer shards")
    out = []
    for part in parts:
        host, port = parse_address(part, name, raw)
        out.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    if len(set(out)) != len(out):
        raise ConfigError(f"{name}={raw!r} lists an address twice: give each syncer shard once, in shard order")
    return ",".join(out)


def parse_address(addr: str, name: str = "YETO_DILOCO_SYNCER", raw: str = None):
    """'host:port' or '[v6]:port' -> (host, port); ConfigError naming the variable otherwise."""
    raw = addr if raw is None else raw
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", addr) or re.match(r"^([A-Za-z0-9._-]+):(\d+)$", addr)
    if not m:
        what = f"{name}={raw!r}" if raw == addr else f"{name}={raw!r}: {addr!r}"
        raise ConfigError(f"{what} is not an address: use host:port (or [ipv6]:port), e.g. "
                          f"syncer.example.org:7640")
    host, port = m.group(1), int(m.group(2))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r}: port {port} is out of range 1-65535")
    return host, port

"""yeto-patch island settings: every ``YETO_*`` variable, described ONCE in ``TABLE`` and validated once into a
frozen ``Settings``.

yeto-patch attaches to a Megatron launch when ``YETO_DILOCO_SYNCER`` is set or ``YETO_DILOCO_AUTO_ATTACH=1``, and
``YETO_DILOCO_DISABLE`` is not set to 1. The variables are read when a process starts training (its first
``train_step`` or optimizer step), not at interpreter start-up, so processes that inherit them and never train
(data workers, tokenizer helpers, ``python -c``) are not affected. A bad value stops training on every rank with
a ``ConfigError`` naming the variable and the accepted values. The ``YETO_DILOCO_`` prefix belongs to
yeto-patch: an unknown ``YETO_DILOCO_*`` name (a typo) is refused too, with the closest known name.

``TABLE`` is the single source: it builds the ``Settings`` class (one field per entry), ``from_env``, the rows
``yeto-patch doctor`` prints (``Settings.as_table``), the variable table at the end of this docstring, and the
README's table (``python -m yeto_patch.config --markdown``; tests/hooks/test_config.py keeps README.md equal
to it). Adding a variable is one entry::

    Var("YETO_DILOCO_FOO", "foo", integer(1, 64, "foos per bar"), 8, "what it does, for the README"),

and reading ``settings.foo`` where it is used. Rules that tie several variables together (the key/insecure rule,
tau < H, the island id default, ``{island}`` in the metrics path) live in ``_resolve``.

The parsers the table is written with live in config_values.py. This module imports nothing heavy (no torch, no
Megatron, nothing else of yeto-patch but config_values).
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import socket
import sys
import textwrap
import threading
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

from .config_values import (TRUE_WORDS, ConfigError, Parser, address, boolean, choice, codec, duration, integer,
                            island_id, number, or_auto, size, sync_every, text)
from .wire import codec_names

__all__ = ["ConfigError", "Settings", "TABLE", "VARIABLES", "Var", "attached", "from_env", "get", "markdown",
           "reset"]

PUSH_DTYPES = codec_names.DENSE   # and the sparse family topk:F+intB (wire.codec_names)
AUTO_TAU_MAX = 5   # YETO_DILOCO_OVERLAP_STEPS=auto: min(AUTO_TAU_MAX, H // 2)
AUTO_H = 100       # YETO_DILOCO_SYNC_EVERY=auto: H at the fleet's pace (auto:N for another)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


# --------------------------------------------------------------------------------------------------- the table
_HIDDEN = object()


class Var(NamedTuple):
    """One variable. ``field``: its ``Settings`` attribute; ``default``: the value when unset; ``shown``: the
    default as documented (default: ``parser.fmt(default)``); ``show``: what doctor prints for it (None: the
    value through ``parser.fmt``; ``_HIDDEN``: no row; a callable of the Settings: that); ``label``: doctor's
    row name (default: the variable's)."""
    name: str
    field: str
    parser: Parser
    default: Any
    doc: str
    type: Any = Any
    shown: Optional[str] = None
    show: Union[None, object, Callable[[Any], Any]] = None
    label: Optional[str] = None

    @property
    def documented_default(self) -> str:
        if self.shown is not None:
            return self.shown
        return str(self.parser.fmt(self.default))


TABLE = (
    Var("YETO_DILOCO_SYNCER", "syncer", Parser(address, lambda v: v, "host:port[,host:port...]"), None,
        "syncer address `host:port` (`[v6]:port`); setting it attaches yeto-patch; a sharded syncer: every "
        "shard's, comma-separated in shard order (or shard 0's alone with `--shard-addresses`)", Optional[str],
        "(unset)"),
    Var("YETO_DILOCO_AUTO_ATTACH", "auto_attach", boolean(), False,
        "`1`: attach without a syncer address too, so a job that forgot it fails at start", bool, show=_HIDDEN),
    Var("YETO_DILOCO_DISABLE", "disable", boolean(), False, "`1`: stay inert whatever else is set", bool,
        show=_HIDDEN),
    Var("YETO_DILOCO_KEY_FILE", "key_file", text("path"), None,
        "file with the shared secret (>= 16 bytes; not group- or world-readable), read on island rank 0",
        Optional[str], "(unset)", show=lambda s: s.key_source, label="key"),
    Var("YETO_KEY", "key_from_env", Parser(lambda name, raw, default: bool(raw), bool, "text"), False,
        "the shared secret itself, when no key file is set (never shown or logged)", bool, "(unset)",
        show=_HIDDEN),
    Var("YETO_DILOCO_INSECURE", "insecure", boolean(), False,
        "`1`: run without a key; accepted only with a loopback syncer address", bool, show=_HIDDEN),
    Var("YETO_DILOCO_ISLAND_ID", "island_id", Parser(island_id, lambda v: v, "1-64 of `A-Za-z0-9._:@-`"), None,
        "stable name of this island at the syncer (the default is stable within one launch); set it in "
        "production", str,
        "<MASTER_ADDR or host>:<MASTER_PORT>",
        show=lambda s: s.island_id + ("  (default)" if s.island_id_default else "")),
    Var("YETO_DILOCO_SYNC_EVERY", "sync_every", sync_every(AUTO_H), 100, "H: optimizer steps between a fragment's "
        f"boundaries (fragments take turns); `auto` (`auto:N`): {AUTO_H} (N) on the fastest island, fewer on slower "
        "ones; `N`: N on the slowest, more (at most 3x) on faster ones: all push together", int,
        show=lambda s: f"auto:{s.sync_every}" if s.sync_auto else s.sync_every),
    Var("YETO_DILOCO_PUSH_DTYPE", "push_dtype", codec(), "int4", "pushes' wire dtype", str),
    Var("YETO_DILOCO_BLOCK", "block", integer(8, 65536, "elements per quantization scale"), 256,
        "quantization block size (elements per float32 scale)", int),
    Var("YETO_DILOCO_ERROR_FEEDBACK", "error_feedback", or_auto(boolean()), None,
        "`1`: carry each push's quantization residual into the fragment's next push (4 bytes/parameter on rank "
        "0's host); `auto`: on for quantized pushes if that fits in a quarter of rank 0's host memory",
        Optional[bool], "auto"),
    Var("YETO_DILOCO_START_DIGEST", "start_digest", boolean(), True,
        "`1`: fragments equal to the syncer's initial base are declared by xxh3 digests, not downloaded",
        bool),
    Var("YETO_DILOCO_INITIALIZER", "initializer", boolean(), False,
        "`1`: this island's weights start the run (a fine-tune's pretrained island): the syncer takes its INIT",
        bool),
    Var("YETO_DILOCO_OVERLAP_STEPS", "overlap_steps", or_auto(integer(0, 10**9, "tau, steps a merged base may "
        "trail its push")), None, "tau: a merged base is installed exactly tau steps after its push (waiting there "
        "if late); `0`: synchronous DiLoCo (reproducible bits); < H; `>= 1`: pushes and bases off the training "
        f"thread, blended in with alpha; `auto`: min({AUTO_TAU_MAX}, H // 2)", int, "auto"),
    Var("YETO_DILOCO_MERGE_ALPHA", "merge_alpha", number(0.0, 1.0, "weight of the local model when a base is "
        "installed under overlap"), 0.5, "alpha for installs under overlap: installed = alpha * local + "
        "(1 - alpha) * base", float),
    Var("YETO_DILOCO_CHUNK_BYTES", "chunk_bytes", size(64 << 10, 4 << 30, "gather chunk size"), 64 << 20,
        "gather/scatter chunk size; sync memory per rank is a small multiple of it", int),
    Var("YETO_DILOCO_SEND_QUEUE_BYTES", "send_queue_bytes", size(1 << 20, 1 << 40, "bytes queued for the "
        "background sender"), 1 << 30, "encoded push bytes rank 0 may queue for the background sender before a "
        "boundary waits", int),
    Var("YETO_DILOCO_TOTAL_STEPS", "total_steps", integer(1, 10**12, "the step of the final cut"), None,
        "step of the final cut; required for a custom loop with only the optimizer hook", Optional[int],
        "Megatron's train_iters"),
    Var("YETO_DILOCO_VOCAB_SIZE", "vocab_size", integer(1, 10**9, "the real (unpadded) vocabulary size"), None,
        "real (unpadded) vocabulary size, so islands with different TP sizes merge the embedding rows that hold "
        "tokens", Optional[int], "tokenizer's, when known"),
    Var("YETO_DILOCO_TIMEOUT", "timeout", duration(), 600.0,
        "seconds any collective, socket wait or base wait may take before every rank fails with the cause", float),
    Var("YETO_DILOCO_METRICS", "metrics_path", text("file path"), None,
        "JSONL file rank 0 appends one record per boundary to (bytes, timings, pull lag); `{island}` expands "
        "to the island id", Optional[str],
        "(unset)"),
    Var("YETO_DILOCO_METRICS_PORT", "metrics_port", integer(0, 65535, "a port"), None,
        "rank 0 serves the island's Prometheus metrics on this port (0: any free one)", Optional[int], "(unset)"),
    Var("YETO_DILOCO_METRICS_ADDR", "metrics_addr", text("address"), "127.0.0.1",
        "address the island's metrics port binds to", str),
    Var("YETO_DILOCO_FIGURES", "figures", boolean(), True,
        "`0`: no `yeto/*` figures in the launcher's TensorBoard / W&B", bool),
    Var("YETO_DILOCO_LOG_LEVEL", "log_level", choice(LOG_LEVELS), "INFO", "log level of logger `yeto_patch`", str),
)
_BY_NAME = {v.name: v for v in TABLE}
_KNOWN = frozenset(_BY_NAME)
# (name, default as documented, meaning): the same table in the 3-column form older callers read
VARIABLES = tuple((v.name, v.documented_default, v.doc) for v in TABLE)


# --------------------------------------------------------------------------------------------------- Settings
def _key_source(self) -> str:
    if self.key_file:
        return "file " + self.key_file
    if self.key_from_env:
        return "environment YETO_KEY"
    return "none (insecure, loopback)"


def _as_table(self) -> list:
    """(variable, resolved value) rows, for `yeto-patch doctor` and logs; the key itself is never shown."""
    rows = []
    for v in TABLE:
        if v.show is _HIDDEN:
            continue
        value = getattr(self, v.field)
        if v.show is not None:
            shown = v.show(self)
        elif value is None:
            shown = v.documented_default if v.documented_default.startswith("(") else f"({v.documented_default})"
        else:
            shown = v.parser.fmt(value)
        rows.append((v.label or v.name, shown))
    return rows


# fields the rules of _resolve derive from several variables (not set by any one of them)
_DERIVED = (("syncer_host", Optional[str]), ("syncer_port", Optional[int]), ("island_id_default", bool),
            ("sync_auto", bool))
Settings = dataclasses.make_dataclass(
    "Settings", [(v.field, v.type) for v in TABLE] + list(_DERIVED), frozen=True,
    namespace={"key_source": property(_key_source), "as_table": _as_table,
               "__doc__": "The validated YETO_* settings of a process: one field per entry of config.TABLE "
                          "(plus syncer_host, syncer_port, island_id_default)."})
Settings.__module__ = __name__


# --------------------------------------------------------------------------------------------------- reading
def _truthy(v: Optional[str]) -> bool:
    return (v or "").strip().lower() in TRUE_WORDS


def attached(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether yeto-patch is configured to attach (the same rule sitecustomize applies)."""
    env = os.environ if env is None else env
    if _truthy(env.get("YETO_DILOCO_DISABLE")):
        return False
    return bool((env.get("YETO_DILOCO_SYNCER") or "").strip()) or _truthy(env.get("YETO_DILOCO_AUTO_ATTACH"))


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _default_island_id(env) -> str:
    addr = (env.get("MASTER_ADDR") or "").strip()
    if not addr or _is_loopback(addr):
        addr = socket.gethostname() or "island"
    port = (env.get("MASTER_PORT") or "").strip() or "0"
    ident = re.sub(r"[^A-Za-z0-9._:@-]", "_", f"{addr}:{port}")
    return ident[-64:]


def _check_unknown(env):
    for k in env:
        if k.startswith("YETO_DILOCO_") and k not in _KNOWN:
            close = difflib.get_close_matches(k, sorted(_KNOWN), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{k} is not a yeto-patch variable{hint}; the YETO_DILOCO_ prefix is reserved, "
                              f"known variables: {', '.join(sorted(_KNOWN - {'YETO_KEY'}))}")


def _read(env, var: Var):
    raw = env.get(var.name)
    return var.default if raw is None else var.parser.parse(var.name, raw, var.default)


def auto_overlap_steps(sync_every: int) -> int:
    """tau when YETO_DILOCO_OVERLAP_STEPS is unset: overlap with alpha blending was the best measured setting at H
    = 10 and H = 50 (docs/convergence.md), and tau < H leaves a base time to arrive: min(AUTO_TAU_MAX, H // 2)."""
    return min(AUTO_TAU_MAX, sync_every // 2)


def _resolve(v: dict, env) -> None:
    """The rules between variables, in place on the field values."""
    syncer = v["syncer"]
    if syncer is None:
        v["syncer_host"] = v["syncer_port"] = None
        if not v["disable"]:
            raise ConfigError("YETO_DILOCO_SYNCER is not set: yeto-patch is attached (YETO_DILOCO_AUTO_ATTACH=1) "
                              "and needs the syncer address host:port (or set YETO_DILOCO_DISABLE=1 to train "
                              "without it)")
    else:
        host, port = syncer.split(",")[0].rsplit(":", 1)
        v["syncer_host"], v["syncer_port"] = host.strip("[]"), int(port)
    host = v["syncer_host"]
    if host is not None and v["key_file"] is None and not v["key_from_env"]:
        if not v["insecure"]:
            raise ConfigError("YETO_DILOCO_KEY_FILE is not set (nor YETO_KEY): the syncer handshake needs the shared "
                              "key; set YETO_DILOCO_INSECURE=1 only for a loopback syncer in tests")
        for h in [a.rsplit(":", 1)[0].strip("[]") for a in syncer.split(",")]:
            if not _is_loopback(h):
                raise ConfigError(f"YETO_DILOCO_INSECURE=1 is only accepted with a loopback syncer address, not "
                                  f"{h!r}: set YETO_DILOCO_KEY_FILE (or YETO_KEY)")
    h = v["sync_every"]   # (H, auto) from its parser, or the plain default
    v["sync_every"], v["sync_auto"] = h if isinstance(h, tuple) else (h, False)
    v["island_id_default"] = v["island_id"] is None
    if v["island_id"] is None:
        v["island_id"] = _default_island_id(env)
    if v["overlap_steps"] is None:
        v["overlap_steps"] = auto_overlap_steps(v["sync_every"])
    if v["overlap_steps"] >= v["sync_every"]:
        raise ConfigError(f"YETO_DILOCO_OVERLAP_STEPS={v['overlap_steps']} must be smaller than "
                          f"YETO_DILOCO_SYNC_EVERY={v['sync_every']}: a fragment's base must arrive before its next "
                          f"boundary")
    why = codec_names.block_refusal(v["push_dtype"], v["block"])
    if why:
        raise ConfigError(f"YETO_DILOCO_BLOCK={v['block']} does not suit YETO_DILOCO_PUSH_DTYPE={v['push_dtype']}: "
                          f"{why}")
    metrics = v["metrics_path"]
    if metrics is not None:
        metrics = v["metrics_path"] = metrics.replace("{island}", v["island_id"])
        parent = os.path.dirname(os.path.abspath(metrics))
        if os.path.isdir(metrics):
            raise ConfigError(f"YETO_DILOCO_METRICS={metrics!r} is a directory: give a file path for the JSONL")
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ConfigError(f"YETO_DILOCO_METRICS={metrics!r}: {parent!r} is not a directory")


def from_env(env: Optional[Mapping[str, str]] = None) -> "Settings":
    """Validate the YETO_* variables of `env` (default os.environ) into Settings; ConfigError on any bad value."""
    env = dict(os.environ if env is None else env)
    _check_unknown(env)
    values = {var.field: _read(env, var) for var in TABLE}
    _resolve(values, env)
    return Settings(**values)


_lock = threading.Lock()
_cached: Optional["Settings"] = None
_cached_error: Optional[ConfigError] = None


def get() -> "Settings":
    """The process's settings, read from os.environ once; the same ConfigError is raised on every later call."""
    global _cached, _cached_error
    with _lock:
        if _cached is None and _cached_error is None:
            try:
                _cached = from_env()
            except ConfigError as err:
                _cached_error = err
        if _cached_error is not None:
            raise ConfigError(str(_cached_error))
        return _cached


def reset() -> None:
    """Forget the cached settings (tests)."""
    global _cached, _cached_error
    with _lock:
        _cached = _cached_error = None


# --------------------------------------------------------------------------------------------------- docs
def _md_default(shown: str) -> str:
    return shown if shown.startswith("(") or (" " in shown and "<" not in shown) else f"`{shown}`"


def markdown() -> str:
    """The README's variable table (one row per TABLE entry)."""
    lines = ["| variable | default | values | meaning |", "|---|---|---|---|"]
    for v in TABLE:
        cells = (f"`{v.name}`", _md_default(v.documented_default), v.parser.accepts, v.doc)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def _plain_table() -> str:
    rows = []
    for v in TABLE:
        doc = textwrap.wrap(f"{v.doc} [{v.parser.accepts}]".replace("`", ""), 70)
        rows.append(f"{v.name:<30} default {v.documented_default}\n" + "".join(f"    {d}\n" for d in doc))
    return "\n".join(rows)


__doc__ = (__doc__ or "") + "\nVariables\n=========\n\n" + _plain_table()


def _main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv == ["--markdown"]:
        sys.stdout.write(markdown())
        return 0
    sys.stdout.write(_plain_table() if not argv else "usage: python -m yeto_patch.config [--markdown]\n")
    return 0 if not argv else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())

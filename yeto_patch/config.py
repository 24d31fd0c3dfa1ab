"""yeto-patch island settings: every ``YETO_DILOCO_*`` variable, validated once into a frozen ``Settings``.

yeto-patch attaches to a Megatron launch when ``YETO_DILOCO_SYNCER`` is set or ``YETO_DILOCO_AUTO_ATTACH=1``, and
``YETO_DILOCO_DISABLE`` is not set to 1. The variables are read when a process starts training (its first
``train_step`` or optimizer step), not at interpreter start-up, so processes that inherit them and never train
(data workers, tokenizer helpers, ``python -c``) are not affected. A bad value stops training on every rank with
a ``ConfigError`` naming the variable and the accepted values. The ``YETO_DILOCO_`` prefix belongs to
yeto-patch: an unknown ``YETO_DILOCO_*`` name (a typo) is refused too, with the closest known name.

==============================  =========================  ========================================================
Variable                        Default                    Meaning
==============================  =========================  ========================================================
YETO_DILOCO_SYNCER              (unset)                    Syncer address ``host:port`` (``[v6addr]:port`` for
                                                           IPv6). Setting it attaches yeto-patch. One address:
                                                           a list (sharded syncers) is refused for now.
YETO_DILOCO_AUTO_ATTACH         0                          1: attach even without YETO_DILOCO_SYNCER, so a job that
                                                           forgot the address fails at start instead of silently
                                                           training without DiLoCo.
YETO_DILOCO_DISABLE             0                          1: yeto-patch stays inert whatever else is set.
YETO_DILOCO_KEY_FILE            (unset)                    File holding the shared secret (must not be group- or
                                                           world-readable). Read on island rank 0 only.
YETO_KEY                        (unset)                    The shared secret itself, used when no key file is set.
YETO_DILOCO_INSECURE            0                          1: allow running without a key; only accepted with a
                                                           loopback syncer address.
YETO_DILOCO_ISLAND_ID           <addr>:<MASTER_PORT>       Stable name of this island at the syncer (1-64 chars of
                                                           ``A-Za-z0-9._:@-``). Default: MASTER_ADDR (or this host's
                                                           name when MASTER_ADDR is loopback/unset) and MASTER_PORT,
                                                           the same on every rank of one island and across restarts
                                                           of the same launch. Set it explicitly in production.
YETO_DILOCO_SYNC_EVERY          100                        H: optimizer steps between two boundaries of the same
                                                           fragment. Fragments take turns, spread evenly over H.
YETO_DILOCO_PUSH_DTYPE          int4                       Wire dtype of pushed deltas: f32, bf16, int8, int4,
                                                           int4-log.
YETO_DILOCO_BLOCK               256                        Quantization block size (elements per scale), 8-65536.
YETO_DILOCO_ERROR_FEEDBACK      0                          1: carry each push's quantization residual into the next
                                                           push of that fragment (costs 4 bytes per parameter of
                                                           host memory on island rank 0).
YETO_DILOCO_START_DIGEST        1                          1: at start rank 0 reads the model once and sends a
                                                           digest per tensor; fragments whose weights already equal
                                                           the syncer's base (islands started from the same seed or
                                                           checkpoint) are not downloaded. 0: always download.
YETO_DILOCO_OVERLAP_STEPS       0                          tau: steps a fragment's merged base may trail its push
                                                           before the island waits for it. 0 = synchronous DiLoCo.
                                                           Must be smaller than YETO_DILOCO_SYNC_EVERY.
YETO_DILOCO_MERGE_ALPHA         0.5                        alpha for installs under overlap (tau > 0): installed =
                                                           alpha * local + (1 - alpha) * base. In [0, 1].
YETO_DILOCO_CHUNK_BYTES         64MiB                      Gather/scatter chunk size (sync memory per rank is a
                                                           small multiple of it). Suffixes K, M, G, KiB, MiB, GiB.
YETO_DILOCO_SEND_QUEUE_BYTES    1GiB                       Encoded push bytes rank 0 may hold for the background
                                                           sender before a boundary waits (back-pressure).
YETO_DILOCO_TOTAL_STEPS         Megatron's train_iters     Step of the final cut. Required when the training loop
                                                           does not tell (custom loop with the optimizer hook only).
YETO_DILOCO_VOCAB_SIZE          tokenizer's, when known    Real (unpadded) vocabulary size, so islands with
                                                           different TP sizes merge embedding rows that hold tokens.
YETO_DILOCO_TIMEOUT             600                        Seconds any collective, socket wait or base wait may take
                                                           before every rank fails with the cause (s/m/h suffixes).
YETO_DILOCO_METRICS             (unset)                    JSONL file rank 0 appends one record per boundary to;
                                                           ``{island}`` is replaced by the island id.
YETO_DILOCO_LOG_LEVEL           INFO                       DEBUG, INFO, WARNING or ERROR (logger ``yeto_patch``).
==============================  =========================  ========================================================

This module imports nothing heavy (no torch, no Megatron, nothing else of yeto-patch).
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import os
import re
import socket
import threading
from typing import Mapping, Optional

__all__ = ["ConfigError", "Settings", "VARIABLES", "attached", "from_env", "get", "reset"]

PUSH_DTYPES = ("f32", "bf16", "int8", "int4", "int4-log")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_ID_RE = re.compile(r"^[A-Za-z0-9._:@-]{1,64}$")

# (name, default as documented, one-line meaning); the docstring table above says the same at more length
VARIABLES = (
    ("YETO_DILOCO_SYNCER", "(unset)", "syncer address host:port; setting it attaches yeto-patch"),
    ("YETO_DILOCO_AUTO_ATTACH", "0", "1: attach even without a syncer address (start-up then fails clearly)"),
    ("YETO_DILOCO_DISABLE", "0", "1: stay inert"),
    ("YETO_DILOCO_KEY_FILE", "(unset)", "shared-secret file (mode 0600), read on island rank 0"),
    ("YETO_KEY", "(unset)", "shared secret itself, when no key file is set"),
    ("YETO_DILOCO_INSECURE", "0", "1: no key, loopback syncer only"),
    ("YETO_DILOCO_ISLAND_ID", "<MASTER_ADDR or host>:<MASTER_PORT>", "stable island name at the syncer"),
    ("YETO_DILOCO_SYNC_EVERY", "100", "H: optimizer steps between two boundaries of one fragment"),
    ("YETO_DILOCO_PUSH_DTYPE", "int4", "push wire dtype: " + ", ".join(PUSH_DTYPES)),
    ("YETO_DILOCO_BLOCK", "256", "quantization block size"),
    ("YETO_DILOCO_ERROR_FEEDBACK", "0", "1: carry quantization residuals into the next push"),
    ("YETO_DILOCO_START_DIGEST", "1", "1: skip downloading initial bases this island already holds"),
    ("YETO_DILOCO_OVERLAP_STEPS", "0", "tau: steps a base may trail its push (0 = synchronous)"),
    ("YETO_DILOCO_MERGE_ALPHA", "0.5", "alpha: installed = alpha*local + (1-alpha)*base when tau > 0"),
    ("YETO_DILOCO_CHUNK_BYTES", "64MiB", "gather/scatter chunk size"),
    ("YETO_DILOCO_SEND_QUEUE_BYTES", "1GiB", "encoded bytes queued for the background sender"),
    ("YETO_DILOCO_TOTAL_STEPS", "Megatron's train_iters", "step of the final cut"),
    ("YETO_DILOCO_VOCAB_SIZE", "tokenizer's, when known", "real (unpadded) vocabulary size"),
    ("YETO_DILOCO_TIMEOUT", "600", "seconds for any collective, socket or base wait"),
    ("YETO_DILOCO_METRICS", "(unset)", "JSONL path for per-boundary records ({island} expands)"),
    ("YETO_DILOCO_LOG_LEVEL", "INFO", "log level: " + ", ".join(LOG_LEVELS)),
)
_KNOWN = frozenset(v[0] for v in VARIABLES)


class ConfigError(ValueError):
    """A YETO_* variable has a value yeto-patch cannot use; the message names the variable."""


@dataclasses.dataclass(frozen=True)
class Settings:
    syncer: Optional[str]           # "host:port"
    syncer_host: Optional[str]
    syncer_port: Optional[int]
    key_file: Optional[str]
    key_from_env: bool              # YETO_KEY is set (used when key_file is None)
    insecure: bool
    island_id: str
    island_id_default: bool         # True when derived from MASTER_ADDR/MASTER_PORT
    sync_every: int                 # H
    push_dtype: str
    block: int
    error_feedback: bool
    start_digest: bool
    overlap_steps: int              # tau
    merge_alpha: float
    chunk_bytes: int
    send_queue_bytes: int
    total_steps: Optional[int]
    vocab_size: Optional[int]
    timeout: float
    metrics_path: Optional[str]
    log_level: str
    auto_attach: bool
    disable: bool

    @property
    def key_source(self) -> str:
        if self.key_file:
            return "file " + self.key_file
        if self.key_from_env:
            return "environment YETO_KEY"
        return "none (insecure, loopback)"

    def as_table(self) -> list:
        """(variable, resolved value) rows, for `yeto-patch doctor` and logs; the key itself is never shown."""
        total = self.total_steps if self.total_steps is not None else "(Megatron's train_iters)"
        vocab = self.vocab_size if self.vocab_size is not None else "(tokenizer's, when known)"
        return [
            ("YETO_DILOCO_SYNCER", self.syncer or "(unset)"),
            ("key", self.key_source),
            ("YETO_DILOCO_ISLAND_ID", self.island_id + ("  (default)" if self.island_id_default else "")),
            ("YETO_DILOCO_SYNC_EVERY", self.sync_every),
            ("YETO_DILOCO_PUSH_DTYPE", self.push_dtype),
            ("YETO_DILOCO_BLOCK", self.block),
            ("YETO_DILOCO_ERROR_FEEDBACK", int(self.error_feedback)),
            ("YETO_DILOCO_START_DIGEST", int(self.start_digest)),
            ("YETO_DILOCO_OVERLAP_STEPS", self.overlap_steps),
            ("YETO_DILOCO_MERGE_ALPHA", self.merge_alpha),
            ("YETO_DILOCO_CHUNK_BYTES", _fmt_bytes(self.chunk_bytes)),
            ("YETO_DILOCO_SEND_QUEUE_BYTES", _fmt_bytes(self.send_queue_bytes)),
            ("YETO_DILOCO_TOTAL_STEPS", total),
            ("YETO_DILOCO_VOCAB_SIZE", vocab),
            ("YETO_DILOCO_TIMEOUT", "%gs" % self.timeout),
            ("YETO_DILOCO_METRICS", self.metrics_path or "(unset)"),
            ("YETO_DILOCO_LOG_LEVEL", self.log_level),
        ]


def _truthy(v: Optional[str]) -> bool:
    return (v or "").strip().lower() in _TRUE


def attached(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether yeto-patch is configured to attach (the same rule sitecustomize applies)."""
    env = os.environ if env is None else env
    if _truthy(env.get("YETO_DILOCO_DISABLE")):
        return False
    return bool((env.get("YETO_DILOCO_SYNCER") or "").strip()) or _truthy(env.get("YETO_DILOCO_AUTO_ATTACH"))


# --------------------------------------------------------------------------------------------------- parsers
def _bool(env, name, default):
    raw = env.get(name)
    if raw is None:
        return default
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use 1/0 (also true/false, yes/no, on/off)")


def _int(env, name, default, lo, hi, what):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = int(raw.strip(), 10)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer: {what}, an integer in [{lo}, {hi}]") from None
    if not lo <= v <= hi:
        raise ConfigError(f"{name}={v} is out of range: {what}, an integer in [{lo}, {hi}]")
    return v


def _float(env, name, default, lo, hi, what):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        v = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number: {what}, a number in [{lo}, {hi}]") from None
    if not (lo <= v <= hi):  # also refuses nan
        raise ConfigError(f"{name}={raw.strip()} is out of range: {what}, a number in [{lo}, {hi}]")
    return v


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.I)


def _size(env, name, default, lo, hi, what):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
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


def _duration(env, name, default):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    m = re.match(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$", raw, re.I)
    v = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2).lower()] if m else None
    if v is None or not 1 <= v <= 7 * 86400:
        raise ConfigError(f"{name}={raw!r} is not a usable timeout: seconds between 1 and 604800, optionally "
                          f"with an s/m/h suffix (e.g. 600, 90s, 10m)")
    return v


def _choice(env, name, default, choices):
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    v = raw.strip()
    for c in choices:
        if v.lower() == c.lower():
            return c
    raise ConfigError(f"{name}={raw!r} is not accepted: use one of {', '.join(choices)}")


def _fmt_bytes(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return f"{n}B"


def _parse_address(raw: str):
    """'host:port' or '[v6]:port' -> (host, port); ConfigError naming YETO_DILOCO_SYNCER otherwise."""
    name = "YETO_DILOCO_SYNCER"
    parts = [p for p in re.split(r"[,\s;]+", raw.strip()) if p]
    if len(parts) > 1:
        raise ConfigError(f"{name}={raw!r} lists {len(parts)} addresses; sharded syncers are not supported yet: "
                          f"give exactly one host:port")
    addr = parts[0]
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", addr) or re.match(r"^([A-Za-z0-9._-]+):(\d+)$", addr)
    if not m:
        raise ConfigError(f"{name}={raw!r} is not an address: use host:port (or [ipv6]:port), e.g. "
                          f"syncer.example.org:7640")
    host, port = m.group(1), int(m.group(2))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{name}={raw!r}: port {port} is out of range 1-65535")
    return host, port


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


def from_env(env: Optional[Mapping[str, str]] = None) -> Settings:
    """Validate the YETO_* variables of `env` (default os.environ) into Settings; ConfigError on any bad value."""
    env = dict(os.environ if env is None else env)
    _check_unknown(env)
    disable = _bool(env, "YETO_DILOCO_DISABLE", False)
    auto_attach = _bool(env, "YETO_DILOCO_AUTO_ATTACH", False)
    raw_syncer = (env.get("YETO_DILOCO_SYNCER") or "").strip()
    host = port = None
    if raw_syncer:
        host, port = _parse_address(raw_syncer)
    elif not disable:
        raise ConfigError("YETO_DILOCO_SYNCER is not set: yeto-patch is attached (YETO_DILOCO_AUTO_ATTACH=1) and "
                          "needs the syncer address host:port (or set YETO_DILOCO_DISABLE=1 to train without it)")
    insecure = _bool(env, "YETO_DILOCO_INSECURE", False)
    key_file = (env.get("YETO_DILOCO_KEY_FILE") or "").strip() or None
    key_from_env = bool(env.get("YETO_KEY"))
    if host is not None and key_file is None and not key_from_env:
        if not insecure:
            raise ConfigError("YETO_DILOCO_KEY_FILE is not set (nor YETO_KEY): the syncer handshake needs the shared "
                              "key; set YETO_DILOCO_INSECURE=1 only for a loopback syncer in tests")
        if not _is_loopback(host):
            raise ConfigError(f"YETO_DILOCO_INSECURE=1 is only accepted with a loopback syncer address, not "
                              f"{host!r}: set YETO_DILOCO_KEY_FILE (or YETO_KEY)")
    raw_id = (env.get("YETO_DILOCO_ISLAND_ID") or "").strip()
    if raw_id:
        if not _ID_RE.match(raw_id):
            raise ConfigError(f"YETO_DILOCO_ISLAND_ID={raw_id!r} is not accepted: 1-64 characters of "
                              f"A-Z a-z 0-9 . _ : @ -")
        island_id, id_default = raw_id, False
    else:
        island_id, id_default = _default_island_id(env), True
    sync_every = _int(env, "YETO_DILOCO_SYNC_EVERY", 100, 1, 10**9, "H, optimizer steps between boundaries "
                      "of one fragment")
    overlap = _int(env, "YETO_DILOCO_OVERLAP_STEPS", 0, 0, 10**9, "tau, steps a merged base may trail its push")
    if overlap >= sync_every:
        raise ConfigError(f"YETO_DILOCO_OVERLAP_STEPS={overlap} must be smaller than YETO_DILOCO_SYNC_EVERY="
                          f"{sync_every}: a fragment's base must arrive before its next boundary")
    total = _int(env, "YETO_DILOCO_TOTAL_STEPS", None, 1, 10**12, "the step of the final cut")
    vocab = _int(env, "YETO_DILOCO_VOCAB_SIZE", None, 1, 10**9, "the real (unpadded) vocabulary size")
    metrics = (env.get("YETO_DILOCO_METRICS") or "").strip() or None
    if metrics is not None:
        metrics = metrics.replace("{island}", island_id)
        parent = os.path.dirname(os.path.abspath(metrics))
        if os.path.isdir(metrics):
            raise ConfigError(f"YETO_DILOCO_METRICS={metrics!r} is a directory: give a file path for the JSONL")
        if os.path.exists(parent) and not os.path.isdir(parent):
            raise ConfigError(f"YETO_DILOCO_METRICS={metrics!r}: {parent!r} is not a directory")
    return Settings(
        syncer=f"{host}:{port}" if host is not None and ":" not in host else
        (f"[{host}]:{port}" if host is not None else None),
        syncer_host=host, syncer_port=port, key_file=key_file, key_from_env=key_from_env, insecure=insecure,
        island_id=island_id, island_id_default=id_default, sync_every=sync_every,
        push_dtype=_choice(env, "YETO_DILOCO_PUSH_DTYPE", "int4", PUSH_DTYPES),
        block=_int(env, "YETO_DILOCO_BLOCK", 256, 8, 65536, "elements per quantization scale"),
        error_feedback=_bool(env, "YETO_DILOCO_ERROR_FEEDBACK", False),
        start_digest=_bool(env, "YETO_DILOCO_START_DIGEST", True),
        overlap_steps=overlap,
        merge_alpha=_float(env, "YETO_DILOCO_MERGE_ALPHA", 0.5, 0.0, 1.0, "weight of the local model when a base "
                           "is installed under overlap"),
        chunk_bytes=_size(env, "YETO_DILOCO_CHUNK_BYTES", 64 << 20, 64 << 10, 4 << 30, "gather chunk size"),
        send_queue_bytes=_size(env, "YETO_DILOCO_SEND_QUEUE_BYTES", 1 << 30, 1 << 20, 1 << 40,
                               "bytes queued for the background sender"),
        total_steps=total, vocab_size=vocab,
        timeout=_duration(env, "YETO_DILOCO_TIMEOUT", 600.0),
        metrics_path=metrics,
        log_level=_choice(env, "YETO_DILOCO_LOG_LEVEL", "INFO", LOG_LEVELS),
        auto_attach=auto_attach, disable=disable,
    )


_lock = threading.Lock()
_cached: Optional[Settings] = None
_cached_error: Optional[ConfigError] = None


def get() -> Settings:
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

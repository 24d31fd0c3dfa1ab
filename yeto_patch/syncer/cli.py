"""``yeto-syncer``: the process every island talks to.

    yeto-syncer --listen 0.0.0.0:7640 --islands 4 --fragments 8 --key-file /secrets/yeto.key \\
                --checkpoint /ckpt/syncer.bin

Exit status: 0 after the final cut (final model sent, acknowledgements awaited, final checkpoint written),
1 on a failure, 2 on bad arguments, 130 on Ctrl-C (the last checkpoint stays).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from typing import Optional

from ..wire import auth, codec_names
from ..wire.frames import AuthError
from .model.checkpoint import CheckpointError
from .model.outer import AUTO_LR, OUTER_KINDS
from .rounds.settings import WEIGHTINGS, MergeSettings, RoundSettings

__all__ = ["build_parser", "main", "config_from_args"]


def _pos_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _outer_lr(s: str):
    return AUTO_LR if s.strip().lower() == AUTO_LR else _pos_float(s)


def _pos_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
    return v


def _growth(s: str) -> float:
    v = float(s)
    if not (v >= 1 or v == 0):
        raise argparse.ArgumentTypeError(f"must be >= 1 (0: no bound), got {s}")
    return v


def _initializer(s: str) -> str:
    from .model.initializer import policy_arg
    try:
        return policy_arg(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _base_wire(s: str) -> str:
    name = codec_names.canonical_base_wire(s)
    if name is None:
        raise argparse.ArgumentTypeError(f"{s!r}: use {codec_names.describe_base_wire()}")
    return name


def _nonneg_float(s: str) -> float:
    v = float(s)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {s}")
    return v


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" unless the help already states its default in words."""

    def _get_help_string(self, action):
        h = action.help or ""
        return h if "(default" in h else super()._get_help_string(action)


def _shard_spec(s: str):
    from .shards.launch import TORCHRUN
    from .shards.spec import parse_shard
    if s.strip() == TORCHRUN:
        return TORCHRUN
    try:
        return parse_shard(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _addresses(s: str) -> tuple:
    out = tuple(a for a in s.replace(";", ",").split(",") if a.strip())
    for a in out:
        host, sep, port = a.strip().rpartition(":")
        if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(f"{a!r} is not host:port")
    return tuple(a.strip() for a in out)


def _shard_flags(g) -> None:
    g.add_argument("--shard", type=_shard_spec, default=None, metavar="I/N|torchrun", help="run shard I of N: "
                   "this process owns a deterministic, byte-balanced subset of the fragments (the same on every "
                   "shard for the same manifest and --fragments) and holds state, rounds, checkpoint, metrics and "
                   "tape for those only. `torchrun`: one torchrun job of N processes, RANK/WORLD_SIZE give I/N, "
                   "each listens on the --listen port plus LOCAL_RANK and the shards exchange their addresses "
                   "through torchrun's store. {shard} in --checkpoint, --tape and --log is replaced by I "
                   "(default: 0/1, one syncer for the whole model)")
    g.add_argument("--advertise-host", default=None, help="with --shard torchrun: the host name islands reach "
                   "this shard at (default: the --listen host, or this machine's name when listening on a "
                   "wildcard address)")
    g.add_argument("--shard-addresses", type=_addresses, default=None, metavar="HOST:PORT,...", help="every shard's "
                   "address as islands reach it, in shard order; told to islands in the welcome, so an island "
                   "given only shard 0's address in YETO_DILOCO_SYNCER finds the others (default: none; islands "
                   "then list every shard themselves)")
    g.add_argument("--run-id", default=None, help="a name for the run, stored in every checkpoint; --resume refuses "
                   "a checkpoint of another run id (default: none, or the resumed checkpoint's)")


def _run_flags(g) -> None:
    g.add_argument("--listen", default="0.0.0.0:7640", help="host:port to listen on")
    g.add_argument("--islands", type=_pos_int, default=1, help="number of islands in the run (the most that may "
                   "be members at once; the default quorum)")
    g.add_argument("--fragments", type=_pos_int, default=1, help="number of fragments the model is split into")
    g.add_argument("--key-file", default=None, help="shared key file (chmod 600) (default: the YETO_KEY "
                   "environment variable)")
    g.add_argument("--insecure", action="store_true", help="run without a key (allowed only on a loopback "
                   "address)")
    g.add_argument("--island-keys", default=None, metavar="DIR", help="per-island keys: one file <island id>.key "
                   "(chmod 600) per island; such an id can only be claimed with its own key, other ids need the "
                   "shared key (default: none, every island uses the shared key)")
    g.add_argument("--encrypt", action="store_true",
                   default=os.environ.get("YETO_ENCRYPT", "").strip().lower() in ("1", "true", "yes", "on"),
                   help="encrypt every frame after the handshake (AES-256-GCM) instead of only authenticating it "
                   "(default: the YETO_ENCRYPT environment variable, else off; needs a key)")
    g.add_argument("--total-rounds", type=_pos_int, default=None, help="end the run (final cut) once every "
                   "fragment merged this many rounds (default: none; the run ends when every island reports its last "
                   "step)")


def _grace(s: str):
    return None if s.strip().lower() == "auto" else _nonneg_float(s)


def _round_flags(g) -> None:
    g.add_argument("--quorum", type=_pos_int, default=None, help="K: the fewest pushes a round merges with; K = "
                   "--islands is a fixed roster (every island that joined and has not finished is waited for, even "
                   "one that is down). Default: elastic rounds, which wait only for islands that are up and merge "
                   "once 2 islands (1 with --islands 2 or less), or all that are up when fewer are, answered "
                   "(docs/operations.md)")
    g.add_argument("--grace", type=_grace, default="auto", help="seconds to wait for the remaining islands once "
                   "the quorum is reached, or auto: the pace window, which waits for a missing island only when its "
                   "own pace (its step and rate from its heartbeats, its steps between pushes) brings its push "
                   "before the answers' patience (their upper median) runs out (docs/protocol.md, Rounds)")
    g.add_argument("--round-timeout", type=_pos_float, default=600.0, help="seconds after a round's first push "
                   "after which it merges with the answers it has (a fixed roster below its quorum keeps waiting "
                   "and logs it)")
    g.add_argument("--lease", type=_pos_float, default=60.0, help="seconds an island may stay silent before it "
                   "leaves the expected set of open rounds (islands send heartbeats every lease/4)")
    g.add_argument("--max-base-lag", type=_nonneg_int, default=4, help="a push relative to a base at most this "
                   "many versions old is carried into the next round (weight x --late-factor per version); older "
                   "ones are refused (the island pulls)")
    g.add_argument("--late-factor", type=float, default=0.5, help="weight factor per version of lag for a late "
                   "push carried into the next round")
    g.add_argument("--weights", choices=WEIGHTINGS, default="tokens", help="weight of each island's delta: tokens "
                   "(steps x the island's tokens per step, fixed by its first merged push), steps, or equal; steps "
                   "are checked against the island's step counter and an island weighs at most 2x the low median "
                   "of the other islands' checked weights in a merge, its carried pushes included (docs/protocol.md, "
                   "Pushes)")
    g.add_argument("--exact", action="store_true", help="hold pushes (encoded) and fold them in island order at "
                   "merge time: bit-reproducible whatever the arrival order (more memory)")
    g.add_argument("--max-push-norm-ratio", type=_nonneg_float, default=10.0, help="refuse (code outlier) a push "
                   "whose delta norm, or the rms of its densest quantization block, is above this many times the "
                   "lower median of the OTHER islands' recent accepted pushes of the fragment (each island's median); "
                   "0 disables the guard")
    g.add_argument("--first-push-growth", type=_growth, default=2.0, help="before any other island's push of a "
                   "fragment was accepted (nothing to compare with), refuse a push that, applied alone, would leave "
                   "the base with more than this many times its norm (as first seen); 0: no bound then")


def _outer_flags(g) -> None:
    g.add_argument("--outer", choices=OUTER_KINDS, default="nesterov", help="outer optimizer")
    g.add_argument("--outer-lr", type=_outer_lr, default=AUTO_LR, help="outer learning rate, or auto: for "
                   "nesterov each merge takes 0.7 when its islands blend bases in (tau > 0), 1.0 if they also "
                   "started from pretrained weights (a fine-tune: their pushes say so), else 0.4 when its pushes "
                   "cover <= 10 inner steps (H), 0.7 from 50, linear between (measured, docs/convergence.md); 1.0 "
                   "for avg")
    g.add_argument("--outer-momentum", type=_nonneg_float, default=None, help="outer momentum (default: 0.9; 0 for "
                   "avg)")
    g.add_argument("--delay", type=_pos_int, default=1, help="delayed-nesterov: apply momentum every N rounds")
    g.add_argument("--merge-threads", type=_pos_int, default=None, help="threads for decoding and merging"
                   "; results are bit-identical for any count (default: the CPU count, at most 32)")


def _transfer_flags(g) -> None:
    g.add_argument("--base-wire", type=_base_wire, default="f32", metavar="DTYPE", help="how merged bases "
                   "go out after each merge: f32, bf16, or int8/int4/topk:F+intB: the encoded change from the base "
                   "the island holds, with what was not sent carried into the next update (islands hold exactly "
                   "the syncer's shadow base; 4x/8x fewer bytes than f32, topk:0.05+int2 about 49x). The initial, "
                   "rejoin and final bases, and any base to an island that missed the previous one, are always f32")
    g.add_argument("--io-timeout", type=_pos_float, default=120.0, help="seconds a socket operation may stall "
                   "before the connection is dropped; also how long a due merge lets a base of its fragment still "
                   "streaming to a slow island finish before it waits for it")
    g.add_argument("--max-handshakes", type=_pos_int, default=64, help="connections still in their handshake held "
                   "at once; more are closed at once (bounds what strangers can make the syncer hold)")
    g.add_argument("--max-handshakes-per-host", type=_pos_int, default=16, help="the same limit per peer address")
    g.add_argument("--max-model-bytes", type=_nonneg_int, default=0, help="largest float32 model size (bytes) a "
                   "first manifest may fix; larger ones are refused at its MANIFEST (default: 0, a quarter of the "
                   "physical memory)")
    g.add_argument("--island-buffer-bytes", type=_nonneg_int, default=0, help="bytes of unfinished chunked "
                   "messages one island connection may hold; all islands together hold at most --islands times "
                   "this (default: 0, one fragment in its largest push encoding plus 2 MiB)")
    g.add_argument("--init-timeout", type=_pos_float, default=None, help="seconds the initializing island may "
                   "go without completing a fragment's INIT before its claim is dropped and another island is "
                   "asked (default: --lease plus --io-timeout)")
    g.add_argument("--initializer", type=_initializer, default="lowest-id", metavar="lowest-id|first|ISLAND",
                   help="whose INIT is the run's start: lowest-id: the lowest island id once all --islands joined "
                   "(or --init-wait after the first join), islands wait for each other at start; first: the first "
                   "to join (no wait; the start depends on who connects first); or an island id. An island with "
                   "YETO_DILOCO_INITIALIZER=1 (a fine-tune's pretrained weights) is taken as soon as it joins "
                   "(docs/operations.md, 'Who initializes')")
    g.add_argument("--init-wait", type=_pos_float, default=300.0, help="seconds lowest-id waits after the first "
                   "island joined for the rest of the roster before it takes the lowest id of those present; also "
                   "how long after a declared initializer left another island may initialize, and after the first "
                   "join FINALs may end a run whose roster never completed")
    g.add_argument("--init-lowest-id", action="store_true", help="the same as --initializer lowest-id (the default "
                   "now; kept for existing command lines)")
    g.add_argument("--final-ack-timeout", type=_pos_float, default=60.0, help="seconds to wait for the islands' "
                   "acknowledgements of the final model")


def _checkpoint_flags(g) -> None:
    g.add_argument("--checkpoint", default=None, help="checkpoint file, written atomically (default: none, "
                   "no checkpoints)")
    g.add_argument("--checkpoint-every", type=_nonneg_int, default=0, help="write a checkpoint every N merges "
                   "(0: only at the end)")
    g.add_argument("--background-checkpoint", action="store_true", help="write periodic checkpoints on a "
                   "background thread from a snapshot (merging goes on; one write at a time)")
    g.add_argument("--resume", action="store_true", help="continue the run stored in --checkpoint")


def _observability_flags(g) -> None:
    g.add_argument("--metrics-port", type=_nonneg_int, default=None, help="serve Prometheus metrics on this "
                   "port, 0 for any free port (default: none, no metrics server)")
    g.add_argument("--metrics-addr", default="127.0.0.1", help="address for the metrics server: loopback by "
                   "default (scrape from the syncer's host, or pass 0.0.0.0 / a private address to expose it); one "
                   "thread serves it, at most 16 connections, each closed after 5 s")
    g.add_argument("--log", default=None, help="also append the log to this file (default: none, "
                   "stderr only)")
    g.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="verbosity of the log")
    g.add_argument("--tape", default=None, help="append one JSON record per merge to this JSONL file "
                   "(default: none)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="yeto-syncer", formatter_class=_Formatter,
        description="DiLoCo syncer: merges the islands' fragment deltas with an outer optimizer and sends "
                    "back the new bases. Semantics: docs/protocol.md, section 'Syncer protocol'.")
    _run_flags(p.add_argument_group("run"))
    _round_flags(p.add_argument_group("rounds"))
    _outer_flags(p.add_argument_group("outer optimizer"))
    _transfer_flags(p.add_argument_group("transfer"))
    _shard_flags(p.add_argument_group("shards (docs/operations.md, 'Sharded syncer')"))
    _checkpoint_flags(p.add_argument_group("checkpoints"))
    _observability_flags(p.add_argument_group("observability"))
    return p


def config_from_args(a: argparse.Namespace):
    from .net.server import ServerConfig

    if not hasattr(a, "torchrun"):
        resolve_shard(a)
    island_keys = auth.load_island_keys(a.island_keys) if a.island_keys else None
    key = auth.load_key(a.key_file) if (a.key_file or not a.insecure) else None
    if key is None and not island_keys:
        auth.check_insecure(a.listen, a.insecure)
    if a.encrypt and key is None and not island_keys:
        raise ValueError("--encrypt needs a key (--key-file or YETO_KEY)")
    if a.resume and not a.checkpoint:
        raise ValueError("--resume needs --checkpoint")
    if a.background_checkpoint and not a.checkpoint:
        raise ValueError("--background-checkpoint needs --checkpoint")
    if a.quorum is not None and a.quorum > a.islands:
        raise ValueError(f"--quorum {a.quorum} is larger than --islands {a.islands}")
    if not 0.0 <= a.late_factor <= 1.0:
        raise ValueError(f"--late-factor must be in [0, 1], got {a.late_factor}")
    shard = _checked_shard(a)
    ms = MergeSettings(outer=a.outer, lr=a.outer_lr, momentum=a.outer_momentum, delay=a.delay, weights=a.weights,
                       max_base_lag=a.max_base_lag, late_factor=a.late_factor, exact=a.exact)
    ms.optimizer()  # validates
    rs = RoundSettings(islands=a.islands, quorum=a.quorum, grace_s=a.grace, timeout_s=a.round_timeout,
                       lease_s=a.lease, total_rounds=a.total_rounds)
    return ServerConfig(listen=a.listen, islands=a.islands, fragments=a.fragments, key=key, insecure=a.insecure,
                        encrypt=a.encrypt, island_keys=island_keys,
                        merge=ms, rounds=rs, base_wire=a.base_wire, checkpoint=a.checkpoint,
                        checkpoint_every=a.checkpoint_every, background_checkpoint=a.background_checkpoint,
                        resume=a.resume, metrics_port=a.metrics_port, metrics_addr=a.metrics_addr, tape=a.tape,
                        merge_threads=a.merge_threads, io_timeout_s=a.io_timeout,
                        final_ack_timeout_s=a.final_ack_timeout, max_handshakes=a.max_handshakes,
                        max_handshakes_per_host=a.max_handshakes_per_host, max_model_bytes=a.max_model_bytes,
                        island_buffer_bytes=a.island_buffer_bytes, init_timeout_s=a.init_timeout,
                        initializer="lowest-id" if a.init_lowest_id else a.initializer, init_wait_s=a.init_wait,
                        max_push_norm_ratio=a.max_push_norm_ratio, first_push_growth=a.first_push_growth,
                        shard=shard,
                        shard_addresses=tuple(a.shard_addresses or ()), run_id=a.run_id)


def _checked_shard(a):
    from .shards.spec import ShardSpec
    shard = a.shard or ShardSpec()
    if a.advertise_host and not getattr(a, "torchrun", False):
        raise ValueError("--advertise-host is for --shard torchrun (plain shards: --shard-addresses)")
    if shard.count > a.fragments:
        raise ValueError(f"--shard {shard}: {shard.count} shards need at least {shard.count} fragments "
                         f"(--fragments {a.fragments})")
    if a.shard_addresses and len(a.shard_addresses) != shard.count:
        raise ValueError(f"--shard-addresses lists {len(a.shard_addresses)} addresses for {shard.count} shards")
    if a.run_id is not None and not (0 < len(a.run_id) <= 128 and a.run_id.isprintable()):
        raise ValueError("--run-id must be 1-128 printable characters")
    return shard


class _StreamHandler(logging.StreamHandler):
    """The syncer's own stderr handler (its type tells a second main() which handlers to replace)."""


class _FileHandler(logging.FileHandler):
    """The syncer's own --log file handler."""


LOG_HANDLERS = (_StreamHandler, _FileHandler)   # the types of the handlers the syncer adds to the root logger


def _setup_logging(level: str, path: Optional[str]) -> None:
    fmt = logging.Formatter("%(asctime)s yeto-syncer %(levelname)s %(message)s")
    root = logging.getLogger("yeto")
    root.setLevel(level)
    for h in [h for h in root.handlers if isinstance(h, LOG_HANDLERS)]:  # main() called again
        root.removeHandler(h)
        h.close()
    h = _StreamHandler(sys.stderr)
    h.setFormatter(fmt)
    root.addHandler(h)
    if path:
        fh = _FileHandler(path)
        fh.setFormatter(fmt)
        root.addHandler(fh)


def resolve_shard(a: argparse.Namespace) -> None:
    """In place: --shard torchrun -> this process's I/N, listen and metrics ports offset by LOCAL_RANK; {shard}
    in the file flags replaced by I (syncer/shards/launch.py)."""
    from .shards import launch as SL
    a.torchrun, local = a.shard == SL.TORCHRUN, 0
    if a.torchrun:
        a.shard, local = SL.torchrun_shard()
        a.listen = SL.with_port_offset(a.listen, local)
        if a.metrics_port:
            a.metrics_port += local
    spec = a.shard
    if spec is not None:
        a.checkpoint, a.tape, a.log = (SL.shard_path(x, spec) for x in (a.checkpoint, a.tape, a.log))


def exchange_shard_addresses(a: argparse.Namespace) -> None:
    """--shard torchrun: every shard's address from torchrun's store (shard order); the run id is torchrun's."""
    from .shards import launch as SL
    if not a.torchrun or a.shard_addresses:
        return
    port = a.listen.rpartition(":")[2]
    host = SL.advertised_host(a.listen, a.advertise_host)
    a.shard_addresses = SL.exchange_addresses(a.shard, f"{host}:{port}")
    if a.run_id is None:
        a.run_id = os.environ.get("TORCHELASTIC_RUN_ID") or None


def main(argv: Optional[list] = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        resolve_shard(a)
    except ValueError as e:
        print(f"yeto-syncer: error: {e}", file=sys.stderr)
        return 2
    _setup_logging(a.log_level, a.log)
    log = logging.getLogger("yeto.syncer")
    from .model import outer_jit
    from .net.server import SyncerServer

    try:
        cfg = config_from_args(a)
        exchange_shard_addresses(a)
        cfg.shard_addresses, cfg.run_id = tuple(a.shard_addresses or ()), a.run_id
        server = SyncerServer(cfg)
        outer_jit.warm()   # (before it listens: its first merge must not wait for numba's compilation)
        host, port = server.start()
    except (ValueError, AuthError, CheckpointError, OSError, RuntimeError) as e:
        print(f"yeto-syncer: error: {e}", file=sys.stderr)
        return 2
    stopped = threading.Event()

    def on_signal(signum, frame):
        log.warning("signal %d: stopping (no final cut; the last checkpoint stays)", signum)
        stopped.set()
        threading.Thread(target=server.stop, kwargs={"checkpoint": True}, daemon=True).start()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
    print(f"yeto-syncer listening on {host}:{port}", flush=True)
    if cfg.metrics_port is not None:
        print(f"yeto-syncer metrics on http://{cfg.metrics_addr}:{server.metrics_port}/metrics", flush=True)
    while server.wait(0.5) is None:
        if stopped.is_set():
            break
    server.wait(None if stopped.is_set() else 10)
    if stopped.is_set():
        return 130 if server.exit_code in (0, None) else 1
    return server.exit_code if server.exit_code is not None else 1


if __name__ == "__main__":
    sys.exit(main())

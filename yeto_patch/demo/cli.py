"""Command line of ``yeto-patch demo``."""
import argparse
import signal
import sys

from yeto_patch.wire import codec_names

DESCRIPTION = """\
Run DiLoCo through yeto-patch on this machine: a local syncer and islands of a small real megatron-core GPT
(default: one TP2 and one PP2 island, bf16, DistributedOptimizer, 2 ranks each), each launched with torchrun
exactly as a user launches Megatron (examples/train_gpt.py is an ordinary megatron-core script; PYTHONPATH and
YETO_* variables attach yeto-patch). Each island trains on its own shard of byte-level text (default: the Python standard
library's sources). At the end: held-out loss of the final global model against synchronous data parallel on
the same tokens, bytes that crossed between islands against per-step gradient all-reduce, wall time, a plot and
the raw JSONL in --out."""

SHORT = dict(steps=60, hidden=64, layers=2, heads=4, seq_length=64, batch=8, micro_batch=4, sync_every=20,
             overlap_steps=2, eval_interval=20, eval_seqs=16, warmup=10)


def build_parser():
    p = argparse.ArgumentParser(prog="yeto-patch demo", description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=300, help="optimizer steps per island (and for the baseline)")
    g.add_argument("--islands", type=int, default=2)
    g.add_argument("--layouts", default="tp2,pp2",
                   help="comma-separated island layouts (tpN, ppN, dpN, combined like tp2pp2), cycled over islands")
    g.add_argument("--short", action="store_true",
                   help="a 1-2 minute setting (CI): " + ", ".join(f"{k}={v}" for k, v in SHORT.items()))
    g.add_argument("--out", default="demo-out", help="output folder (JSONL, logs, plot, summary)")
    g.add_argument("--timeout", type=float, default=3600, help="seconds before the demo gives up")
    g.add_argument("--without-yeto", action="store_true",
                   help="train the islands independently without yeto-patch (for comparison)")
    g = p.add_argument_group("model and inner training (same for islands and baseline)")
    g.add_argument("--hidden", type=int, default=128)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--batch", type=int, default=8, help="sequences per step per island")
    g.add_argument("--micro-batch", type=int, default=4)
    g.add_argument("--lr", type=float, default=3e-3, help="inner (AdamW) peak learning rate, cosine to lr/10")
    g.add_argument("--warmup", type=int, default=20)
    g.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--text", default=None, help="text file or folder (default: Python's standard library)")
    g.add_argument("--eval-interval", type=int, default=50)
    g.add_argument("--eval-seqs", type=int, default=64, help="held-out sequences per evaluation")
    g = p.add_argument_group("DiLoCo (YETO_* variables of the islands, flags of the syncer)")
    g.add_argument("--sync-every", "-H", type=int, default=50, help="H: steps between boundaries of a fragment")
    g.add_argument("--fragments", type=int, default=2, help="streaming fragments (take turns within H)")
    g.add_argument("--push-dtype", default="int4", type=_push_dtype, metavar="DTYPE",
                   help=f"YETO_DILOCO_PUSH_DTYPE: {codec_names.describe()}")
    g.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--overlap-steps", "--tau", type=int, default=5, help="tau: steps a merged base may trail")
    g.add_argument("--merge-alpha", type=float, default=0.5)
    g.add_argument("--outer-lr", type=float, default=0.7)
    g.add_argument("--outer-momentum", type=float, default=0.9)
    g.add_argument("--base-wire", type=base_wire_type, default="int4", metavar="DTYPE",
                   help="how the syncer sends merged bases (the syncer's --base-wire): int4/int8/topk:F+intB send "
                        "the encoded change with error feedback (8x/4x/more fewer bytes than f32); the final model "
                        "is always f32")
    g.add_argument("--sync-timeout", type=float, default=300, help="YETO_DILOCO_TIMEOUT of the islands")
    g.add_argument("--syncer-arg", action="append", default=[], help="extra flag for the syncer (repeatable)")
    g.add_argument("--island-env", action="append", default=[], help="extra NAME=VALUE for the islands")
    g.add_argument("--start-gate", action=argparse.BooleanOptionalAction, default=True,
                   help="hold the islands' first connections until every island connected, so they join the "
                        "syncer together")
    g.add_argument("--port", type=int, default=0, help="syncer port (default 0: any free one; shard I of "
                   "--syncer-shards: port + I)")
    g.add_argument("--syncer-shards", type=int, default=1, help="run the syncer as this many shards (--shard I/N), "
                   "each holding a byte-balanced share of the fragments; at most --fragments")
    g = p.add_argument_group("baseline")
    g.add_argument("--no-baseline", action="store_true", help="skip the synchronous data-parallel baseline")
    g.add_argument("--rebaseline", action="store_true", help="retrain the baseline even if cached")
    g.add_argument("--baseline-layout", default="dp2")
    g.add_argument("--cache-dir", default=None, help="baseline cache (default ~/.cache/yeto-patch/demo-baseline)")
    g.add_argument("--sync-warmup", type=int, default=0, metavar="K",
                   help="synchronous warm-up: the islands start DiLoCo from the baseline's training state after its "
                        "step K (weights, FP32 masters, Adam state, LR schedule position) and train steps "
                        "K+1..--steps, so the tokens stay equal to the baseline's; the K synchronous steps' "
                        "all-reduce bytes count in the bytes ratio")
    g = p.add_argument_group("checkpoints and island failures")
    g.add_argument("--save-interval", type=int, default=0, metavar="N",
                   help="every island writes a checkpoint every N steps into <out>/island-<id>.ckpt (with "
                        "yeto-patch's sync state beside it) and is launched with --load of it (0: no checkpoints)")
    g.add_argument("--kill", action="append", default=[], metavar="K:STEP:SECONDS",
                   help="kill island K (0-based) hard (SIGKILL to every process of it) once it logged step STEP, "
                        "and launch it again SECONDS later from its latest checkpoint (needs --save-interval; "
                        "one per island)")
    g = p.add_argument_group("misc")
    g.add_argument("--python", default=None, help="interpreter for the child processes (default: this one)")
    g.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")
    return p


def parse(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.short:  # the short preset replaces the defaults; flags given explicitly still win
        p.set_defaults(**SHORT)
        a = p.parse_args(argv)
    if a.islands < 1:
        p.error("--islands must be >= 1")
    from .layout import parse_layouts
    for flag, text, n in (("--layouts", a.layouts, a.islands), ("--baseline-layout", a.baseline_layout, 1)):
        try:
            parse_layouts(text, n)
        except ValueError as err:
            p.error(f"{flag}: {err}")
    if not 0 <= a.sync_warmup < a.steps:
        p.error("--sync-warmup must be in 0..--steps - 1")
    if a.sync_warmup and a.no_baseline:
        p.error("--sync-warmup starts from the baseline's model: it cannot go with --no-baseline")
    if a.overlap_steps >= a.sync_every:
        p.error("--overlap-steps must be smaller than --sync-every")
    if a.save_interval < 0:
        p.error("--save-interval must be >= 0")
    from .kills import parse_kills
    try:
        a.kill_events = parse_kills(a.kill, a.islands, a.steps, a.save_interval, a.sync_warmup)
    except ValueError as err:
        p.error(str(err))
    if a.kill_events and a.without_yeto:
        p.error("--kill shows an island coming back into DiLoCo: it cannot go with --without-yeto")
    if not 1 <= a.syncer_shards <= a.fragments:
        p.error(f"--syncer-shards must be in 1..--fragments ({a.fragments}): every shard owns a fragment")
    return a


def main(argv=None):
    a = parse(argv)
    from .run import DemoError, run

    def _term(signum, frame):
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, _term)
    try:
        res = run(a)
    except DemoError as err:
        print(f"\nyeto-patch demo FAILED: {err}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nyeto-patch demo interrupted: every process it started has been stopped", file=sys.stderr,
              flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, old)
    if not a.without_yeto and res.get("islands_identical") is False:
        print("yeto-patch demo: the islands did not end with the same model", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())


def base_wire_type(text: str) -> str:
    """argparse type of a --base-wire value (the demo's and the benchmarks')."""
    name = codec_names.canonical_base_wire(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"{text!r}: use {codec_names.describe_base_wire()}")
    return name


def _push_dtype(text: str) -> str:
    name = codec_names.canonical(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"{text!r}: use {codec_names.describe()}")
    return name

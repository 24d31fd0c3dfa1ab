"""The demo's orchestration: a syncer, N islands launched like any Megatron job, a baseline, a report; with
``--kill``, an island killed hard and launched again from its checkpoints (kills.py)."""
import json
import os
import re
import secrets
import shutil
import sys
import tempfile
import time
import types

from . import baseline as bl
from .layout import parse_layouts
from .link import LinkGroup, MeteredLink
from .kills import Killer
from .procs import ChildFailed, Supervisor
from .progress import Progress
from .report import build_report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO, "examples")
TRAIN_SCRIPT = os.path.join(EXAMPLES, "train_gpt.py")
VOCAB = 256


class DemoError(RuntimeError):
    pass


def _launcher(python, nproc):
    """How a user launches a Megatron script: torchrun (the one installed next to this Python)."""
    torchrun = os.path.join(os.path.dirname(python), "torchrun")
    head = [torchrun] if os.path.exists(torchrun) else [python, "-m", "torch.distributed.run"]
    return head + ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nproc)]


def model_flags(o):
    """The flags that define the model and the training recipe (identical for islands and baseline)."""
    f = ["--num-layers", o.layers, "--hidden-size", o.hidden, "--num-attention-heads", o.heads,
         "--seq-length", o.seq_length, "--micro-batch-size", o.micro_batch, "--train-iters", o.steps,
         "--lr", o.lr, "--min-lr", o.lr / 10, "--lr-warmup-iters", o.warmup, "--seed", o.seed,
         "--num-shards", o.islands, "--eval-interval", o.eval_interval, "--eval-seqs", o.eval_seqs,
         "--log-interval", 0]
    if o.text:
        f += ["--text", os.path.abspath(o.text)]
    if o.fp32:
        f += ["--fp32"]
    return [str(x) for x in f]


def _clean_env(extra_pythonpath=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("YETO_")}
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONWARNINGS"] = "ignore"
    pp = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != REPO]
    if extra_pythonpath:
        pp.insert(0, extra_pythonpath)
    if pp:
        env["PYTHONPATH"] = os.pathsep.join(pp)
    else:
        env.pop("PYTHONPATH", None)
    return env


def write_key(dirname):
    path = os.path.join(dirname, "yeto.key")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def syncer_argv(o, python, port, key_file, out, shard=0, shards=1):
    """One syncer, or shard `shard` of `shards` (its own checkpoint; every shard appends to the one tape)."""
    ckpt = "syncer.ckpt" if shards == 1 else f"syncer-{shard}.ckpt"
    return [python, "-m", "yeto_patch.syncer", "--listen", f"127.0.0.1:{port}", "--islands", str(o.islands),
            "--fragments", str(o.fragments), "--key-file", key_file,
            "--checkpoint", os.path.join(out, ckpt), "--tape", os.path.join(out, "syncer-tape.jsonl"),
            "--outer-lr", str(o.outer_lr), "--outer-momentum", str(o.outer_momentum),
            "--base-wire", o.base_wire, *(["--shard", f"{shard}/{shards}"] if shards > 1 else [])] + list(o.syncer_arg)


def start_syncers(sup, o, python, key_file, out):
    """The syncer (or --syncer-shards shards), each behind a metered link that counts the bytes both ways, gated
    so that the islands join together; (processes, links as one)."""
    n = getattr(o, "syncer_shards", 1)
    procs, links = [], []
    for i in range(n):
        p = sup.start("syncer" if n == 1 else f"syncer-{i}",
                      syncer_argv(o, python, o.port + i if o.port else 0, key_file, out, i, n),
                      env=_clean_env(extra_pythonpath=REPO), cwd=REPO)
        procs.append(p)
        links.append(MeteredLink("127.0.0.1", wait_for_syncer(sup, p), gate=o.islands if o.start_gate else 0))
    return procs, LinkGroup(links)


_LISTENING = re.compile(r"yeto-syncer listening on (\S+):(\d+)")


def wait_for_syncer(sup, syncer, timeout_s=60):
    """The port the syncer bound (it is started on port 0 unless --port is given), read from its log."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        sup.check()
        if syncer.poll() is not None:
            raise DemoError(f"the syncer exited before listening; log: {syncer.log_path}\n{syncer.excerpt()}")
        m = _LISTENING.search(syncer.log_text())
        if m:
            return int(m.group(2))
        time.sleep(0.1)
    raise DemoError(f"the syncer did not report its address within {timeout_s}s; log: {syncer.log_path}")


def island_env(o, island_id, syncer, key_file, out):
    env = _clean_env(extra_pythonpath=REPO)
    env.update({
        "YETO_DILOCO_SYNCER": syncer,
        "YETO_DILOCO_KEY_FILE": key_file,
        "YETO_DILOCO_ISLAND_ID": island_id,
        "YETO_DILOCO_SYNC_EVERY": str(o.sync_every),
        "YETO_DILOCO_PUSH_DTYPE": o.push_dtype,
        "YETO_DILOCO_ERROR_FEEDBACK": "1" if o.error_feedback else "0",
        "YETO_DILOCO_OVERLAP_STEPS": str(o.overlap_steps),
        "YETO_DILOCO_MERGE_ALPHA": str(o.merge_alpha),
        "YETO_DILOCO_TOTAL_STEPS": str(o.steps - getattr(o, "sync_warmup", 0)),  # the islands' own steps
        "YETO_DILOCO_VOCAB_SIZE": str(VOCAB),
        "YETO_DILOCO_TIMEOUT": str(o.sync_timeout),
        "YETO_DILOCO_METRICS": os.path.join(out, f"island-{island_id}.boundaries.jsonl"),
    })
    for kv in o.island_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def corpus_description(o):
    sys.path.insert(0, EXAMPLES)
    try:
        import byte_corpus
    finally:
        sys.path.remove(EXAMPLES)
    return byte_corpus.ByteCorpus(o.text, num_shards=o.islands).describe()


def _fresh_out(path) -> str:
    """The output folder, emptied of what an earlier demo wrote (never of anything else)."""
    out = os.path.abspath(path)
    if os.path.exists(out):
        for name in os.listdir(out):
            if name.startswith(("island-", "baseline", "syncer", "losses.", "result.", "summary.")) or name == "logs":
                p = os.path.join(out, name)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    os.makedirs(out, exist_ok=True)
    return out


def _checked_layouts(o) -> list:
    """--layouts, checked against the batch, the layers and the heads."""
    layouts = parse_layouts(o.layouts, o.islands)
    if o.batch % o.micro_batch:
        raise DemoError(f"--batch {o.batch} must be a multiple of --micro-batch {o.micro_batch}")
    for lay in layouts:
        if o.batch % (lay.dp * o.micro_batch):
            raise DemoError(f"layout {lay.name}: --batch {o.batch} is not divisible by dp {lay.dp} x micro-batch")
        if o.layers % lay.pp:
            raise DemoError(f"layout {lay.name}: --layers {o.layers} is not divisible by pp {lay.pp}")
        if o.heads % lay.tp:
            raise DemoError(f"layout {lay.name}: --heads {o.heads} is not divisible by tp {lay.tp}")
    return layouts


def _announce(say, o, ids, corpus, out) -> None:
    say(f"yeto-patch demo: {o.islands} islands ({', '.join(ids)}) x {o.steps} steps, "
        f"{'DiLoCo via yeto-patch' if not o.without_yeto else 'WITHOUT yeto-patch (independent islands)'}")
    say(f"  model: GPT {o.layers} layers, hidden {o.hidden}, seq {o.seq_length}, byte vocabulary, "
        f"{'fp32' if o.fp32 else 'bf16'}, DistributedOptimizer; {o.batch} sequences/step/island")
    say(f"  data: {corpus['source']} ({corpus['documents']} documents, split {corpus['split']}; "
        f"island shards {', '.join(f'{b / 1e6:.1f}' for b in corpus['shard_bytes'])} MB, "
        f"held-out {corpus['heldout_bytes'] / 1e6:.1f} MB)")
    if not o.without_yeto:
        say(f"  DiLoCo: H={o.sync_every}, {o.fragments} fragment(s), push {o.push_dtype}"
            f"{' + error feedback' if o.error_feedback else ''}, overlap tau={o.overlap_steps}, "
            f"alpha={o.merge_alpha}, outer Nesterov lr {o.outer_lr} momentum {o.outer_momentum}, "
            f"bases sent as {o.base_wire}")
    if getattr(o, "syncer_shards", 1) > 1:
        say(f"  syncer: {o.syncer_shards} shards (--shard I/N)")
    if getattr(o, "save_interval", 0):
        say(f"  checkpoints: every {o.save_interval} steps per island"
            + "".join(f"; island {ids[e.island]} killed at its step {e.step}, launched again {e.seconds:g}s later"
                      for e in getattr(o, "kill_events", [])))
    say(f"  output: {out}")


def _run_baseline(sup, o, c):
    """Train (or reuse) the synchronous data-parallel baseline; with a warm-up also its snapshot after step
    K, returned as a path in `out`. `c`: the run's context (result, out, cache key, baseline layout and flags)."""
    result, out, key, warm, warm_name, say = c.result, c.out, c.key, c.warm, c.warm_name, c.say
    result["baseline"] = None
    if o.no_baseline:
        return None
    extra = [warm_name] if warm else []
    path = None if o.rebaseline else bl.cached(c.cache_dir, key, extra)
    dest = os.path.join(out, "baseline.jsonl")
    snap = os.path.join(out, f"baseline-{warm_name}") if warm else None
    if path:
        shutil.copyfile(path, dest)
        if snap:
            shutil.copyfile(os.path.join(os.path.dirname(path), warm_name), snap)
        result["baseline"] = {"cached": True, "key": key, "wall_s": None}
        say(f"baseline: reusing the cached synchronous data-parallel run ({path})")
    else:
        say(f"baseline: training synchronous data parallel ({c.base_layout.name}, "
            f"{o.batch * o.islands} sequences/step = the islands' tokens together)"
            + (f", keeping its state after step {warm} for the warm-up" if warm else "") + " ...")
        t_b = time.time()
        argv = _launcher(c.python, c.base_layout.nproc) + [TRAIN_SCRIPT] + c.base_layout.flags() + \
            c.base_flags + ["--log-jsonl", dest]
        if snap:  # not part of the cache key: the snapshot does not change the run
            argv += ["--snapshot-at", str(warm), "--snapshot", snap]
        b = sup.start("baseline", argv, env=_clean_env(), cwd=REPO)
        bprog = Progress(out, ["baseline"], o.steps, files={"baseline": dest})
        sup.wait([b], o.timeout, tick=bprog.tick, tick_every_s=o.progress_every)
        bprog.done()
        result["baseline"] = {"cached": False, "key": key, "wall_s": time.time() - t_b}
        bl.store(c.cache_dir, key, c.ident, dest, {warm_name: snap} if snap else None)
    if snap:
        say(f"synchronous warm-up: the islands start from the baseline's state after step {warm} and train "
            f"steps {warm + 1}..{o.steps}")
    return snap


def run(o):
    """Run the demo described by options `o`; returns the result dict (also written to out/result.json)."""
    t_start = time.time()
    python = o.python or sys.executable
    out = _fresh_out(o.out)
    layouts = _checked_layouts(o)
    ids = [f"{chr(ord('A') + i) if i < 26 else i}-{lay.name}" for i, lay in enumerate(layouts)]
    try:
        corpus = corpus_description(o)
    except (OSError, ValueError) as err:
        raise DemoError(f"cannot use the text: {err}") from None
    mflags = model_flags(o)
    base_flags, base_layout, key, ident = _baseline_setting(o, mflags, corpus, python)
    cache_dir = o.cache_dir or bl.default_cache_dir()
    say = print
    _announce(say, o, ids, corpus, out)
    result = {"settings": {k: v for k, v in vars(o).items()}, "ids": ids,
              "layouts": [vars(lay) for lay in layouts], "corpus": corpus, "out": out}
    warm = getattr(o, "sync_warmup", 0)
    warm_name = f"warm-{warm}.npz"
    ctx = types.SimpleNamespace(result=result, out=out, key=key, ident=ident, cache_dir=cache_dir, warm=warm,
                                warm_name=warm_name, say=say, python=python, base_layout=base_layout,
                                base_flags=base_flags)
    keydir = tempfile.mkdtemp(prefix="yeto-demo-")
    link = None
    try:
        with Supervisor(os.path.join(out, "logs")) as sup:
            warm_npz = _run_baseline(sup, o, ctx) if warm else None  # a warm-up first: the islands start from it
            t_isl = time.time()
            children = []
            key_file = write_key(keydir)
            if not o.without_yeto:
                syncers, link = start_syncers(sup, o, python, key_file, out)
                children += syncers
            launches = _island_launches(o, ctx, ids, layouts, mflags, warm_npz, link, key_file)
            islands = [sup.start(name, argv, env=env, cwd=REPO) for name, argv, env in launches]
            _wait_islands(sup, o, ctx, ids, children, islands, launches, link)
            children += islands
            result["islands_wall_s"] = time.time() - t_isl
            if link is not None:
                result["link"] = link.counters()
                if link.errors:
                    raise DemoError("; ".join(link.errors))
            say(f"islands finished in {result['islands_wall_s']:.0f}s")
            if not warm:
                _run_baseline(sup, o, ctx)
    except ChildFailed as err:
        raise DemoError(str(err)) from None
    except TimeoutError as err:
        raise DemoError(f"the demo did not finish within --timeout {o.timeout:.0f}s: {err}; logs in "
                        f"{os.path.join(out, 'logs')}") from None
    finally:
        if link is not None:
            link.close()
        shutil.rmtree(keydir, ignore_errors=True)
    result["wall_s"] = time.time() - t_start
    build_report(result, o)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    return result


def _baseline_setting(o, mflags, corpus, python) -> tuple:
    """(flags, layout, cache key, identity) of the synchronous data-parallel baseline: every shard, M x the batch."""
    base_flags = mflags + ["--global-batch-size", str(o.batch * o.islands),
                           "--shards", ",".join(str(i) for i in range(o.islands))]
    base_layout = parse_layouts(o.baseline_layout, 1)[0]
    if (o.batch * o.islands) % (base_layout.dp * o.micro_batch):
        raise DemoError(f"baseline layout {base_layout.name} does not divide the global batch")
    key, ident = bl.baseline_key(base_flags + base_layout.flags(), base_layout.nproc,
                                 [TRAIN_SCRIPT, os.path.join(EXAMPLES, "byte_corpus.py")], corpus,
                                 _python_version(python))
    return base_flags, base_layout, key, ident


def _island_launches(o, ctx, ids, layouts, mflags, warm_npz, link, key_file) -> list:
    """(name, argv, env) of each island's launch, as a user launches Megatron (a relaunch repeats it)."""
    out, launches = ctx.out, []
    for iid, lay, shard in zip(ids, layouts, range(o.islands)):
        argv = _launcher(ctx.python, lay.nproc) + [TRAIN_SCRIPT] + lay.flags() + mflags + [
            "--global-batch-size", str(o.batch), "--shards", str(shard),
            "--log-jsonl", os.path.join(out, f"island-{iid}.jsonl"),
            "--save-npz", os.path.join(out, f"island-{iid}.npz")]
        if warm_npz:
            argv += ["--init-from", warm_npz]
        if getattr(o, "save_interval", 0):   # (a relaunch resumes from the latest of them)
            ckpt = os.path.join(out, f"island-{iid}.ckpt")
            argv += ["--save", ckpt, "--save-interval", str(o.save_interval), "--load", ckpt]
        env = island_env(o, iid, link.addresses, key_file, out) if not o.without_yeto else _clean_env()
        launches.append((f"island-{iid}", argv, env))
    return launches


def _wait_islands(sup, o, ctx, ids, children, islands, launches, link) -> None:
    """Wait for the syncers and islands (`islands` is updated in place when --kill relaunches one), with progress
    lines; the kills' record goes into the result."""
    out, say = ctx.out, ctx.say
    prog = Progress(out, ids, o.steps, syncer_tape=None if o.without_yeto else
                    os.path.join(out, "syncer-tape.jsonl"), link=link)
    kills = getattr(o, "kill_events", [])

    def relaunch(k, n):
        name, argv, env = launches[k]
        say(f"island {ids[k]}: launched again from its latest checkpoint")
        return sup.start(f"{name}-relaunch{n}", argv, env=env, cwd=REPO)

    def tick():
        killer.check()
        prog.tick()
    with Killer(kills, sup, islands, lambda k: os.path.join(out, f"island-{ids[k]}.jsonl"), relaunch) as killer:
        sup.wait(lambda: children + islands, o.timeout, tick=tick, tick_every_s=o.progress_every)
    killer.check()
    prog.done()
    if kills:
        ctx.result["kills"] = [dict(e.as_dict(), id=ids[e.island]) for e in kills]
        for e in kills:
            say(f"island {ids[e.island]}: killed after step {e.killed_step}, launched again "
                f"{(e.restarted_t or 0) - (e.killed_t or 0):.1f}s later" if e.killed_t else
                f"island {ids[e.island]}: ended before step {e.step}: not killed")


def _python_version(python):
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        return ".".join(map(str, sys.version_info[:3]))
    return python

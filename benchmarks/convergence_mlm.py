#!/usr/bin/env python
"""DiLoCo through yeto-patch on Megatron-LM's own training loop: two islands (TP2 and PP2) against one data-parallel
job, against the initializing island training alone from the same start, and against textbook DiLoCo from the
same start; held-out loss, over fragment counts, seeds, the island that initializes and machine load.

Every run is Megatron-LM's real ``pretrain()`` (tests/shim/scripts/pretrain_gpt_cpu.py: local layer spec, bf16,
distributed optimizer, Megatron's GPTDataset over indexed .bin/.idx files, NullTokenizer with vocabulary 257 =
256 bytes + end of document), 2 gloo ranks per job on CPU, launched with torchrun; yeto-patch is attached only
through PYTHONPATH and YETO_* variables.  Data: the Python standard library's sources split by document
(examples/byte_corpus.py) into island shards 0 and 1 and a held-out file.  Island a is TP2 on shard 0 with seed
SA, island b PP2 on shard 1 with seed SB (``--seeds SA:SB,...``; the seed sets the initial weights, dropout and
the order of each island's samples). ``--data-layout corpus`` gives both islands (and the lone island) the whole
corpus, both shards blended, each sampled in the order of its own seed (issue 37's setting); ``--warmup`` is
Megatron's --lr-warmup-iters.

Cells (each a separate job; the held-out samples are drawn with ``--valid-seed`` whatever the seed, so every
cell evaluates the same sequences):

- ``ddp``: one DP2 job, global batch 8 over both shards (the islands' tokens in total), seed SA;
- ``lone``: the initializing island alone (its layout, shard and seed: the same start as a DiLoCo run it
  initializes), global batch 4, the same steps; it also writes its start (the INIT) for the reference;
- ``diloco``: a syncer (``--islands 2 --fragments F``, the setting's flags) and the two islands (global batch 4
  each, ``YETO_DILOCO_SYNC_EVERY=H`` and the setting's variables; ``defaults`` sets nothing else), the syncer
  told which island initializes (``--init a|b``); the final cut evaluated on both islands;
- ``ref``: benchmarks/diloco_reference_mlm.py, textbook Streaming DiLoCo in fp32 from the lone island's start,
  given the islands' own Megatron argument lists and YETO_DILOCO_SYNC_EVERY (so their samples, schedules, F, tau,
  alpha and outer optimizer: the resolved defaults).

Load (``--load``): ``quiet`` (whatever else the machine runs), ``hog`` (``--hog`` busy processes beside the
islands for the whole run), ``delay`` (every message from the syncer to an island held ``--delay-s`` seconds by
a relay: bases arrive late).

    python benchmarks/convergence_mlm.py                          # the default grid (docs/convergence.md)
    python benchmarks/convergence_mlm.py --seeds 11:22 --fragments 4 --init a,b --load quiet
    python benchmarks/convergence_mlm.py --only diloco --row 'lr1|YETO_DILOCO_OVERLAP_STEPS=5|--outer-lr 1'
    python benchmarks/convergence_mlm.py --seeds 11:22 --warmup 2 --data-layout corpus --init a,b --fragments 1,4
                                                                  # issue 37's setting
    python benchmarks/convergence_mlm.py --ci                     # the CI setting (tests/shim)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
from tests.shim import procs as P  # noqa: E402

SCRIPT = os.path.join(ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
LAYOUT = {"tp2": ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"],
          "pp2": ["--pipeline-model-parallel-size", "2"], "dp2": []}
ISLANDS = {"a": ("tp2", "shard0"), "b": ("pp2", "shard1")}
LAYOUTS = ("shards", "corpus")   # --data-layout: each island its own shard, or both the whole corpus
# DiLoCo settings: (island variables beyond H, syncer flags)
SETTINGS = {
    "defaults": ({}, []),
    "fixed roster": ({}, ["--quorum", "2"]),   # every merge waits for both islands (the syncer's default is elastic)
    "previous defaults": ({"YETO_DILOCO_OVERLAP_STEPS": 0, "YETO_DILOCO_ERROR_FEEDBACK": 0}, ["--outer-lr", "0.7"]),
}
KINDS = ("ddp", "lone", "diloco", "ref")
LOADS = ("quiet", "hog", "delay")
MERGED = re.compile(r"merged fragment \d+ -> v\d+: \d+ push\(es\) \[([^\]]*)\]")
ITER_MS = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def training_ms(windows: list):
    """An island's ms per iteration while it trains, from Megatron's per-window figures: without the first window
    (start-up, compilation) and, given more than two, the last (it holds the final cut's wait for the other
    islands: a fast island that reaches its last step first waits there, 666 ms per iteration in one window)."""
    core = windows[1:-1] if len(windows) > 2 else windows[1:]
    return sum(core) / len(core) if core else None
VALID = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.eE+-]+)")


@dataclasses.dataclass(frozen=True)
class Cell:
    kind: str                   # ddp | lone | diloco | ref
    seeds: tuple                # (seed of island a, seed of island b)
    init: str = "a"             # the island whose start the run takes (lone: the island itself)
    fragments: int = 0
    load: str = "quiet"
    setting: str = "defaults"
    rep: int = 0

    def command(self, common: str = "") -> str:
        """The command that runs this cell alone (with what it compares to: DDP, the lone run, the reference);
        `common`: the invocation's setting flags that differ from the defaults (``setting_flags``)."""
        s = f"python benchmarks/convergence_mlm.py{common} --seeds {self.seeds[0]}:{self.seeds[1]}"
        if self.kind == "ddp":
            return s + " --only ddp"
        s += f" --init {self.init}"
        if self.kind == "lone":
            return s + " --only lone"
        s += f" --fragments {self.fragments} --only {self.kind}"
        if self.kind == "diloco" and self.load != "quiet":
            s += f" --load {self.load}"
        return s + ("" if self.setting == "defaults" else f" --settings '{self.setting}'")

    @property
    def name(self) -> str:
        s = f"{self.kind} {self.seeds[0]}:{self.seeds[1]}"
        if self.kind == "ddp":
            return s
        s += f" init {self.init}"
        if self.kind in ("diloco", "ref"):
            s += f" F{self.fragments}"
        if self.kind == "diloco":
            s += f" {self.load}" + ("" if self.setting == "defaults" else f" [{self.setting}]")
        return s + (f" #{self.rep}" if self.rep else "")


def build_data(out: str, text: str = None) -> dict:
    """shard0 / shard1 / heldout as Megatron indexed datasets (uint16 tokens, documents of <= 64 KiB + eod), of the
    Python standard library's sources or of the text folder `text` (the fine-tune domain)."""
    import numpy as np
    import torch
    from byte_corpus import ByteCorpus, DOC_BLOCK
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(out, exist_ok=True)
    corpus = ByteCorpus(text, num_shards=2) if text else ByteCorpus(num_shards=2)
    paths = {}
    for name, arr in (("shard0", corpus.shards[0]), ("shard1", corpus.shards[1]), ("heldout", corpus.heldout)):
        prefix = os.path.join(out, name)
        paths[name] = prefix
        if os.path.exists(prefix + ".idx"):
            continue
        b = IndexedDatasetBuilder(prefix + ".bin.tmp", dtype=np.uint16)
        for off in range(0, arr.size, DOC_BLOCK):
            doc = np.append(arr[off:off + DOC_BLOCK].astype(np.uint16), np.uint16(256))
            b.add_document(torch.from_numpy(doc.astype(np.int64)), [doc.size])
        b.finalize(prefix + ".idx.tmp")
        os.replace(prefix + ".bin.tmp", prefix + ".bin")
        os.replace(prefix + ".idx.tmp", prefix + ".idx")
    return paths


def train_paths(a, data: dict, shard: str) -> list:
    """Megatron's --train-data-path of a job: its shard (``--data-layout shards``), or the whole corpus, both shards
    blended 1:1 and sampled in the order of the job's own --seed (``corpus``; DDP always takes the corpus)."""
    if a.data_layout == "corpus" or shard == "both":
        return ["1", data["shard0"], "1", data["shard1"]]
    return [data[shard]]


def megatron_args(a, gbs: int, train: list, data: dict, cache: str, seed: int) -> list:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", "4",
            "--seq-length", str(a.seq_length), "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", "2", "--global-batch-size", str(gbs), "--train-iters", str(a.iters),
            "--lr", str(a.lr), "--min-lr", str(a.lr / 10), "--lr-decay-style", "cosine", "--lr-warmup-iters",
            str(a.warmup), "--vocab-size", "257", "--train-data-path", *train, "--valid-data-path",
            data["heldout"], "--data-cache-path", cache, "--eval-iters", str(a.eval_seqs // gbs),
            "--eval-interval", "1000000", "--transformer-impl", "local", "--use-distributed-optimizer", "--bf16",
            "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
            "--no-bias-dropout-fusion", "--distributed-backend", "gloo", "--log-interval", "50",
            "--seed", str(seed), "--valid-seed", str(a.valid_seed),
            *(["--load", a.ft_ckpt, "--finetune"] if a.ft_ckpt else [])]


def run_pretrain(a, base: dict, out: str) -> str:
    """The fine-tune regime's start: one DP2 job, global batch 8, `--pretrain-iters` on the base corpus (both
    shards, seed 1234), saved as a Megatron checkpoint that every cell then loads with --finetune (kept in `out`
    and reused by later invocations with the same setting)."""
    import copy
    ckpt = os.path.join(out, "ckpt")
    if os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        return ckpt
    pa = copy.copy(a)
    pa.iters, pa.ft_ckpt, pa.data_layout = a.pretrain_iters, None, "corpus"
    margs = megatron_args(pa, 8, train_paths(pa, base, "both"), base, os.path.join(out, "cache"), 1234)
    p = job(pathlib.Path(out), "dp2", [*margs, "--save", ckpt, "--save-interval", str(a.pretrain_iters)], {})
    rcs = P.wait_all([p], timeout=a.timeout)
    if rcs != [0] or not os.path.exists(os.path.join(ckpt, "latest_checkpointed_iteration.txt")):
        raise RuntimeError(f"pretraining failed (rc {rcs[0]}); log {p.log_path}:\n{p.text()[-3000:]}")
    print(f"convergence_mlm: pretrained {a.pretrain_iters} iterations -> {ckpt} (held-out loss on the fine-tune "
          f"domain {final_loss(p):.4f})", flush=True)
    return ckpt


def job(out: pathlib.Path, layout: str, margs: list, env: dict, start_dump: bool = False) -> P.Proc:
    out.mkdir(parents=True, exist_ok=True)
    extra = ["--export-npz-at-start", str(out / "start")] if start_dump else []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), SCRIPT, *LAYOUT[layout], *margs,
           *extra]
    return P.Proc(out.name, cmd, P.base_env(**env), str(out) + ".log", cwd=str(out))


def final_loss(proc: P.Proc) -> float:
    found = VALID.findall(proc.text())
    if not found:
        raise RuntimeError(f"{proc.name}: no final validation loss in {proc.log_path}")
    return float(found[-1][1])


def cell_dir(tmp: str, cell: Cell) -> pathlib.Path:
    return pathlib.Path(tmp) / re.sub(r"[^A-Za-z0-9._-]+", "-", cell.name).strip("-")


# ------------------------------------------------------------------------------------------------ load
class Hog:
    """`n` busy processes (a CPU hog) for the duration of a run."""

    def __init__(self, n: int):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]

    def stop(self):
        for p in self.procs:
            p.kill()
            p.wait()


class DelayRelay:
    """A TCP relay in front of the syncer that holds every byte from the syncer to an island `delay_s` seconds
    (islands -> syncer passes at once): merged bases arrive late, as over a slow link."""

    def __init__(self, target_port: int, delay_s: float):
        self.target, self.delay_s = ("127.0.0.1", target_port), delay_s
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                a, _ = self.srv.accept()
                b = socket.create_connection(self.target, timeout=10)
                b.settimeout(None)   # (a connect timeout only: a quiet link is no error)
            except OSError:
                continue
            threading.Thread(target=self._pump, args=(a, b, 0.0), daemon=True).start()
            threading.Thread(target=self._pump, args=(b, a, self.delay_s), daemon=True).start()

    @staticmethod
    def _pump(src, dst, delay):
        import queue
        q: "queue.Queue" = queue.Queue()

        def writer():
            while True:
                t, data = q.get()
                if data is None:
                    break
                time.sleep(max(0.0, t + delay - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    break
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        threading.Thread(target=writer, daemon=True).start()
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                q.put((time.monotonic(), data))
        except OSError:
            pass
        q.put((time.monotonic(), None))

    def close(self):
        self.closed = True
        self.srv.close()


# ------------------------------------------------------------------------------------------------ runs
def run_ddp(a, cell: Cell, data: dict, tmp: str) -> dict:
    d = cell_dir(tmp, cell)
    margs = megatron_args(a, 8, train_paths(a, data, "both"), data, str(d / "cache"), cell.seeds[0])
    p = job(d, "dp2", margs, {})
    rcs = P.wait_all([p], timeout=a.timeout)
    if rcs != [0]:
        raise RuntimeError(f"{cell.name} failed (rc {rcs[0]}); log {p.log_path}:\n{p.text()[-3000:]}")
    return {"loss": final_loss(p)}


def run_lone(a, cell: Cell, data: dict, tmp: str) -> dict:
    layout, shard = ISLANDS[cell.init]
    seed = cell.seeds["ab".index(cell.init)]
    d = cell_dir(tmp, cell)
    p = job(d, layout, megatron_args(a, 4, train_paths(a, data, shard), data, str(d / "cache"), seed), {}, start_dump=True)
    rcs = P.wait_all([p], timeout=a.timeout)
    if rcs != [0]:
        raise RuntimeError(f"{cell.name} failed (rc {rcs[0]}); log {p.log_path}:\n{p.text()[-3000:]}")
    return {"loss": final_loss(p), "start": str(d / "start")}


def island_ids(init: str) -> dict:
    """Island ids: the initializing island's is the lowest (the syncer's default --initializer lowest-id takes
    it)."""
    return {x: ("0-" if x == init else "1-") + ISLANDS[x][0] for x in ISLANDS}


def init_flags(a) -> list:
    """The syncer's initializer policy: the default (lowest-id), or --policy first (the first island to join: with
    --stagger the initializing island starts first and trains ahead, as a race won by it would)."""
    return [] if a.policy == "lowest-id" else ["--initializer", a.policy]


def island_env(env: dict, x: str) -> dict:
    """The variables of a setting for island x: ``VAR`` for every island, ``x:VAR`` for island x only (a
    ``--row`` such as ``'lockstep|b:YETO_DILOCO_SYNC_EVERY=16|--quorum 2'`` pins H per island)."""
    out = {k: v for k, v in env.items() if ":" not in k}
    out.update({k.split(":", 1)[1]: v for k, v in env.items() if k.startswith(x + ":")})
    return out


def run_diloco(a, cell: Cell, data: dict, tmp: str) -> dict:
    env, flags = SETTINGS[cell.setting]
    d = cell_dir(tmp, cell)
    d.mkdir(parents=True, exist_ok=True)
    port = P.free_port()
    key = P.key_file(d)
    syncer = P.start_syncer(d, port, islands=2, fragments=cell.fragments, key=key, extra=[*init_flags(a), *flags],
                            elastic=True)   # (the syncer's defaults: elastic rounds; a setting may add --quorum)
    relay = DelayRelay(port, a.delay_s) if cell.load == "delay" else None
    hog = Hog(a.hog) if cell.load == "hog" else None
    ids = island_ids(cell.init)
    islands = []
    try:
        for x, (layout, shard) in sorted(ISLANDS.items(), key=lambda kv: kv[0] != cell.init):
            if x != cell.init and a.stagger:
                time.sleep(a.stagger)
            yeto = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{relay.port if relay else port}", YETO_DILOCO_KEY_FILE=key,
                        YETO_DILOCO_ISLAND_ID=ids[x], YETO_DILOCO_SYNC_EVERY=a.sync_every,
                        YETO_DILOCO_TIMEOUT=900, YETO_DILOCO_METRICS=str(d / x / "metrics.jsonl"))
            yeto.update(island_env(env, x))   # (a setting may set H, e.g. per island)
            seed = cell.seeds["ab".index(x)]
            margs = megatron_args(a, 4, train_paths(a, data, shard), data, str(d / x / "cache"), seed)
            islands.append(job(d / x, layout, margs, yeto, start_dump=a.dump_start))
        islands.sort(key=lambda p: p.name)   # a, b
        rcs = P.wait_all([*islands, syncer], timeout=a.timeout)
    finally:
        if hog:
            hog.stop()
        if relay:
            relay.close()
    if rcs != [0, 0, 0]:
        raise RuntimeError(f"{cell.name} failed (rcs {rcs}):\n{P.logs([*islands, syncer])}")
    losses = [final_loss(p) for p in islands]
    merges = MERGED.findall(syncer.text())
    both = sum(1 for m in merges if all(f"{ids[x]}(lag" in m for x in ISLANDS))
    # while both train: up to the last merge holding an on-time push of each island (after the faster one reached
    # its last step, the other's rounds cannot hold both)
    last = [max((k for k, m in enumerate(merges) if re.search(re.escape(ids[x]) + r"\(lag \d+, w", m)), default=-1)
            for x in ISLANDS]
    live = merges[:min(last) + 1]
    both_live = sum(1 for m in live if all(f"{ids[x]}(lag" in m for x in ISLANDS))
    ms = [[float(t) for t in ITER_MS.findall(p.text())] for p in islands]
    who = re.search(r"run initialized from island (\S+)'s INIT", syncer.text())
    got = who and who[1].strip("'")
    if got != ids[cell.init]:
        raise RuntimeError(f"{cell.name}: the syncer took the INIT of {got}, not of {ids[cell.init]}")
    return {"loss": sum(losses) / 2, "islands": losses, "dir": str(d), "merges": len(merges),
            "both": both / len(merges) if merges else 0.0,   # merges holding a push of each island (on time or carried)
            "both_live": both_live / len(live) if live else 0.0, "live": len(live),   # ... while both train
            "ms_per_iter": [training_ms(x) for x in ms]}


def island_argv(a, x: str, data: dict, cache: str, seeds: tuple) -> list:
    """Island x's Megatron argument list, as run_diloco launches it (layout flags first)."""
    layout, shard = ISLANDS[x]
    return [*LAYOUT[layout], *megatron_args(a, 4, train_paths(a, data, shard), data, cache, seeds["ab".index(x)])]


def run_ref(a, cell: Cell, data: dict, tmp: str, start: str) -> dict:
    """The reference given the islands' own Megatron argument lists (a, b) and YETO_* variables, as anyone would
    run it on their islands."""
    import shlex
    d = cell_dir(tmp, cell)
    d.mkdir(parents=True, exist_ok=True)
    out = d / "ref.json"
    islands = [shlex.join(island_argv(a, x, data, str(d / "cache"), cell.seeds)) for x in ISLANDS]
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "diloco_reference_mlm.py"), "--init", start,
           *[arg for x in islands for arg in ("--island", x)], "--island-env",
           f"YETO_DILOCO_SYNC_EVERY={a.sync_every}", "--valid-seed", str(a.valid_seed), "--fragments",
           str(cell.fragments), "--eval-seqs", str(a.eval_seqs), "--cache", str(d / "cache"), "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, env=P.base_env(), capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        raise RuntimeError(f"{cell.name} failed:\n{r.stdout[-2000:]}{r.stderr[-3000:]}")
    res = json.loads(out.read_text())
    return {"loss": res["diloco"], "ref": res}


# ------------------------------------------------------------------------------------------------ grid
def grid(a) -> list:
    """The cells of this invocation, in the order they run (the lone runs first: the references need their
    starts)."""
    cells = []
    for seeds in a.seeds:
        if "ddp" in a.only:
            cells.append(Cell("ddp", seeds))
        for init in a.init:
            if "lone" in a.only or "ref" in a.only:
                cells.append(Cell("lone", seeds, init))
            for f in a.fragments:
                if "ref" in a.only:
                    cells.append(Cell("ref", seeds, init, f))
                if "diloco" in a.only:
                    for load in a.load:
                        for setting in a.settings:
                            for rep in range(a.repeat):
                                cells.append(Cell("diloco", seeds, init, f, load, setting, rep))
    return cells


def run_cell(a, cell: Cell, data: dict, tmp: str, res: dict) -> dict:
    if cell.kind == "ddp":
        return run_ddp(a, cell, data, tmp)
    if cell.kind == "lone":
        return run_lone(a, cell, data, tmp)
    if cell.kind == "diloco":
        return run_diloco(a, cell, data, tmp)
    lone = res.get(Cell("lone", cell.seeds, cell.init))
    if lone is None:
        raise RuntimeError(f"{cell.name}: its lone run (the start) failed")
    start = lone["start"]
    return run_ref(a, cell, data, tmp, start)


SETTING_FLAGS = (("iters", "--iters", 300), ("sync_every", "--sync-every", 10), ("lr", "--lr", 1e-3),
                 ("warmup", "--warmup", 10), ("data_layout", "--data-layout", "shards"),
                 ("finetune_data", "--finetune-data", None), ("pretrain_iters", "--pretrain-iters", 300))


def setting_flags(a) -> str:
    """The flags of this invocation's setting that differ from the script's defaults (for the commands shown)."""
    return "".join(f" {flag} {getattr(a, k)}" for k, flag, d in SETTING_FLAGS if getattr(a, k) != d)


def tables(res: dict, common: str = "") -> str:
    """One table per seed pair: every DiLoCo cell beside DDP, the lone island from the same start and the
    reference from the same start and F."""
    out = []
    for seeds in sorted({c.seeds for c in res}, key=lambda s: list(res).index(next(c for c in res if c.seeds == s))):
        ddp = res.get(Cell("ddp", seeds), {}).get("loss")
        out += [f"\nseeds {seeds[0]}:{seeds[1]}" + (f" (DDP {ddp:.4f})" if ddp else ""),
                "| init | F | load | setting | yeto-patch | / DDP | lone (same start) | yeto / lone | reference | "
                "yeto / ref | wall s | merges holding both | ... while both train | ms/iter a, b | command |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, v in res.items():
            if c.seeds != seeds or c.kind != "diloco":
                continue
            lone = res.get(Cell("lone", seeds, c.init), {}).get("loss")
            ref = res.get(Cell("ref", seeds, c.init, c.fragments), {}).get("loss")
            out.append("| " + " | ".join([
                c.init, str(c.fragments), c.load, c.setting + (f" #{c.rep}" if c.rep else ""), f"{v['loss']:.4f}",
                f"{v['loss'] / ddp:.4f}" if ddp else "n/a", f"{lone:.4f}" if lone else "n/a",
                f"{v['loss'] / lone:.4f}" if lone else "n/a", f"{ref:.4f}" if ref else "n/a",
                f"{v['loss'] / ref:.4f}" if ref else "n/a", f"{v['wall_s']:.0f}",
                f"{v['both']:.2f} of {v['merges']}" if "both" in v else "n/a",
                f"{v['both_live']:.2f} of {v['live']}" if "both_live" in v else "n/a",
                ", ".join("n/a" if x is None else f"{x:.0f}" for x in v.get("ms_per_iter", [])) or "n/a",
                f"`{c.command(common)}`"]) + " |")
        for c, v in res.items():
            if c.seeds == seeds and c.kind in ("lone", "ref"):
                out.append(f"{c.name}: {v['loss']:.4f}" + (f" ({v['loss'] / ddp:.4f}x DDP)" if ddp else ""))
    return "\n".join(out)


def summary(res: dict) -> str:
    """The last line: the defaults' mean / DDP, the worst yeto / lone and yeto / ref over the cells run."""
    dl = [(c, v) for c, v in res.items() if c.kind == "diloco" and c.setting == "defaults"]

    def get(cell):
        return res.get(cell, {}).get("loss")
    ratios = [v["loss"] / get(Cell("ddp", c.seeds)) for c, v in dl if get(Cell("ddp", c.seeds))]
    lone = [v["loss"] / get(Cell("lone", c.seeds, c.init)) for c, v in dl if get(Cell("lone", c.seeds, c.init))]
    ref = [v["loss"] / get(Cell("ref", c.seeds, c.init, c.fragments)) for c, v in dl
           if get(Cell("ref", c.seeds, c.init, c.fragments))]

    def fmt(xs, f):
        return f"{f(xs):.4f}" if xs else "n/a"
    return (f"convergence_mlm: defaults {fmt(ratios, lambda x: sum(x) / len(x))}x DDP (mean of {len(ratios)}), "
            f"worst yeto/lone {fmt(lone, max)}, worst yeto/ref {fmt(ref, max)}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--only", default="ddp,lone,diloco,ref", help="comma-separated kinds: " + ", ".join(KINDS))
    ap.add_argument("--seeds", default="11:22,33:44,1234:1234", help="seed pairs SA:SB of islands a and b")
    ap.add_argument("--init", default="a,b", help="the island(s) that initialize, one DiLoCo run each")
    ap.add_argument("--fragments", default="1,2,4,8", help="the syncer's --fragments, one run each")
    ap.add_argument("--load", default="quiet", help="comma-separated, of " + ", ".join(LOADS))
    ap.add_argument("--settings", default="defaults", help="comma-separated DiLoCo settings: "
                    + ", ".join(SETTINGS) + " or a --row's name")
    ap.add_argument("--row", action="append", default=[], metavar="'NAME|VAR=V ...|SYNCER FLAGS'",
                    help="an extra DiLoCo setting (repeatable; run when named in --settings, or alone when "
                    "--settings is not given), e.g. 'lr0.4|YETO_DILOCO_ERROR_FEEDBACK=1|--outer-lr 0.4'; "
                    "b:VAR=V sets a variable on island b only")
    ap.add_argument("--repeat", type=int, default=1, help="DiLoCo runs per cell (run-to-run spread)")
    ap.add_argument("--policy", default="lowest-id", choices=("lowest-id", "first"), help="the syncer's "
                    "--initializer")
    ap.add_argument("--stagger", type=float, default=0.0, help="seconds the other island starts after the "
                    "initializing one")
    ap.add_argument("--hog", type=int, default=2, help="busy processes of the hog load")
    ap.add_argument("--delay-s", type=float, default=2.0, help="seconds the delay load holds syncer messages")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--sync-every", type=int, default=10, help="H")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=10, help="Megatron's --lr-warmup-iters")
    ap.add_argument("--data-layout", default="shards", choices=LAYOUTS, help="shards: island a trains on shard 0, "
                    "b on shard 1; corpus: both islands (and the lone island) sample the whole corpus, each in the "
                    "order of its own seed (DDP: the whole corpus in both)")
    ap.add_argument("--finetune-data", default=None, metavar="TEXT_FOLDER", help="the fine-tune regime: a DP2 "
                    "job pretrains --pretrain-iters on the Python sources and every cell loads it (--load "
                    "--finetune) and trains on this folder's text instead (its shards and held-out file), e.g. "
                    "/usr/share/perl")
    ap.add_argument("--pretrain-iters", type=int, default=300)
    ap.add_argument("--eval-seqs", type=int, default=128, help="held-out sequences in the final evaluation")
    ap.add_argument("--valid-seed", type=int, default=1234, help="seed that draws the held-out sequences")
    ap.add_argument("--dump-start", action="store_true", help="DiLoCo islands write their state after the start")
    ap.add_argument("--ci", "--quick", action="store_true", help="the CI setting: 20 iterations, H 5, 16 held-out sequences, "
                    "seeds 11:22, F 4, lone, DiLoCo and reference from each island's start, --dump-start")
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (a load run beside others is not "
                    "alone with its load)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench-out", "convergence_mlm"))
    ap.add_argument("--json", default=None, help="also write the results here")
    a = ap.parse_args(argv)
    if a.ci:
        a.iters, a.sync_every, a.eval_seqs, a.seeds, a.fragments, a.only = 20, 5, 16, "11:22", "4", "lone,diloco,ref"
        a.dump_start = True
    a.only = [k.strip() for k in a.only.split(",") if k.strip()]
    a.seeds = [tuple(int(x) for x in s.split(":")) for s in a.seeds.split(",") if s.strip()]
    a.init = [x.strip() for x in a.init.split(",") if x.strip()]
    a.fragments = [int(f) for f in a.fragments.split(",") if f.strip()]
    a.load = [x.strip() for x in a.load.split(",") if x.strip()]
    named = [s.strip() for s in a.settings.split(",") if s.strip()]
    for spec in a.row:
        name, _, rest = spec.partition("|")
        env, _, flags = rest.partition("|")
        SETTINGS[name.strip()] = (dict(kv.split("=", 1) for kv in env.split()), flags.split())
        bad_island = [k for k in SETTINGS[name.strip()][0] if ":" in k and k.split(":", 1)[0] not in ISLANDS]
        if bad_island:
            ap.error(f"--row {name.strip()!r}: {bad_island} names no island of " + ", ".join(ISLANDS))
        if "--settings" not in (argv if argv is not None else sys.argv):
            named = [n for n in named if n != "defaults"] + [name.strip()]
    a.settings = named
    bad = ([k for k in a.only if k not in KINDS] + [x for x in a.init if x not in ISLANDS]
           + [x for x in a.load if x not in LOADS] + [s for s in a.settings if s not in SETTINGS])
    if bad or any(len(s) != 2 for s in a.seeds):
        ap.error(f"unknown values {bad} (or a seed pair that is not SA:SB)")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    data = build_data(os.path.join(a.out, "data"))
    a.ft_ckpt = None
    if a.finetune_data:   # the fine-tune regime: pretrain on the base corpus, every cell fine-tunes on this one
        import zlib
        tag = "%08x" % zlib.crc32(os.path.abspath(a.finetune_data).encode())
        base, data = data, build_data(os.path.join(a.out, f"data-ft-{tag}"), a.finetune_data)
        a.ft_ckpt = run_pretrain(a, {**base, "heldout": data["heldout"]},
                              os.path.join(a.out, f"pretrain-{tag}-{a.pretrain_iters}-w{a.warmup}"))
    tmp = os.path.join(a.out, time.strftime("run-%Y%m%d-%H%M%S"))
    os.makedirs(tmp)
    cells = grid(a)
    print(f"convergence_mlm: Megatron-LM pretrain(), GPT {a.layers}x{a.hidden} seq {a.seq_length}, {a.iters} "
          f"iterations, lr {a.lr} cosine after {a.warmup} warm-up, H={a.sync_every}, data {a.data_layout}; "
          f"{len(cells)} runs; output {tmp}", flush=True)
    res = run_all(a, cells, data, tmp)
    print(tables(res, setting_flags(a)))
    print(summary(res))
    failed = [c.name for c in cells if c not in res]
    if failed:
        print(f"convergence_mlm: {len(failed)} runs failed: {failed}")
    return 1 if failed else 0


def run_all(a, cells: list, data: dict, tmp: str) -> dict:
    """Every cell, `--jobs` at a time (the references after the lone runs whose starts they take); a failed run
    is reported and the others go on. Returns {cell: result} in grid order."""
    from concurrent.futures import ThreadPoolExecutor
    res, lock = {}, threading.Lock()

    def one(cell):
        t0 = time.time()
        try:
            r = run_cell(a, cell, data, tmp, res)
        except Exception as e:  # noqa: BLE001 - reported, the other runs go on
            print(f"  {cell.name:40s} FAILED: {str(e)[:3000]}", flush=True)
            return
        r["wall_s"] = time.time() - t0
        extra = "" if "islands" not in r else " (islands %.4f / %.4f)" % tuple(r["islands"])
        with lock:
            res[cell] = r
            print(f"  {cell.name:40s} held-out loss {r['loss']:.4f}{extra}  {r['wall_s']:.0f}s  (load "
                  f"{os.getloadavg()[0]:.0f})", flush=True)
            write_json(a, res)
    for batch in ([c for c in cells if c.kind != "ref"], [c for c in cells if c.kind == "ref"]):
        with ThreadPoolExecutor(max(1, a.jobs)) as ex:
            list(ex.map(one, batch))
    out = {c: res[c] for c in cells if c in res}
    check_starts(out)
    write_json(a, out)
    return out


def write_json(a, res: dict) -> None:
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{**dataclasses.asdict(c), "name": c.name, **{k: x for k, x in v.items() if k != "ref"}}
                       for c, v in res.items()], f, indent=1)


def check_starts(res: dict) -> None:
    """With --dump-start: whether every DiLoCo run's islands started from exactly the lone run's start of the same
    island and seeds (the INIT its initializer sent, installed on the other island); `same_start` in the result."""
    import numpy as np
    for c, v in res.items():
        lone = res.get(Cell("lone", c.seeds, c.init))
        if c.kind != "diloco" or lone is None or not v.get("dir"):
            continue
        ref = P.npz_parts(lone["start"] + ".rank*.npz", "master")
        got = [P.npz_parts(os.path.join(v["dir"], x, "start.rank*.npz"), "master") for x in ISLANDS]
        if not ref or not all(got):
            continue
        v["same_start"] = all(np.array_equal(g[k], ref["embedding.word_embeddings.weight" if k.endswith("(tied)")
                                                         else k]) for g in got for k in g)


if __name__ == "__main__":
    sys.exit(main())

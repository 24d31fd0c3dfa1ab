#!/usr/bin/env python
"""One torchft replica group for benchmarks/vs_torchft.py: the convergence model and data under torchft's DiLoCo.

Runs in the py312-peers environment (torchft 0.2.0), one process per replica group (group size 1), started by
vs_torchft.py with the lighthouse's address in TORCHFT_LIGHTHOUSE and this group's own TCPStore in
MASTER_ADDR/MASTER_PORT. The model, data, inner optimizer and LR schedule are benchmarks/diloco_reference.py's
(megatron-core GPTModel as examples/train_gpt.py builds it, fp32, torch AdamW with megatron's parameter groups and
OptimizerParamScheduler; batches ByteCorpus.global_batch of this replica's own shard), imported, not copied.
torchft is used as its DiLoCo example (examples/diloco/train_diloco.py) and its docstrings set it up:
ProcessGroupGloo(timeout 5 s), PGTransport for live recovery, Manager(min_replica_size=1, use_async_quorum=False,
timeout 30 s), one outer SGD(lr, momentum, nesterov=True) per fragment, DiLoCo(sync_every=H) with every other
argument at its default (fragment_sync_delay 0, fragment_update_alpha 0, should_quantize False). init_sync=False:
the Manager's docstring asks for it when every replica seeds its weights identically, as here. Fragments are the
syncer's own partition of the model (yeto_patch.syncer.layout.partition), so both sides sync the same tensors.

Writes one JSON line per step (step, loss, step_s, outer steps so far) to --log and, at the end, a result JSON
(--result): held-out loss of this replica's model on the convergence benchmark's held-out windows, step times
and optimizer-step times (DiLoCo's sync runs in the optimizer's post-hook),
the Manager's committed outer steps and how many of them had every replica. With --die-at-step N the process
exits hard (os._exit) after step N (vs_torchft.py --kill); started again, the replica heals from a live peer at
its first quorum (the Manager's state_dict: model, inner optimizer, LR schedule, DiLoCo's local step and this
loop's step, so it goes on at its peers' step and data position) and records when (`healed`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from benchmarks import diloco_reference as ref  # noqa: E402


def fragment_modules(model, n):
    """The syncer's partition of `model` as n torch modules sharing the model's parameters (torchft's fragments)."""
    import torch
    named = list(model.named_parameters())
    mods = []
    for idx in ref.fragments_of(model, n):
        m = torch.nn.Module()
        for i in idx:
            m.register_parameter(named[i][0].replace(".", "__"), named[i][1])
        mods.append(m)
    return mods


def parse(argv=None):
    from yeto_patch.demo import cli as demo_cli
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--release", default=None, help="after writing the result, keep the process group (and its "
                    "sockets) open until this file exists (at most 120 s), so the caller can read the final byte counts")
    ap.add_argument("--die-at-step", type=int, default=0)
    ap.add_argument("--hostname", default=None, help="the address this replica's Manager advertises to its peers "
                    "(default: socket.gethostname(), the Manager's own default; a network namespace needs its IP)")
    mine, rest = ap.parse_known_args(argv)
    return mine, demo_cli.parse(rest)


def main(argv=None):
    mine, o = parse(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.local_sgd import DiLoCo
    from byte_corpus import ByteCorpus  # on sys.path through diloco_reference

    t0 = time.time()
    a = ref.train_args(o)
    ref.init_megatron(a)  # world size 1 over gloo on MASTER_ADDR/PORT: the TCPStore the Manager joins
    torch.set_num_threads(1)
    corpus = ByteCorpus(a.text, num_shards=a.num_shards, heldout_frac=a.heldout_frac, seed=a.data_seed)
    heldout = corpus.heldout_windows(a.eval_seqs, a.seq_length)
    rep = ref.replica(a, [mine.replica], o.batch)
    frags = fragment_modules(rep.model, o.fragments)
    outers = [torch.optim.SGD(f.parameters(), lr=o.outer_lr, momentum=o.outer_momentum, nesterov=True)
              for f in frags]
    box = {"step": 0, "healed": []}

    def state_dict():
        return {"model": rep.model.state_dict(), "inner_optim": rep.opt.state_dict(),
                "sched": rep.sched.state_dict(), "local_step": box["diloco"]._local_step, "step": box["step"]}

    def load_state_dict(sd):
        rep.model.load_state_dict(sd["model"])
        rep.opt.load_state_dict(sd["inner_optim"])
        rep.sched.load_state_dict(sd["sched"])
        box["diloco"]._local_step = sd["local_step"]
        box["step"] = sd["step"]   # a restarted replica goes on at its peers' step (its data position too)
        box["healed"].append(dict(step=sd["step"], t=time.time()))

    pg = ProcessGroupGloo(timeout=timedelta(seconds=5))
    manager = Manager(pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
                      replica_id=f"vs_torchft_{mine.replica}", timeout=timedelta(seconds=30),
                      checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")),
                      use_async_quorum=False, init_sync=False,
                      **({"hostname": mine.hostname} if mine.hostname else {}))
    setup_s = time.time() - t0
    step_s, opt_s, losses = [], [], []
    log = open(mine.log, "a")
    with DiLoCo(manager, frags, rep.opt, outers, sync_every=o.sync_every,
                backup_device=torch.device("cpu")) as diloco:
        box["diloco"] = diloco
        outer_seen = full_syncs = 0
        t_train = time.time()
        while box["step"] < o.steps:
            ts = time.perf_counter()
            rep.opt.zero_grad(set_to_none=True)
            loss = ref.token_loss(rep.model, corpus.global_batch(rep.shards, box["step"], rep.batch, a.seq_length))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(rep.model.parameters(), a.clip_grad)
            to = time.perf_counter()
            rep.opt.step()  # DiLoCo's post-hook: quorum, allreduce, outer step at a fragment's turn
            opt_s.append(time.perf_counter() - to)
            rep.sched.step(1)
            dt = time.perf_counter() - ts
            box["step"] += 1   # after the optimizer step: a heal inside it set the peers' step
            s = box["step"]
            step_s.append(dt)
            losses.append(float(loss))
            outer = manager.current_step()
            if outer > outer_seen:  # this step committed a fragment's outer step: who took part
                outer_seen = outer
                full_syncs += manager.num_participants() == o.islands
            log.write(json.dumps(dict(step=s, loss=float(loss), step_s=round(dt, 5), outer=outer,
                                      participants=manager.num_participants(), t=time.time())) + "\n")
            log.flush()
            if mine.die_at_step and s == mine.die_at_step:
                os._exit(17)
        train_s = time.time() - t_train
    loss = ref.heldout_loss(rep.model, heldout, a.micro_batch_size)
    res = dict(replica=mine.replica, heldout_loss=loss, step_s=step_s, opt_s=opt_s, train_s=train_s, setup_s=setup_s,
               outer_steps=manager.current_step(), full_syncs=full_syncs, healed=box["healed"], batches_committed=manager.batches_committed(),
               params=sum(p.numel() for p in rep.model.parameters()), pid=os.getpid())
    with open(mine.result + ".tmp", "w") as f:
        json.dump(res, f)
    os.replace(mine.result + ".tmp", mine.result)
    deadline = time.time() + 120
    while mine.release and not os.path.exists(mine.release) and time.time() < deadline:
        time.sleep(0.05)
    manager.shutdown(wait=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Megatron-LM's own loop (megatron.training.pretrain) under the shim, attached only through the environment: a
launcher in the style of pretrain_gpt.py with mock data runs, at the defaults (only H and the push dtype set), to
the final cut, Megatron saves its checkpoint there, and that checkpoint loads back (a plain Megatron run with
--load) equal to the syncer's final base."""
import importlib.util
import os
import re

import numpy as np
import pytest

from tests.shim import procs as P

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None,
                                reason="megatron-core < 0.17 ships no megatron.training")

SCRIPT = os.path.join(P.ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
ITERS = 8


def mlm_args(ckpt, extra=()):
    return ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-decay-style", "constant", "--vocab-size", "128",
            "--mock-data", "--transformer-impl", "local", "--use-distributed-optimizer", "--bf16",
            "--eval-iters", "0", "--eval-interval", "1000", "--no-gradient-accumulation-fusion",
            "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
            "--position-embedding-type", "rope", "--distributed-backend", "gloo", "--log-interval", "1",
            "--seed", "1234", *extra]


def torchrun(tmp_path, name, args, env):
    import sys
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), SCRIPT, *args]
    return P.Proc(name, cmd, P.base_env(**env), str(tmp_path / f"{name}.log"), cwd=str(tmp_path))




def start_syncers(tmp_path, key, shards):
    """One syncer, or `shards` shards (--shard I/N) that tell islands each other's addresses; (procs, address
    for the island: shard 0's, checkpoint path(s))."""
    ports = [P.free_port() for _ in range(shards)]
    if shards == 1:
        return [P.start_syncer(tmp_path, ports[0], islands=1, fragments=2, key=key)], ports[0], \
            str(tmp_path / "syncer.ckpt")
    listed = ",".join(f"127.0.0.1:{p}" for p in ports)
    procs = [P.start_syncer(tmp_path, p, islands=1, fragments=2, key=key, name=f"shard{i}", files=f"shard{i}",
                            extra=["--shard", f"{i}/{shards}", "--shard-addresses", listed])
             for i, p in enumerate(ports)]
    return procs, ports[0], [str(tmp_path / f"shard{i}.ckpt") for i in range(shards)]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("total,shards", [(None, 1), (ITERS - 2, 2)],
                         ids=["final-cut-at-train-iters", "final-cut-before-two-syncer-shards"])
def test_pretrain_loop_ends_at_the_final_cut_and_its_checkpoint_is_the_global_model(tmp_path, total, shards):
    """(final-cut-before-two-syncer-shards: YETO_DILOCO_TOTAL_STEPS ends the run two iterations before Megatron's
    train_iters, and the island is given shard 0's address only: the final model comes from both shards. One run
    for both conditions: each start-up of Megatron-LM costs about a minute on the CI machine.)"""
    end = total or ITERS
    key = P.key_file(tmp_path)
    syncers, port, ckpts = start_syncers(tmp_path, key, shards)
    ckpt = str(tmp_path / "ckpt")
    env = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID="mlm",
               YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_PUSH_DTYPE="int8", YETO_DILOCO_TIMEOUT=120,
               YETO_DILOCO_METRICS=str(tmp_path / "metrics.jsonl"), **({} if total is None else
                                                                        dict(YETO_DILOCO_TOTAL_STEPS=total)))
    train = torchrun(tmp_path, "pretrain", mlm_args(ckpt, ["--save", ckpt, "--save-interval", "1000",
                                                            "--export-npz", str(tmp_path / "trained")]), env)
    rcs = P.wait_all([train, *syncers], timeout=480)
    assert rcs == [0] * (1 + shards), P.logs([train, *syncers])
    log = train.text()
    assert f"iteration        {end}/       {ITERS}" in log and f"iteration        {end + 1}/" not in log
    # only H and the push dtype are set: the defaults decide tau (min(5, H // 2)), error feedback (on for int8)
    # and the syncer's outer lr (auto: 0.7, the island blends bases in since tau > 0)
    assert "H=2, push int8 + error feedback, tau=1" in log
    assert "error feedback on (YETO_DILOCO_ERROR_FEEDBACK=auto)" in log
    merged = [x for x in syncers[0].text().splitlines() if "merged fragment" in x]
    assert merged and all("outer lr 0.7" in x for x in merged), merged
    assert "installed the syncer's final model" in log
    assert f"saving checkpoint at iteration       {end} " in log
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(end)            # the checkpoint is numbered by the steps it holds
    final, versions = P.syncer_model(ckpts)
    assert sorted(versions) == [0, 1] and (shards == 1 or "joined 2 syncer shards" in log)
    recs = P.metrics(str(tmp_path))
    assert recs[-1]["event"] == "final" and recs[-1]["step"] == end

    # a plain Megatron run (no yeto-patch in its environment) loads the checkpoint back
    load = torchrun(tmp_path, "load", mlm_args(ckpt, ["--load", ckpt, "--export-npz", str(tmp_path / "loaded"),
                                                      "--train-iters", str(end),
                                                      "--use-checkpoint-opt_param-scheduler"]), {})
    rcs = P.wait_all([load], timeout=300)
    assert rcs == [0], P.logs([load])
    # an early final cut ends the process inside Megatron's loop (its exit rule), so only the load-back exports
    for prefix in ("trained", "loaded") if total is None else ("loaded",):
        masters = P.npz_parts(str(tmp_path / prefix) + ".rank*.npz", "master")
        params = P.npz_parts(str(tmp_path / prefix) + ".rank*.npz", "param")
        assert sorted(masters) == sorted(params) == sorted(final), (prefix, sorted(set(masters) ^ set(final)))
        for k, v in final.items():
            assert np.array_equal(masters[k], v), (prefix, k, float(np.abs(masters[k] - v).max()))
            assert np.array_equal(params[k], P.as_bf16(v)), (prefix, k)   # bf16 weights = the base, cast
    if total is None:
        finetune_from_the_checkpoint(tmp_path, key, ckpt, final)


def finetune_from_the_checkpoint(tmp_path, key, ckpt, final):
    """A fine-tune of that checkpoint under yeto-patch (Megatron-LM's --load --finetune, a new syncer at its
    defaults): the island starts from the loaded weights and says so in its pushes, and the syncer's outer lr auto
    takes its fine-tune value, 1.0, for every merge (0.7 in the run from fresh weights above)."""
    port = P.free_port()
    syncer = P.start_syncer(tmp_path, port, islands=1, fragments=2, key=key, name="ft-syncer", files="ft-syncer")
    env = dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID="ft",
               YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_PUSH_DTYPE="int8", YETO_DILOCO_TIMEOUT=120,
               YETO_DILOCO_METRICS=str(tmp_path / "ft" / "metrics.jsonl"))
    (tmp_path / "ft").mkdir()
    ft = torchrun(tmp_path, "finetune", mlm_args(ckpt, ["--load", ckpt, "--finetune", "--train-iters", "4",
                                                        "--export-npz-at-start", str(tmp_path / "ft-start")]), env)
    rcs = P.wait_all([ft, syncer], timeout=300)
    assert rcs == [0, 0], P.logs([ft, syncer])
    assert "from pretrained weights" in ft.text()
    merged = [x for x in syncer.text().splitlines() if "merged fragment" in x]
    assert merged and all(re.search(r"outer lr 1(?![.\d])", x) for x in merged), merged
    assert "outer lr auto: 1 (the merged islands say their run started from pretrained weights" in syncer.text()
    start = P.npz_parts(str(tmp_path / "ft-start") + ".rank*.npz", "param")   # (--finetune loads no optimizer:
    assert sorted(start) == sorted(final)                                     # its masters come from the params)
    assert all(np.array_equal(start[k], P.as_bf16(v)) for k, v in final.items())

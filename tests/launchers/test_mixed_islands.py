"""Any island with any other: two ms-swift `megatron sft` islands of different layouts (a: TP2, c: DP2, the tiny
Qwen2) and a Megatron-LM `pretrain_gpt.py` island (b: DP2, the same architecture: SwiGLU, RMSNorm, rope, QKV bias,
grouped-query attention, untied embeddings, vocabulary 512) join one syncer with PYTHONPATH and YETO_* only (nothing
about yeto-patch on ms-swift's command line) and end with one model after a final cut before the launchers' last
iteration: every island's checkpoint, saved there and numbered by the steps it holds, holds the syncer's final
model, the loss fell on every island, and the fine-tune's pretrained start is the run's (ms-swift's island a
initializes it: the syncer's --init-lowest-id). The launchers write TensorBoard on their last rank (Megatron-LM:
--tensorboard-dir; ms-swift: its default --report_to tensorboard); the islands' boundary figures (yeto/*) are read
back from the real event files, beside each launcher's own loss. (One run of three islands: each launcher start-up
costs about a minute on the CI machine.)"""
import glob
import json
import os
import re
import sys
import time

import numpy as np
import pytest

from tests.launchers import need
from tests.launchers import launch as L
from tests.launchers.test_swift_sft import checkpoint, losses, per_layer
from tests.shim import procs as P

pytestmark = need("swift", "mcore_bridge", "tensorboard")

ITERS, CUT = 6, 4
SWIFT = {"a-swift": 2, "c-swift": 1}     # ms-swift islands: their TP size (2 ranks each)
MLM_SCRIPT = os.path.join(P.ROOT, "tests", "shim", "scripts", "pretrain_gpt_cpu.py")
FIGURES = ("yeto/push_bytes", "yeto/delta_norm", "yeto/base_version", "yeto/pull_lag_steps", "yeto/wait_ms",
           "yeto/staleness", "yeto/merge_weight", "yeto/outer_lr", "yeto/outer_grad_norm")


def qwen2_as_megatron_lm(tiny, tb_dir, ckpt) -> list:
    """Megatron-LM arguments of the tiny Qwen2's architecture (read from its config.json), fp32, mock data."""
    with open(os.path.join(tiny, "model", "config.json")) as f:
        c = json.load(f)
    rope = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    assert c["vocab_size"] == 512 and not c["tie_word_embeddings"]
    return ["--num-layers", str(c["num_hidden_layers"]), "--hidden-size", str(c["hidden_size"]),
            "--ffn-hidden-size", str(c["intermediate_size"]), "--num-attention-heads", str(c["num_attention_heads"]),
            "--group-query-attention", "--num-query-groups", str(c["num_key_value_heads"]), "--swiglu",
            "--normalization", "RMSNorm", "--norm-epsilon", str(c["rms_norm_eps"]), "--position-embedding-type",
            "rope", "--rotary-base", str(int(rope)), "--disable-bias-linear", "--add-qkv-bias",
            "--untie-embeddings-and-output-weights", "--hidden-dropout", "0", "--attention-dropout", "0",
            # NullTokenizer adds one token: 511 + 1 = 512 rows, a multiple of 128 (as ms-swift's TP2 pads)
            "--vocab-size", str(c["vocab_size"] - 1), "--make-vocab-size-divisible-by", "128",
            "--seq-length", "64", "--max-position-embeddings", str(c["max_position_embeddings"]),
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", str(ITERS), "--lr", "1e-3",
            "--lr-decay-style", "constant", "--mock-data", "--transformer-impl", "local", "--eval-iters", "0",
            "--eval-interval", "1000", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--distributed-backend",
            "gloo", "--log-interval", "1", "--seed", "1234", "--tensorboard-dir", str(tb_dir),
            "--save", str(ckpt), "--save-interval", "1000"]


def scalars(run_dir) -> dict:
    """{tag: [(step, value)]} of the scalars in the TensorBoard event files under run_dir."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = {}
    for d in sorted({os.path.dirname(p) for p in glob.glob(os.path.join(str(run_dir), "**", "events.out.tfevents.*"),
                                                             recursive=True)}):
        acc = EventAccumulator(d, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return out


@pytest.mark.timeout(1800)
def test_an_ms_swift_island_and_a_megatron_lm_island_end_with_one_model_and_their_figures_in_tensorboard(
        tmp_path):
    t0 = time.time()
    tiny = L.tiny_qwen2(tmp_path / "tiny")
    port, key = P.free_port(), P.key_file(tmp_path)
    syncer = P.start_syncer(tmp_path, port, islands=3, fragments=2, key=key, extra=("--init-lowest-id",))
    yeto = dict(YETO_DILOCO_SYNC_EVERY=2, YETO_DILOCO_TOTAL_STEPS=CUT)
    cmds = {name: L.swift_sft_args(tiny, tmp_path / name, tp=tp, iters=ITERS) for name, tp in SWIFT.items()}
    swifts = [L.start_swift(tmp_path, name, cmd, yeto=L.yeto_env(port, key, name, tmp_path, **yeto))
              for name, cmd in cmds.items()]
    mlm_cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), MLM_SCRIPT,
               *qwen2_as_megatron_lm(tiny, tmp_path / "b-mlm" / "tb", tmp_path / "b-mlm" / "ckpt")]
    mlm = P.Proc("b-mlm", mlm_cmd, L.launcher_env(L.yeto_env(port, key, "b-mlm", tmp_path, **yeto),
                                                  swift_site=False), str(tmp_path / "b-mlm.log"), cwd=str(tmp_path))
    procs = [*swifts, mlm, syncer]
    rcs = P.wait_all(procs, timeout=1700)
    assert rcs == [0] * len(procs), P.logs(procs)
    print(f"ms-swift TP2 and DP2 + Megatron-LM DP2 islands + syncer: {time.time() - t0:.0f}s")
    # nothing about yeto-patch on ms-swift's command line (no --external_plugins): PYTHONPATH and YETO_* only
    # (cmd[0] is the venv's `megatron` script; the project's code is reached only through PYTHONPATH)
    for cmd in cmds.values():
        assert "--external_plugins" not in cmd and not any(
            "yeto" in a.lower() or a.startswith(P.ROOT) for a in cmd[1:]), cmd
    check(tmp_path, {p.name: p.text() for p in swifts}, mlm.text(), syncer.text())


def _model(ckpt_dir) -> dict:
    return {k: v for k, v in L.dist_checkpoint(L.only_iter_dir(ckpt_dir)).items() if "optimizer" not in k}


def check(tmp_path, swift_logs: dict, mlm_log: str, syncer_log: str) -> None:
    """What the run must have left (separate from the run, to check a kept run's directory again)."""
    # the fine-tune's start is the pretrained Qwen2 (ms-swift's island initialized the run)
    assert "run initialized from island a-swift's INIT" in syncer_log, syncer_log[-3000:]
    # one model after the final cut: every launcher's checkpoint holds the syncer's final model, exactly
    final, versions = P.syncer_model(str(tmp_path / "syncer.ckpt"))
    assert versions == {0: 3, 1: 2}, versions     # H=2: fragment 0 merged at steps 1, 3, 4; fragment 1 at 2, 4
    models = {"b-mlm": per_layer(_model(tmp_path / "b-mlm" / "ckpt"))}
    for name, log in swift_logs.items():
        assert "installed the syncer's final model" in log, (name, log[-3000:])
        assert f"'iteration': '{CUT}/{CUT}'" in log, (name, log[-3000:])   # ms-swift's loop ended at the cut
        ck = checkpoint(tmp_path / name, CUT)                                 # saved there, numbered by its steps
        with open(os.path.join(ck, "latest_checkpointed_iteration.txt")) as f:
            assert f.read().strip() == str(CUT)
        assert not glob.glob(os.path.join(str(tmp_path / name), "v*", f"checkpoint-{ITERS}"))
        models[name] = per_layer(_model(ck))
    for name, m in models.items():
        assert sorted(m) == sorted(final), (name, sorted(set(m) ^ set(final)))
        for k, v in final.items():
            assert np.array_equal(m[k], v), (name, k, float(np.abs(m[k] - v).max()))
    with open(tmp_path / "b-mlm" / "ckpt" / "latest_checkpointed_iteration.txt") as f:
        assert f.read().strip() == str(CUT)
    with open(tmp_path / "tape.jsonl") as f:
        tape = [json.loads(line) for line in f if line.strip()]
    assert tape and all(sorted(r["island"] for r in t["responders"]) == ["a-swift", "b-mlm", "c-swift"]
                        for t in tape), tape
    # the loss fell on every island
    for name, log in swift_logs.items():
        ls = losses(log)
        assert len(ls) == CUT and ls[-1] < ls[0], (name, ls)
    lm = [float(m) for m in re.findall(r"lm loss: ([0-9.]+E[+-][0-9]+)", mlm_log)]
    assert len(lm) == CUT and lm[-1] < lm[0], lm

    # the islands' figures in each launcher's own TensorBoard run, beside its loss, at training iterations
    for name, run_dir, loss_tag in (("a-swift", tmp_path / "a-swift", "train/loss"),      # (<output_dir>/runs)
                                    ("c-swift", tmp_path / "c-swift", "train/loss"),
                                    ("b-mlm", tmp_path / "b-mlm" / "tb", "lm loss")):
        got = scalars(run_dir)
        assert loss_tag in got, (name, sorted(got))
        missing = [t for t in FIGURES if t not in got]
        assert not missing, (name, missing, sorted(got))
        assert all(1 <= s <= CUT for t in FIGURES for s, _ in got[t]), (name, {t: got[t] for t in FIGURES})
        assert all(v > 0 for _, v in got["yeto/push_bytes"]) and all(v > 0 for _, v in got["yeto/delta_norm"])
        assert all(0 < v <= 1 for _, v in got["yeto/merge_weight"]) and all(v >= 0 for _, v in got["yeto/staleness"])
        assert {int(v) for _, v in got["yeto/base_version"]} <= {0, 1, 2}
        print(name, {t: got[t] for t in ("yeto/push_bytes", "yeto/merge_weight", "yeto/pull_lag_steps")})

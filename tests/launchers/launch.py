"""Test helpers for the real launchers (ms-swift `megatron sft`, Megatron-Bridge `pretrain()`) on CPU: start an
island as a user would (its launcher's usual command line, with only PYTHONPATH and YETO_* added for yeto-patch),
and read what it saved. The syncer and process handling are tests/shim/procs.py's."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import numpy as np

from tests.shim import procs as P

HERE = os.path.dirname(os.path.abspath(__file__))
SITE = os.path.join(HERE, "site")            # test-only CPU start-up code (swift_stubs, CPU patches)
BRIDGE_SCRIPT = os.path.join(HERE, "scripts", "bridge_pretrain_cpu.py")
BIN = os.path.dirname(sys.executable)
OFFLINE = dict(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1, TRANSFORMERS_OFFLINE=1, TOKENIZERS_PARALLELISM="false")


def yeto_env(port, key, name, out_dir, **extra) -> dict:
    return dict(YETO_DILOCO_SYNCER=f"127.0.0.1:{port}", YETO_DILOCO_KEY_FILE=key, YETO_DILOCO_ISLAND_ID=name,
                YETO_DILOCO_METRICS=os.path.join(str(out_dir), f"metrics.{name}.jsonl"),
                YETO_DILOCO_TIMEOUT=300, **extra)


def tiny_qwen2(dir_path) -> str:
    """Writes a tiny random Qwen2 (HF format) and a local chat jsonl under dir_path (once); returns dir_path."""
    if not os.path.exists(os.path.join(dir_path, "model", "config.json")):
        subprocess.run([sys.executable, os.path.join(HERE, "scripts", "make_tiny_qwen2.py"), str(dir_path)],
                       check=True, timeout=900, capture_output=True, env=P.base_env(**OFFLINE))
    return str(dir_path)


def swift_sft_args(tiny, out_dir, tp=1, iters=6, extra=()) -> list:
    """The `megatron sft` command line of a full fine-tune of the tiny Qwen2 on CPU (gloo, fp32, local attention;
    the fusions need CUDA). Nothing in it is about yeto-patch."""
    return [os.path.join(BIN, "megatron"), "sft",
            "--model", os.path.join(tiny, "model"), "--dataset", os.path.join(tiny, "train.jsonl"),
            "--model_type", "qwen2", "--template", "qwen", "--tuner_type", "full", "--torch_dtype", "float32",
            "--fp16", "false", "--bf16", "false", "--ddp_backend", "gloo",
            "--tensor_model_parallel_size", str(tp), "--micro_batch_size", "1", "--global_batch_size", "4",
            "--train_iters", str(iters), "--max_length", "64", "--padding_free", "false",
            "--attention_backend", "local", "--masked_softmax_fusion", "false", "--bias_dropout_fusion", "false",
            "--gradient_accumulation_fusion", "false", "--cross_entropy_loss_fusion", "false",
            "--dataloader_num_workers", "0", "--check_model", "false", "--output_dir", str(out_dir),
            "--save_safetensors", "false", "--use_cpu_initialization", "true", "--seed", "42",
            "--logging_steps", "1", "--eval_iters", "0", "--split_dataset_ratio", "0", "--lr", "1e-3",
            "--lr_warmup_iters", "0", "--min_lr", "1e-3", *extra]


def launcher_env(yeto: dict, swift_site=True, **extra) -> dict:
    """The island's environment: the repository root (yeto-patch's bootstrap) first on PYTHONPATH, then (for
    ms-swift) the test-only CPU start-up code; YETO_* as given (none: a plain run). The Bridge script applies its
    CPU support itself."""
    env = P.base_env(**OFFLINE, **extra, **(yeto or {}))
    env.update(PATH=f"{BIN}:{os.environ.get('PATH', '')}")
    if swift_site:
        env.update(PYTHONPATH=f"{P.ROOT}:{SITE}", LAUNCHER_CPU="1")
    return env


def start_swift(tmp_path, name, args, yeto=None, nproc=2, **extra_env) -> P.Proc:
    env = launcher_env(yeto, NPROC_PER_NODE=nproc, MASTER_PORT=P.free_port(),
                       MODELSCOPE_CACHE=str(tmp_path / "ms_cache"), **extra_env)
    return P.Proc(name, args, env, str(tmp_path / f"{name}.log"), cwd=str(tmp_path))


def start_bridge(tmp_path, name, args, yeto=None, nproc=2) -> P.Proc:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(P.free_port()), BRIDGE_SCRIPT, *args]
    return P.Proc(name, cmd, launcher_env(yeto, swift_site=False), str(tmp_path / f"{name}.log"),
                  cwd=str(tmp_path))


def dist_checkpoint(iter_dir) -> dict:
    """{key: float32 array} of the model tensors of a megatron-core torch_dist checkpoint directory
    (iter_NNNNNNN), read in this one process whatever layout saved it (torch.distributed.checkpoint)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    out = os.path.join(os.path.dirname(str(iter_dir)), os.path.basename(str(iter_dir)) + ".pt")
    if not os.path.exists(out):
        dcp_to_torch_save(str(iter_dir), out)
    sd = torch.load(out, weights_only=False, map_location="cpu")
    return {k: v.float().numpy() for k, v in sd.items() if torch.is_tensor(v) and v.is_floating_point()}


def only_iter_dir(ckpt_dir) -> str:
    found = sorted(glob.glob(os.path.join(str(ckpt_dir), "iter_*")))
    found = [d for d in found if os.path.isdir(d)]
    assert len(found) == 1, found
    return found[0]


def assert_same(a: dict, b: dict, keys):
    for k in keys:
        assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
        assert np.array_equal(a[k], b[k]), (k, float(np.abs(a[k] - b[k]).max()))

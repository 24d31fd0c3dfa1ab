"""GPU check, one island: an ordinary single-rank megatron-core training script (knows nothing of yeto-patch).

A small GPTModel, bf16 with FP32 masters in megatron-core's DistributedOptimizer (through
get_megatron_optimizer, so a ChainedOptimizer around it), trained with get_forward_backward_func and a plain
optimizer.step() loop on deterministic, learnable token data (same formula as tests/mcore/harness.py).

--device cuda: NCCL, model on cuda:<LOCAL_RANK>, no patch of any kind.
--device cpu : gloo and the repository's TEST-ONLY CPU patches (tests/mcore/cpu_patches.py), only to debug this
               script on a machine without a GPU.

yeto-patch attaches (or not) only through PYTHONPATH (repo root with sitecustomize.py) and YETO_* variables set by
the caller. Per step it records wall time (CUDA-synchronised) and, on CUDA, torch.cuda memory figures around the
forward/backward and around optimizer.step() (where yeto-patch's boundary runs).

Writes to --out: result.json, model.npz ("master/<name>", "param/<name>", float32, global names).
Run as a single process with RANK=0 WORLD_SIZE=1 MASTER_ADDR/MASTER_PORT set (or under torchrun --nproc 1).
"""
import argparse
import datetime
import functools
import json
import os
import sys
import time
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cuda", "cpu"], required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--clip-grad", type=float, default=1e9,
                    help="default: the norm is computed but never clips, so every step allocates the same on the "
                         "GPU (megatron's clipping scales grads only when the norm exceeds the limit)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--start-barrier", default=None, help="directory: start training once --barrier-count "
                                                          "jobs are ready there")
    ap.add_argument("--barrier-count", type=int, default=2)
    ap.add_argument("--barrier-timeout", type=float, default=180)
    ap.add_argument("--dist-timeout", type=float, default=120)
    return ap.parse_args()


def init(a):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if a.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = "nccl"
    else:
        torch.set_num_threads(1)
        sys.path.insert(0, ROOT)
        from tests.mcore import cpu_patches   # TEST-ONLY; never on the GPU path
        cpu_patches.apply()
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=a.dist_timeout))
    if dist.get_world_size() != 1:
        raise SystemExit("this check script runs single-rank islands only")
    return torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else torch.device("cpu")


def build(a, dev):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_cuda_manual_seed(a.seed)
    torch.manual_seed(a.seed)
    cuda = dev.type == "cuda"
    tcfg = TransformerConfig(
        num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, ffn_hidden_size=4 * a.hidden,
        use_cpu_initialization=not cuda, bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False)
    model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=a.vocab,
                     max_sequence_length=a.seq, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=True, position_embedding_type="rope")
    if cuda:
        model.cuda(torch.cuda.current_device())
    model = Float16Module(tcfg, model)
    model = DistributedDataParallel(
        config=tcfg, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=a.lr, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16,
                        use_distributed_optimizer=True, clip_grad=a.clip_grad), [model])
    tcfg.finalize_model_grads_func = finalize_model_grads
    tcfg.grad_scale_func = optimizer.scale_loss
    return model, optimizer


def batches(a, step, dev):
    """Deterministic learnable sequences: next token = (tok * m + 1) % vocab (tests/mcore/harness.py)."""
    g = torch.Generator().manual_seed(a.data_seed * 1_000_003 + step % 4)
    n = a.micro * a.mbs
    start = torch.randint(0, a.vocab, (n, 1), generator=g)
    mult = torch.randint(1, 4, (n, 1), generator=g)
    seqs = [start]
    for _ in range(a.seq):
        seqs.append((seqs[-1] * mult + 1) % a.vocab)
    toks = torch.cat(seqs, 1).view(a.micro, a.mbs, a.seq + 1)
    return [dict(tokens=t[:, :-1].contiguous().to(dev), labels=t[:, 1:].contiguous().to(dev)) for t in toks]


def _loss_func(loss_mask, output_tensor):
    loss = torch.sum(output_tensor.float().view(-1) * loss_mask.view(-1))
    ntok = loss_mask.sum().clone().detach().to(torch.int)
    return loss, ntok, {"lm loss": torch.cat([loss.clone().detach().view(1), ntok.view(1).float()])}


def run_fb(a, model, dev, step, forward_only):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    pos = torch.arange(a.seq, device=dev).unsqueeze(0).expand(a.mbs, a.seq)
    mask = torch.ones(a.mbs, a.seq, device=dev)

    def forward_step(it, m):
        b = next(it)
        return m(b["tokens"], pos, None, labels=b["labels"]), functools.partial(_loss_func, mask)

    res = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches(a, step, dev)),
                                      model=[model], num_microbatches=a.micro, seq_length=a.seq,
                                      micro_batch_size=a.mbs, forward_only=forward_only)
    rep = torch.stack([r["lm loss"] for r in res]).sum(0).float()
    return (rep[0] / rep[1]).item()


def eval_loss(a, model, dev):
    model.eval()
    with torch.no_grad():
        out = run_fb(a, model, dev, 0, True)
    model.train()
    return out


def full_model(model, optimizer):
    """{"master/<name>", "param/<name>"}: float32 numpy of the whole model (single rank: nothing to gather)."""
    main_of = {}
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        for p in [p for b in o.buffers for p in b.params]:
            full = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
            if p in o.model_param_group_index_map:
                rng = o._get_model_param_range_map(p)["param"]
                full[rng.start:rng.end] = o._get_main_param_and_optimizer_states(p)["param"].detach().float()
            main_of[p] = full.view(p.shape)
    gpt = model
    while hasattr(gpt, "module"):
        gpt = gpt.module
    out = {}
    for name, p in gpt.named_parameters():
        if name == "output_layer.weight":   # tied: a copy of the embedding
            continue
        out["master/" + name] = main_of[p].cpu().numpy().copy()
        out["param/" + name] = p.detach().float().cpu().numpy().copy()
    return out


def wait_for_peers(directory, count, me, timeout):
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, f"ready.{me}"), "w").close()
    deadline = time.time() + timeout
    while len([n for n in os.listdir(directory) if n.startswith("ready.")]) < count:
        if time.time() > deadline:
            raise TimeoutError(f"only some of {count} jobs reached the start barrier in {directory}")
        time.sleep(0.05)


def main():
    a = parse()
    t_start = time.time()
    dev = init(a)
    cuda = dev.type == "cuda"
    model, optimizer = build(a, dev)
    setup_s = time.time() - t_start
    eval_before = eval_loss(a, model, dev)
    if a.start_barrier:
        wait_for_peers(a.start_barrier, a.barrier_count, os.path.basename(os.path.abspath(a.out)),
                       a.barrier_timeout)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    rec = {k: [] for k in ("losses", "step_s", "opt_s", "finished")}
    mem = {k: [] for k in ("alloc", "n_alloc", "bytes_alloc")}   # each: per step [start, pre_opt, end]
    mem.update(peak_fwd_bwd=[], peak_opt=[], reserved_end=[])

    def snap():
        """memory_allocated, and the allocator's cumulative count / bytes of allocations so far."""
        st = torch.cuda.memory_stats()
        return (torch.cuda.memory_allocated(), int(st.get("allocation.all.allocated", -1)),
                int(st.get("allocated_bytes.all.allocated", -1)))

    engine_finished = None
    sync()
    t_train = time.perf_counter()
    for step in range(a.steps):
        sync()
        pts = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            pts.append(snap())
        t0 = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = run_fb(a, model, dev, step, False)     # .item(): the forward/backward is done
        if cuda:
            sync()
            mem["peak_fwd_bwd"].append(torch.cuda.max_memory_allocated())
            pts.append(snap())
            torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        ok, _gn, _nz = optimizer.step()               # yeto-patch's boundary (if attached) runs in here
        sync()
        t2 = time.perf_counter()
        if cuda:
            mem["peak_opt"].append(torch.cuda.max_memory_allocated())
            pts.append(snap())
            mem["reserved_end"].append(torch.cuda.memory_reserved())
            for i, k in enumerate(("alloc", "n_alloc", "bytes_alloc")):
                mem[k].append([p[i] for p in pts])
        if not ok:
            raise RuntimeError(f"optimizer step {step + 1} skipped")
        rec["losses"].append(loss)
        rec["step_s"].append(t2 - t0)
        rec["opt_s"].append(t2 - t1)
        eng = sys.modules.get("yeto_patch.island.engine")   # the documented custom-loop check, passively
        engine_finished = bool(eng.finished()) if eng is not None else None
        rec["finished"].append(engine_finished)
        if engine_finished and step + 1 < a.steps:
            raise RuntimeError(f"yeto-patch finished early at step {step + 1} of {a.steps}")
    train_s = time.perf_counter() - t_train
    eval_after = eval_loss(a, model, dev)
    os.makedirs(a.out, exist_ok=True)
    np.savez(os.path.join(a.out, "model.npz"), **full_model(model, optimizer))
    import megatron.core
    info = dict(device=str(dev), device_name=torch.cuda.get_device_name() if cuda else "cpu",
                torch=torch.__version__, megatron_core=getattr(megatron.core, "__version__", "?"),
                backend=dist.get_backend(), optimizer=type(optimizer).__name__,
                inner=[type(o).__name__ for o in getattr(optimizer, "chained_optimizers", [])],
                params=sum(p.numel() for p in model.parameters()),
                # (sitecustomize.py registers itself as yeto_patch_sitecustomize: inert without YETO_*)
                yeto_loaded=sorted(m for m in sys.modules if m == "yeto_patch" or m.startswith("yeto_patch.")),
                setup_s=setup_s, train_s=train_s, steps=a.steps)
    with open(os.path.join(a.out, "result.json"), "w") as f:
        json.dump(dict(info, eval_before=eval_before, eval_after=eval_after, engine_finished=engine_finished,
                       memory=mem if cuda else None, **rec), f)
    print(f"island {os.path.basename(a.out)}: loss {rec['losses'][0]:.4f} -> {rec['losses'][-1]:.4f}, eval "
          f"{eval_before:.4f} -> {eval_after:.4f}, {train_s:.2f}s for {a.steps} steps, finished={engine_finished}",
          flush=True)
    from megatron.core import parallel_state as ps
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

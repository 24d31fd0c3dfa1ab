"""Train a small GPT with megatron-core on byte-level text: an ordinary megatron-core training script.

GPTModel + DistributedDataParallel + get_megatron_optimizer (DistributedOptimizer), bf16, a
get_forward_backward_func loop, tensor / pipeline / data parallel layout from flags.  Launch it with torchrun:

    torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --tensor-model-parallel-size 2 \
        --train-iters 200 --log-jsonl out/losses.jsonl --save-npz out/model.npz

Data: byte-level text (vocabulary 256), by default the Python standard library's own sources, split by document
into ``--num-shards`` training shards and a held-out shard (see byte_corpus.py); ``--shards 0`` trains on shard 0
only, ``--shards 0,1`` on both (each contributing half of every global batch).  The held-out loss is evaluated
before training, every ``--eval-interval`` steps and at the end.

Without a GPU (``--device auto`` on a machine without one, or ``--device cpu``) the script runs on CPU over gloo
and applies the repository's test-only CPU support for megatron-core (tests/mcore/cpu_patches.py, found relative
to this file, or ``--cpu-patches PATH``).

Outputs (written by global rank 0):
* ``--log-jsonl``: one JSON object per line: ``{"event": "start", ...}``, ``{"event": "train", "step", "loss",
  "lr", "grad_norm", "skipped", "tokens", "elapsed_s", "step_s", "opt_s"}`` (opt_s: the optimizer step,
  with whatever hooks a tool attached to it), ``{"event": "eval", "step", "heldout_loss"}``,
  ``{"event": "end", ...}``.
* ``--save DIR --save-interval N``: a checkpoint every N steps (and after the last one) that ``--load DIR`` resumes:
  ``DIR/iter_<step:07d>/model.npz`` in the ``--snapshot`` format (FP32 masters, weights, Adam moments and step,
  layout-independent names), each written to a temporary folder and renamed, then ``DIR/latest`` (the step,
  replaced atomically) once the checkpoint is complete. ``--load DIR`` resumes from DIR's latest checkpoint
  (weights, FP32 masters, Adam state, LR schedule position and data position: training continues at the next
  step; the JSONL log is appended to); with no checkpoint there yet it is a fresh start.
  With yeto-patch attached (PYTHONPATH + YETO_* variables), every rank tells it about each checkpoint through
  ``yeto_patch.hooks.checkpoint_saved`` (before ``latest`` names it: the island's sync state goes beside it, in
  ``DIR/yeto_sync/``) and ``checkpoint_loaded`` (before the first step: the island resumes its DiLoCo rounds where
  the checkpoint left them). Without yeto-patch these calls are skipped or do nothing: a plain loop with
  checkpoints.
* ``--save-npz``: the final model, full (un-sharded) parameters as float32 keyed by a layout-independent name
  (``decoder.layers.<global index>...``): ``param/<name>`` are the model's weights, ``master/<name>`` the
  optimizer's FP32 master weights when the optimizer keeps them.
"""
import argparse
import datetime
import functools
import importlib.util
import io
import json
import os
import sys
import time
import warnings
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
warnings.filterwarnings("ignore")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from byte_corpus import VOCAB, ByteCorpus  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    g.add_argument("--seq-length", type=int, default=128)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--tie-embeddings", action="store_true",
                   help="share the input embedding with the output layer (GPTModel's default is untied)")
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", "--pp", type=int, default=1)
    g.add_argument("--no-distributed-optimizer", action="store_true")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--cpu-patches", default=os.path.join(os.path.dirname(HERE), "tests", "mcore", "cpu_patches.py"),
                   help="test-only CUDA-to-CPU patches for megatron-core, applied when running on CPU")
    g.add_argument("--dist-timeout-minutes", type=float, default=10.0)
    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=200)
    g.add_argument("--micro-batch-size", type=int, default=4)
    g.add_argument("--global-batch-size", type=int, default=8)
    g.add_argument("--lr", type=float, default=3e-3)
    g.add_argument("--min-lr", type=float, default=3e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=20)
    g.add_argument("--lr-decay-style", default="cosine", choices=["constant", "linear", "cosine"])
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--fp32", action="store_true", help="train in float32 (default: bf16 with FP32 masters)")
    g.add_argument("--seed", type=int, default=1234, help="model initialisation seed")
    g = p.add_argument_group("data")
    g.add_argument("--text", default=None, help="a text file or folder (default: the Python standard library)")
    g.add_argument("--num-shards", type=int, default=1, help="training shards the text is split into")
    g.add_argument("--shards", default="0", help="comma-separated training shards this run reads")
    g.add_argument("--heldout-frac", type=float, default=0.05)
    g.add_argument("--data-seed", type=int, default=0)
    g = p.add_argument_group("evaluation and output")
    g.add_argument("--eval-interval", type=int, default=50, help="0: only before and after training")
    g.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences per evaluation")
    g.add_argument("--log-interval", type=int, default=10, help="print every N steps (JSONL gets every step)")
    g.add_argument("--log-jsonl", default=None)
    g.add_argument("--save-npz", default=None)
    g.add_argument("--snapshot-at", type=int, default=0,
                   help="after this many steps also write --snapshot: a training state that --init-from resumes")
    g.add_argument("--snapshot", default=None, help="where --snapshot-at writes (npz: FP32 masters, model weights, "
                   "Adam moments and step count, layout-independent names)")
    g.add_argument("--init-from", default=None,
                   help="start from a --snapshot written after step K (by any layout): weights, FP32 masters, Adam "
                        "state and the LR schedule position are restored; training runs steps K+1..--train-iters")
    g = p.add_argument_group("checkpoints (resume after a crash)")
    g.add_argument("--save", default=None, metavar="DIR", help="write a checkpoint into DIR every --save-interval "
                   "steps and after the last step")
    g.add_argument("--save-interval", type=int, default=0, metavar="N")
    g.add_argument("--load", default=None, metavar="DIR", help="resume from DIR's latest checkpoint (none there "
                   "yet: a fresh start, with --init-from if given)")
    a = p.parse_args(argv)
    if bool(a.save) != bool(a.save_interval):
        p.error("--save and --save-interval go together")
    if a.save_interval < 0:
        p.error("--save-interval must be positive")
    if bool(a.snapshot_at) != bool(a.snapshot):
        p.error("--snapshot-at and --snapshot go together")
    if a.snapshot_at and not 0 < a.snapshot_at <= a.train_iters:
        p.error(f"--snapshot-at must be in 1..--train-iters ({a.train_iters})")
    a.shards = [int(s) for s in str(a.shards).split(",") if s.strip() != ""]
    if not a.shards or any(not 0 <= s < a.num_shards for s in a.shards):
        p.error(f"--shards {a.shards} must name shards in 0..{a.num_shards - 1}")
    if a.ffn_hidden_size is None:
        a.ffn_hidden_size = 4 * a.hidden_size
    return a


def load_cpu_patches(path):
    if not os.path.isfile(path):
        raise SystemExit(f"running on CPU needs megatron-core's CPU patches; not found: {path} (--cpu-patches)")
    spec = importlib.util.spec_from_file_location("mcore_cpu_patches", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.apply()


def init_distributed(a):
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if "RANK" not in os.environ:  # a plain `python train_gpt.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        load_cpu_patches(a.cpu_patches)
    dist.init_process_group("nccl" if use_cuda else "gloo",
                            timeout=datetime.timedelta(minutes=a.dist_timeout_minutes))
    return torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")


def padded_vocab(a):
    m = a.make_vocab_size_divisible_by * a.tensor_model_parallel_size
    return ((VOCAB + m - 1) // m) * m


def build(a, use_cuda):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tensor_model_parallel_size=a.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=a.pipeline_model_parallel_size)
    torch.manual_seed(a.seed)
    model_parallel_cuda_manual_seed(a.seed)
    bf16 = not a.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    cfg = TransformerConfig(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        ffn_hidden_size=a.ffn_hidden_size, use_cpu_initialization=not use_cuda, bf16=bf16, params_dtype=dtype,
        pipeline_dtype=dtype, tensor_model_parallel_size=a.tensor_model_parallel_size,
        pipeline_model_parallel_size=a.pipeline_model_parallel_size, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.02, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False, bias_dropout_fusion=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=padded_vocab(a),
                     max_sequence_length=a.seq_length, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage(), position_embedding_type="rope",
                     share_embeddings_and_output_weights=a.tie_embeddings)
    if use_cuda:
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(cfg, model)
    dist_opt = not a.no_distributed_optimizer
    model = DistributedDataParallel(
        config=cfg, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt))
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=a.lr, min_lr=a.min_lr, weight_decay=a.weight_decay, bf16=bf16,
                        params_dtype=dtype, use_distributed_optimizer=dist_opt, clip_grad=a.clip_grad,
                        adam_beta1=0.9, adam_beta2=a.adam_beta2),
        [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=a.lr, min_lr=a.min_lr,
        lr_warmup_steps=min(a.lr_warmup_iters, max(a.train_iters - 1, 0)), lr_decay_steps=max(a.train_iters, 1), lr_decay_style=a.lr_decay_style, start_wd=a.weight_decay,
        end_wd=a.weight_decay, wd_incr_steps=max(a.train_iters, 1), wd_incr_style="constant")
    cfg.finalize_model_grads_func = finalize_model_grads
    cfg.grad_scale_func = optimizer.scale_loss
    return model, optimizer, scheduler


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss = torch.sum(losses * loss_mask.view(-1))
    ntok = loss_mask.sum().to(torch.int)
    return loss, ntok, {"lm loss": torch.stack([loss.detach(), ntok.detach().float()])}


def make_forward_step(device, seq_length):
    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        tokens, labels = tokens.to(device), labels.to(device)
        pos = torch.arange(seq_length, device=device).unsqueeze(0).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)
        return out, functools.partial(loss_func, torch.ones_like(labels, dtype=torch.float32))
    return forward_step


def micro_batches(rows, mbs):
    t = torch.from_numpy(rows)
    for i in range(0, t.shape[0], mbs):
        mb = t[i: i + mbs]
        yield mb[:, :-1].contiguous(), mb[:, 1:].contiguous()


def reduce_loss(reports, device):
    """Mean loss over the whole global batch, known on every rank (the last stage's TP-rank-0 ranks hold it)."""
    from megatron.core import parallel_state as ps
    rep = torch.zeros(2, dtype=torch.float64, device=device)
    if ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0:
        for r in reports:
            rep += r["lm loss"].to(device=device, dtype=torch.float64)
    dist.all_reduce(rep)
    return (rep[0] / rep[1]).item() if rep[1] > 0 else float("nan")


def evaluate(model, fb, forward_step, rows, a, device):
    from megatron.core import parallel_state as ps
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per = rows.shape[0] // dp
    mine = rows[r * per: (r + 1) * per]
    model.eval()
    with torch.no_grad():
        reports = fb(forward_step_func=forward_step, data_iterator=micro_batches(mine, a.micro_batch_size),
                     model=[model], num_microbatches=per // a.micro_batch_size, seq_length=a.seq_length,
                     micro_batch_size=a.micro_batch_size, forward_only=True)
    model.train()
    return reduce_loss(reports, device)


def _layer_index_map(gpt):
    """local parameter name -> layout-independent name (global layer index instead of the stage-local one)."""
    out = {}
    for name, p in gpt.named_parameters():
        out[name] = name
    if getattr(gpt, "decoder", None) is not None:
        for i, layer in enumerate(gpt.decoder.layers):
            for n, _ in layer.named_parameters():
                out[f"decoder.layers.{i}.{n}"] = f"decoder.layers.{layer.layer_number - 1}.{n}"
    return out


def _distrib_optimizer_of(optimizer, p):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(o, DistributedOptimizer) and p in {q for b in o.buffers for q in b.params}:
            return o
    return None


def _full_master(optimizer, p, state="param"):
    """FP32 master of model param p (TP-local shape) assembled over the data-parallel group, or None if the
    optimizer keeps no FP32 master for it.  state="exp_avg" / "exp_avg_sq": the Adam moment instead (zeros
    before the first step; DistributedOptimizer only)."""
    o = _distrib_optimizer_of(optimizer, p)
    if o is not None:
        out = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        if p in o.model_param_gbuf_map and p in o.model_param_group_index_map:
            rng = o._get_model_param_range_map(p)["param"]
            t = o._get_main_param_and_optimizer_states(p).get(state)
            if t is not None:
                out[rng.start: rng.end] = t.detach().float().view(-1)
        dist.all_reduce(out, group=o.data_parallel_group)
        return out.view(p.shape)
    if state != "param":
        return None
    mp = getattr(p, "main_param", None)
    if torch.is_tensor(mp) and mp.numel() == p.numel() and not getattr(p, "main_param_sharded", False):
        return mp.detach().float().view(p.shape)
    return None


ADAM_STATES = ("exp_avg", "exp_avg_sq")


def _adam_step(optimizer, device):
    """Adam's step count (the same for every parameter), agreed over all ranks."""
    n = 0
    for o in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(o, "optimizer", None)
        for st in (getattr(inner, "state", None) or {}).values():
            if "step" in st:
                n = max(n, int(float(st["step"])))
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _tp_full(t, p):
    from megatron.core import parallel_state as ps
    if not getattr(p, "tensor_model_parallel", False) or ps.get_tensor_model_parallel_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, t.contiguous(), group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=p.partition_dim)


def gather_full_model(model, optimizer, vocab, optimizer_state=False):
    """{name: float32 numpy} of the whole model on global rank 0 (None elsewhere). Every rank must call it.
    optimizer_state: also the Adam moments (``exp_avg/<name>``, ``exp_avg_sq/<name>``)."""
    from megatron.core import parallel_state as ps
    gpt = model
    while hasattr(gpt, "module"):
        gpt = gpt.module
    names = _layer_index_map(gpt)
    tied_copy = gpt.share_embeddings_and_output_weights and not gpt.pre_process
    mine = {}
    # Iterate the DDP buffers' parameter order (identical on the ranks of a data-parallel group).
    params = [q for b in model.buffers for q in b.params] if hasattr(model, "buffers") else []
    seen = set(params)
    params += [q for q in gpt.parameters() if q not in seen]
    local_name = {q: n for n, q in gpt.named_parameters()}
    for p in params:
        n = local_name[p]
        if tied_copy and n == "output_layer.weight":
            continue
        gname = names[n]
        master = _full_master(optimizer, p)
        kinds = [("param", p.detach().float()), ("master", master)]
        if optimizer_state:
            kinds += [(k, _full_master(optimizer, p, k)) for k in ADAM_STATES]
        for kind, t in kinds:
            if t is None:
                continue
            full = _tp_full(t, p)
            if gname in ("embedding.word_embeddings.weight", "output_layer.weight"):
                full = full[:vocab]  # drop Megatron's vocabulary padding
            mine[f"{kind}/{gname}"] = full.cpu().numpy()
    # Ship every stage's share to rank 0: (tp 0, dp 0) of each pipeline stage is a source. Tensors travel on the
    # model's device (NCCL needs CUDA tensors; gloo takes CPU ones).
    dev = next(model.parameters()).device
    is_src = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=dev)
    flags[dist.get_rank()] = int(is_src)
    dist.all_reduce(flags)
    out = dict(mine) if dist.get_rank() == 0 else None
    for src in [int(i) for i in torch.nonzero(flags.cpu()).view(-1) if int(i) != 0]:
        if dist.get_rank() == src:
            header = json.dumps([[k, list(v.shape)] for k, v in mine.items()]).encode()
            dist.send(torch.tensor([len(header)], dtype=torch.int64, device=dev), 0)
            dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(dev), 0)
            for v in mine.values():
                dist.send(torch.from_numpy(np.ascontiguousarray(v)).to(dev), 0)
        elif dist.get_rank() == 0:
            n = torch.zeros(1, dtype=torch.int64, device=dev)
            dist.recv(n, src)
            buf = torch.zeros(int(n.item()), dtype=torch.uint8, device=dev)
            dist.recv(buf, src)
            for k, shape in json.loads(bytes(buf.cpu().numpy()).decode()):
                t = torch.zeros(shape, dtype=torch.float32, device=dev)
                dist.recv(t, src)
                out[k] = t.cpu().numpy()
    return out


VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _local_part(full, p, gname, vocab, current):
    """The TP-local part (p's shape) of a full, un-padded float32 array; rows past the vocabulary (Megatron's
    padding) keep `current`."""
    from megatron.core import parallel_state as ps
    t = torch.from_numpy(np.ascontiguousarray(full)).float()
    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    split = bool(getattr(p, "tensor_model_parallel", False)) and tp > 1
    padded = gname in VOCAB_PARAMS
    if padded:
        rows = p.shape[0] * (tp if split else 1)
        if rows > t.shape[0]:
            t = torch.cat([t, torch.zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])
    if split:
        t = t.chunk(tp, dim=p.partition_dim)[r]
    t = t.reshape(p.shape).clone()
    if padded:
        first = r * p.shape[0] if split else 0
        keep = max(0, min(p.shape[0], first + p.shape[0] - vocab))
        if keep:
            t[p.shape[0] - keep:] = current.reshape(p.shape)[p.shape[0] - keep:].float().cpu()
    return t.to(p.device)


def load_snapshot(path, model, optimizer, vocab):
    """Restore a --snapshot into this run (any layout): model weights, FP32 masters, Adam moments and step.
    Returns the step the snapshot was taken after."""
    arrays = read_npz(path)
    step, adam_step = int(arrays["meta/step"]), int(arrays["meta/adam_step"])
    gpt = model
    while hasattr(gpt, "module"):
        gpt = gpt.module
    names = _layer_index_map(gpt)
    tied_copy = gpt.share_embeddings_and_output_weights and not gpt.pre_process
    from torch.optim.optimizer import _get_scalar_dtype
    for n, p in gpt.named_parameters():
        g = "embedding.word_embeddings.weight" if tied_copy and n == "output_layer.weight" else names[n]
        if f"param/{g}" not in arrays:
            raise SystemExit(f"--init-from {path}: no parameter {g} (a different model?)")
        o = _distrib_optimizer_of(optimizer, p)
        if o is None:
            raise SystemExit("--init-from needs the DistributedOptimizer (drop --no-distributed-optimizer)")
        with torch.no_grad():
            master = _local_part(arrays.get(f"master/{g}", arrays[f"param/{g}"]), p, g, vocab, p.detach())
            p.data.copy_(_local_part(arrays[f"param/{g}"], p, g, vocab, p.detach()).to(p.dtype))
            if p in o.model_param_gbuf_map and p in o.model_param_group_index_map:
                rng = o._get_model_param_range_map(p)["param"]
                gi, go = o.model_param_group_index_map[p]
                main = o.optimizer.param_groups[gi]["params"][go]
                main.data.copy_(master.view(-1)[rng.start: rng.end].view_as(main))
                st = o.optimizer.state[main]
                zero = torch.zeros_like(p, dtype=torch.float32)
                for k in ADAM_STATES:
                    if f"{k}/{g}" not in arrays:
                        raise SystemExit(f"--init-from {path}: no Adam state {k} for {g}")
                    st[k] = _local_part(arrays[f"{k}/{g}"], p, g, vocab, zero).view(-1)[
                        rng.start: rng.end].view_as(main).to(main.dtype).clone()
                st["step"] = torch.tensor(float(adam_step), dtype=_get_scalar_dtype())
    return step


def save_npz(path, arrays):
    """np.savez without pickle, written to a temporary file and renamed (readers never see half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as z:
        for k in sorted(arrays):
            b = io.BytesIO()
            np.lib.format.write_array(b, np.ascontiguousarray(arrays[k]), allow_pickle=False)
            z.writestr(k + ".npy", b.getvalue())
    os.replace(tmp, path)


def read_npz(path, prefix=""):
    """{name: array} of an npz written by save_npz (no pickle); only the names starting with `prefix`."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            if n.startswith(prefix):
                with z.open(n) as f:
                    out[n[:-4]] = np.lib.format.read_array(f, allow_pickle=False)
    return out


def write_snapshot(path, model, optimizer, device, step, **meta):
    """Every rank: gather the training state (weights, FP32 masters, Adam moments and step) and write it to
    `path` on rank 0 (the --snapshot format; `meta`: more ``meta/<name>`` scalars)."""
    arrays = gather_full_model(model, optimizer, VOCAB, optimizer_state=True)
    adam_step = _adam_step(optimizer, device)
    if dist.get_rank() == 0:
        arrays["meta/step"] = np.array(step, dtype=np.int64)
        arrays["meta/adam_step"] = np.array(adam_step, dtype=np.int64)
        for k, v in meta.items():
            arrays[f"meta/{k}"] = np.array(v)
        save_npz(path, arrays)


LATEST = "latest"


def checkpoint_dir(root, step):
    return os.path.join(root, f"iter_{int(step):07d}")


def latest_checkpoint(root):
    """(step, model.npz path) of the checkpoint `root`'s ``latest`` names, or None when there is none yet."""
    if not root:
        return None
    try:
        with open(os.path.join(root, LATEST)) as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise SystemExit(f"--load {root}: {LATEST} holds {text[:40]!r}, not a step")
    path = os.path.join(checkpoint_dir(root, int(text)), "model.npz")
    if not os.path.isfile(path):
        raise SystemExit(f"--load {root}: {LATEST} names step {text} but {path} does not exist")
    return int(text), path


def save_checkpoint(root, step, model, optimizer, device, yeto, yeto_iteration, **meta):
    """Every rank: the checkpoint of `step` into root/iter_<step>/ (written beside and renamed), then yeto-patch's
    sync state beside it (every rank; `yeto`: yeto_patch.hooks or None), then root/latest (replaced atomically):
    `latest` names only complete checkpoints."""
    final = checkpoint_dir(root, step)
    tmp = f"{final}.tmp"
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)
        for d in (tmp, final):   # (a half-written one, or one written before a crash that `latest` never named)
            if os.path.isdir(d):
                import shutil
                shutil.rmtree(d)
        os.makedirs(tmp)
    write_snapshot(os.path.join(tmp, "model.npz"), model, optimizer, device, step, **meta)
    if dist.get_rank() == 0:
        os.replace(tmp, final)
    dist.barrier()
    if yeto is not None:
        yeto.checkpoint_saved(root, yeto_iteration)
    if dist.get_rank() == 0:
        marker = os.path.join(root, f"{LATEST}.tmp{os.getpid()}")
        with open(marker, "w") as f:
            f.write(f"{step}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(marker, os.path.join(root, LATEST))
    dist.barrier()


def yeto_hooks():
    """yeto_patch.hooks (its checkpoint API, inert where yeto-patch is not attached) when it can be imported."""
    try:
        from yeto_patch import hooks
    except ImportError:
        return None
    return hooks if hasattr(hooks, "checkpoint_saved") else None   # (a release before the API: nothing to tell)


class JsonlLog:
    def __init__(self, path, append=False):
        self.f = None
        if path and dist.get_rank() == 0:
            os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
            self.f = open(path, "a" if append else "w", buffering=1)

    def __call__(self, **rec):
        if self.f is not None:
            self.f.write(json.dumps(rec) + "\n")


def main(argv=None):
    a = parse_args(argv)
    t0 = time.time()
    device = init_distributed(a)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rank, world = dist.get_rank(), dist.get_world_size()
    mp = a.tensor_model_parallel_size * a.pipeline_model_parallel_size
    if world % mp:
        raise SystemExit(f"world size {world} is not divisible by TP x PP = {mp}")
    dp = world // mp
    if a.global_batch_size % (dp * a.micro_batch_size):
        raise SystemExit(f"--global-batch-size {a.global_batch_size} must be a multiple of data-parallel size "
                         f"{dp} x --micro-batch-size {a.micro_batch_size}")
    if a.eval_seqs % (dp * a.micro_batch_size):
        raise SystemExit(f"--eval-seqs {a.eval_seqs} must be a multiple of {dp} x {a.micro_batch_size}")
    corpus = ByteCorpus(a.text, num_shards=a.num_shards, heldout_frac=a.heldout_frac, seed=a.data_seed)
    heldout = corpus.heldout_windows(a.eval_seqs, a.seq_length)
    model, optimizer, scheduler = build(a, device.type == "cuda")
    dp_rank = ps.get_data_parallel_rank()
    per_dp = a.global_batch_size // dp
    n_micro = per_dp // a.micro_batch_size
    fb = get_forward_backward_func()
    forward_step = make_forward_step(device, a.seq_length)
    resume = latest_checkpoint(a.load)   # (step, path) of --load's latest checkpoint, None: a fresh start
    yeto = yeto_hooks()
    log = JsonlLog(a.log_jsonl, append=resume is not None)
    tokens_per_step = a.global_batch_size * a.seq_length

    def say(msg):
        if rank == 0:
            print(msg, flush=True)

    n_local = sum(p.numel() * (ps.get_tensor_model_parallel_world_size()
                               if getattr(p, "tensor_model_parallel", False) else 1)
                  for p in model.parameters()) if ps.get_tensor_model_parallel_rank() == 0 and dp_rank == 0 else 0
    n_params = torch.tensor([n_local], dtype=torch.int64, device=device)
    dist.all_reduce(n_params)
    n_params = int(n_params.item())
    layout = dict(tp=a.tensor_model_parallel_size, pp=a.pipeline_model_parallel_size, dp=dp, world=world)
    say(f"train_gpt: {n_params / 1e6:.2f}M parameters, layout {layout}, {'fp32' if a.fp32 else 'bf16'}, "
        f"{type(optimizer).__name__}[{', '.join(type(o).__name__ for o in getattr(optimizer, 'chained_optimizers', []))}], "
        f"{tokens_per_step} tokens/step, shards {a.shards} of {a.num_shards}, device {device}, "
        f"set-up {time.time() - t0:.1f}s")
    log(event="start", layout=layout, params=n_params, tokens_per_step=tokens_per_step, train_iters=a.train_iters,
        shards=a.shards, num_shards=a.num_shards, corpus=corpus.describe(), precision="fp32" if a.fp32 else "bf16",
        optimizer=type(optimizer).__name__, setup_s=round(time.time() - t0, 3), time=time.time())

    def run_eval(step):
        t = time.time()
        loss = evaluate(model, fb, forward_step, heldout, a, device)
        log(event="eval", step=step, heldout_loss=loss, eval_s=round(time.time() - t, 3),
            elapsed_s=round(time.time() - t0, 3))
        say(f"step {step:5d} | held-out loss {loss:.4f}")
        return loss

    start, first_step, initial = 0, 0, None   # first_step: where this run's training began (--init-from's step)
    if resume is not None:
        start, path = resume
        if load_snapshot(path, model, optimizer, VOCAB) != start or not 0 < start <= a.train_iters:
            raise SystemExit(f"--load {a.load}: its checkpoint {path} is not of step {start} within --train-iters")
        meta = read_npz(path, "meta/")
        first_step = int(meta.get("meta/first_step", 0))
        if "meta/initial_heldout_loss" in meta:
            initial = float(meta["meta/initial_heldout_loss"])
        scheduler.step(increment=start)  # the same position of the same LR schedule
        say(f"resumed from {path} after step {start} (weights, FP32 masters, Adam state, LR schedule)")
        log(event="resume", step=start, path=os.path.abspath(path), lr=optimizer.param_groups[0]["lr"],
            checkpoint=True, time=time.time())
        if yeto is not None:   # before the first step: the island resumes its rounds from the sync state
            yeto.checkpoint_loaded(a.load, start - first_step)
    elif a.init_from:
        start = first_step = load_snapshot(a.init_from, model, optimizer, VOCAB)
        if not 0 < start < a.train_iters:
            raise SystemExit(f"--init-from {a.init_from}: taken after step {start}, not within --train-iters")
        scheduler.step(increment=start)  # the same position of the same LR schedule
        say(f"resumed from {a.init_from} after step {start} (weights, FP32 masters, Adam state, LR schedule)")
        log(event="resume", step=start, path=os.path.abspath(a.init_from), lr=optimizer.param_groups[0]["lr"])
    if initial is None:
        initial = run_eval(start)
    tokens = 0
    t_train = time.time()
    for it in range(start, a.train_iters):
        ts = time.time()
        rows = corpus.global_batch(a.shards, it, a.global_batch_size, a.seq_length)[dp_rank * per_dp:(dp_rank + 1) * per_dp]
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = fb(forward_step_func=forward_step, data_iterator=micro_batches(rows, a.micro_batch_size),
                     model=[model], num_microbatches=n_micro, seq_length=a.seq_length,
                     micro_batch_size=a.micro_batch_size, forward_only=False)
        to = time.time()
        ok, grad_norm, _ = optimizer.step()
        opt_s = time.time() - to
        if ok:
            scheduler.step(increment=1)
            tokens += tokens_per_step
        loss = reduce_loss(reports, device)
        step = it + 1
        lr = optimizer.param_groups[0]["lr"]
        log(event="train", step=step, loss=loss, lr=lr, grad_norm=None if grad_norm is None else float(grad_norm),
            skipped=not ok, tokens=tokens, elapsed_s=round(time.time() - t0, 3), step_s=round(time.time() - ts, 4),
            opt_s=round(opt_s, 5))
        if a.log_interval and (step % a.log_interval == 0 or step == a.train_iters):
            say(f"step {step:5d} | loss {loss:.4f} | lr {lr:.2e} | {time.time() - ts:.3f}s/step")
        if a.eval_interval and step % a.eval_interval == 0 and step != a.train_iters:
            run_eval(step)
        if step == a.snapshot_at:
            write_snapshot(a.snapshot, model, optimizer, device, step)
            say(f"snapshot after step {step} written to {a.snapshot}")
        if a.save and (step % a.save_interval == 0 or step == a.train_iters):
            tc = time.time()
            # (yeto-patch counts the steps since this run's training began: --init-from's step is its 0)
            save_checkpoint(a.save, step, model, optimizer, device, yeto, step - first_step, first_step=first_step,
                            initial_heldout_loss=initial)
            log(event="checkpoint", step=step, path=os.path.abspath(checkpoint_dir(a.save, step)),
                save_s=round(time.time() - tc, 3), elapsed_s=round(time.time() - t0, 3))
            say(f"checkpoint after step {step} written to {checkpoint_dir(a.save, step)}")
    train_s = time.time() - t_train
    final = run_eval(a.train_iters)
    if a.save_npz:
        arrays = gather_full_model(model, optimizer, VOCAB)
        if rank == 0:
            save_npz(a.save_npz, arrays)
            say(f"saved {len([k for k in arrays if k.startswith('param/')])} parameters to {a.save_npz}")
    log(event="end", step=a.train_iters, start_step=start, initial_heldout_loss=initial, final_heldout_loss=final, tokens=tokens,
        train_s=round(train_s, 3), elapsed_s=round(time.time() - t0, 3))
    dist.barrier()
    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""TEST-ONLY monkeypatches to run real megatron-core on CPU with gloo (never imported by yeto_patch).

Supported: megatron-core 0.19.2 (Python 3.12, torch 2.13.0 registry build, which runs on CPU without a driver:
torch.cuda.is_available() is False, so every torch.cuda.* runtime call would raise "Found no NVIDIA driver")
and megatron-core 0.16.1 (Python 3.11, torch 2.13.0+cpu).  Line numbers in comments refer to the 0.19.2 wheel
unless noted.

How this was found (a measured recipe, not guesswork): tiny GPTModels (local layer specs, fp32 or bf16, MoE with
SequentialMLP) with DDP and the DistributedOptimizer were trained on 4 gloo processes (TP2xDP2, PP2xTP2, EP2,
TP2xEP2), and every CUDA-only call that failed was patched at the site where it was hit; each numbered block in
apply() names that site. parallel_state.initialize_model_parallel itself needs no patch. With them, losses fall in
every layout and TP2xDP2 matches a single process to 4 decimals; full recompute, sequence parallel,
overlap_grad_reduce and overlap_param_gather work. One module serves both releases. What cannot run on CPU at all:
Transformer Engine specs, context parallel > 1, moe_grouped_gemm, fp8/fp4, CUDA graphs. A known upstream bug: MoE
with TP2, expert-TP1, EP1 gives wrong expert gradients (expert params keep allreduce=True), so MoE tests use EP > 1.
In torch 2.13 the TorchFunctionMode of (3) is popped inside torch.autograd.backward; backward re-enters it.

Call apply() in every worker process BEFORE building models/optimizers (before or after
torch.distributed.init_process_group; megatron.core must be importable).
Set MCORE_CPU_TRACE=1 to print (once per call-site) every place in megatron that hit a patch.
Set MCORE_CPU_SKIP=name1,name2 to leave out named patches (ablation); names:
  jit_fuser, rng, cuda_api, moe_te_gemm, moe_split_numpy, torch_norm_sp, mode, hdo_cpu, gloo_uneven
"""
import contextlib
import os
import sys
import torch
from torch.overrides import TorchFunctionMode

_APPLIED = False
_SKIP = set(filter(None, os.environ.get("MCORE_CPU_SKIP", "").split(",")))
_TRACE = os.environ.get("MCORE_CPU_TRACE") == "1"
_SEEN = set()


def _trace(what):
    if not _TRACE:
        return
    f = sys._getframe(2)
    while f is not None and "megatron" not in f.f_code.co_filename:
        f = f.f_back
    if f is None:
        return
    fn = f.f_code.co_filename
    fn = fn[fn.index("megatron/"):]
    key = (what, fn, f.f_lineno)
    if key not in _SEEN:
        _SEEN.add(key)
        print(f"[cpu_patch] {what:28s} {fn}:{f.f_lineno}", file=sys.stderr, flush=True)


def _is_cuda_dev(d):
    if d is None or isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # bare ints are CUDA ordinals
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


def _run_backward_keeping_mode(mode, tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                               inputs=None):
    """torch.autograd.backward() (torch>=2.1x) dispatches through __torch_function__, and a mode is popped
    while its handler runs -> the whole backward pass (incl. activation-recompute forward in
    megatron CheckpointFunction.backward) would run WITHOUT this mode. Re-implement the thin wrapper
    and run the engine with the mode pushed again."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if inputs is None:
        inputs_t = ()
    else:
        inputs_t = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    with mode:
        g = _tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
        g = _make_grads(tensors, g, is_grads_batched=False)
        if retain_graph is None:
            retain_graph = create_graph
        _engine_run_backward(tensors, g, retain_graph, create_graph, inputs_t,
                             allow_unreachable=True, accumulate_grad=True)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites device='cuda'/device=<int> to 'cpu' in every torch call, makes Tensor.cuda() a no-op,
    and makes Tensor.type() report 'torch.cuda.*Tensor' (megatron's optimizers check that string)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_dev(kwargs["device"]):
            _trace(f"device={kwargs['device']!r}")
            kwargs["device"] = "cpu"
        if func is torch.autograd.backward:
            return _run_backward_keeping_mode(self, *args, **kwargs)
        if func is torch.Tensor.backward:
            t, rest = args[0], args[1:]
            names = ("grad_tensors", "retain_graph", "create_graph", "inputs")
            kw = dict(zip(names, rest))
            kw.update({("grad_tensors" if k == "gradient" else k): v for k, v in kwargs.items()})
            return _run_backward_keeping_mode(self, t, **kw)
        if func is torch.Tensor.cuda:
            _trace("Tensor.cuda()")
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_dev(args[1]) and not isinstance(args[1], int):
            _trace("Tensor.to('cuda')")
            args = (args[0], "cpu") + tuple(args[2:])
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            s = func(*args)
            if not s.startswith("torch.cuda."):
                _trace("Tensor.type()")
                s = s.replace("torch.", "torch.cuda.", 1)
            return s
        return func(*args, **kwargs)


class _FakeStream:
    def __init__(self, *a, **k): _trace("torch.cuda.Stream")
    def wait_stream(self, *a, **k): pass
    def wait_event(self, *a, **k): pass
    def record_event(self, *a, **k): return _FakeEvent()
    def synchronize(self): pass
    def query(self): return True


class _FakeEvent:
    def __init__(self, *a, **k): _trace("torch.cuda.Event")
    def record(self, *a, **k): pass
    def wait(self, *a, **k): pass
    def synchronize(self): pass
    def query(self): return True
    def elapsed_time(self, *a): return 0.0


def _stub(name, ret=None, fn=None):
    def f(*a, **k):
        _trace(name if name.startswith("(") else f"torch.cuda.{name}")
        return fn(*a, **k) if fn is not None else ret
    return f


def _patch_torch_norm_for_sequence_parallel():
    """Without TE/Apex the local spec uses WrappedTorchNorm (torch.nn.LayerNorm/RMSNorm), which
    asserts `not config.sequence_parallel` (0.16.1: transformer/torch_norm.py:32; 0.19.2: :50). Sequence parallelism only
    needs the norm params tagged `param.sequence_parallel=True` so finalize_model_grads all-reduces
    their grads over TP (distributed/finalize_model_grads.py:354). Needed for MoE with TP>1, which
    requires sequence_parallel (moe_layer.py:380)."""
    import megatron.core.transformer.torch_norm as tn

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
                zero_centered_gamma=False, normalization="LayerNorm"):
        assert not config.layernorm_zero_centered_gamma and not config.memory_efficient_layer_norm
        if config.normalization == "LayerNorm":
            m = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            m = torch.nn.RMSNorm(hidden_size, eps=eps)
        elif config.normalization == "L2Norm":  # 0.19.2 added this option
            m = torch.nn.L2Norm(hidden_size, eps=eps) if hasattr(torch.nn, "L2Norm") else tn.L2Norm(hidden_size, eps=eps)
        else:
            raise Exception(f"unsupported normalization {config.normalization}")
        if config.sequence_parallel:
            for p in m.parameters():
                setattr(p, "sequence_parallel", True)
        return m

    tn.WrappedTorchNorm.__new__ = __new__


def _patch_hybrid_device_optimizer_for_cpu():
    """--optimizer-cpu-offload (HybridDeviceOptimizer, optimizer/cpu_offloading/hybrid_optimizer.py) decides
    what to offload with `param.is_cuda` (0.19.2 hybrid_optimizer.py:256, :273, :285; plus an unconditional .pin_memory() at :274).  On CPU nothing is
    "cuda": nothing is offloaded, every fp32 copy lands in cpu_param_groups, but cpu_copys_map_gpu_param stays
    empty -> KeyError in _set_sub_optimizer_grads (hybrid_optimizer.py:101) at the first step.
    Re-implement _get_sub_optimizer_param_groups with "device param" := not a host copy made here, so the CPU
    run follows the GPU code path (offload_fraction of the params get a separate host fp32 copy driven by
    cpu_optimizers, the rest stay on the 'device' optimizer).  pin_memory() only when CUDA is available."""
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as ho

    def is_dev(p):
        return p.is_cuda or not getattr(p, "_hdo_host_copy", False)

    def _get_sub_optimizer_param_groups(self, offload_fraction):
        _trace("(mcore)HDO._get_sub_optimizer_param_groups")
        params = [p for g in self.param_groups for p in g["params"]]
        offload_threshold = sum(p.numel() for p in params if is_dev(p)) * offload_fraction
        offload_numel = 0
        cpu_groups, gpu_groups, g2c, c2g, p2fp32 = [], [], {}, {}, {}
        for group in self.param_groups:
            gg, cg = group.copy(), group.copy()
            gg["params"], cg["params"] = [], []
            for param in group["params"]:
                orig, cpu_copy = param, False
                if offload_numel < offload_threshold and is_dev(param):
                    param = param.detach().clone().cpu()
                    if self.pin_cpu_params and torch.cuda.is_available():
                        param = param.pin_memory()
                    param._hdo_host_copy = True
                    offload_numel += param.numel()
                    cpu_copy = True
                if self.param_update_in_fp32 and param.dtype != torch.float32:
                    host = getattr(param, "_hdo_host_copy", False)
                    param = param.detach().clone().float()
                    if host:
                        param._hdo_host_copy = True
                    p2fp32[orig] = param
                if cpu_copy:
                    g2c[orig] = param
                    c2g[param] = orig
                (gg if is_dev(param) else cg)["params"].append(param)
            if gg["params"]:
                gpu_groups.append(gg)
            if cg["params"]:
                cpu_groups.append(cg)
        return cpu_groups, gpu_groups, g2c, c2g, p2fp32

    ho.HybridDeviceOptimizer._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups


def _patch_gloo_uneven_collectives():
    """gloo's allgather requires every output tensor to have the input's shape, NCCL does not.  Megatron uses
    uneven torch.distributed.all_gather / reduce_scatter for MoE with expert-TP > 1 and sequence parallel
    (0.19.2 tensor_parallel/mappings.py:154 _gather_along_first_dim(output_split_sizes=...) and
    mappings.py:197 _reduce_scatter_along_first_dim(input_split_sizes=...), reached from
    token_dispatcher.py:739) -> "ProcessGroupGloo::allgather: invalid tensor size".  Emulate the uneven case
    on gloo: pad-to-max all_gather, and all_reduce + slice for reduce_scatter."""
    import torch.distributed as dist
    orig_ag, orig_rs = dist.all_gather, dist.reduce_scatter

    def _gloo(group):
        try:
            return dist.get_backend(group) == "gloo"
        except Exception:
            return False

    def all_gather(tensor_list, tensor, group=None, async_op=False):
        if async_op or not _gloo(group) or all(t.shape == tensor.shape for t in tensor_list):
            return orig_ag(tensor_list, tensor, group=group, async_op=async_op)
        _trace("(gloo)uneven all_gather")
        n = max(t.shape[0] for t in tensor_list)
        pad = tensor.new_zeros((n,) + tuple(tensor.shape[1:]))
        pad[: tensor.shape[0]].copy_(tensor)
        bufs = [torch.empty_like(pad) for _ in tensor_list]
        orig_ag(bufs, pad, group=group)
        for t, b in zip(tensor_list, bufs):
            t.copy_(b[: t.shape[0]])

    def reduce_scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if async_op or not _gloo(group) or all(t.shape == output.shape for t in input_list):
            return orig_rs(output, input_list, op=op, group=group, async_op=async_op)
        _trace("(gloo)uneven reduce_scatter")
        buf = torch.cat([t.reshape(t.shape[0], -1) for t in input_list]).contiguous()
        dist.all_reduce(buf, op=op, group=group)
        r = dist.get_rank(group)
        off = sum(t.shape[0] for t in input_list[:r])
        output.copy_(buf[off: off + input_list[r].shape[0]].view_as(output))

    dist.all_gather, dist.reduce_scatter = all_gather, reduce_scatter


def _disable_jit_fuser():
    """Megatron's JIT fuser off from megatron.core's first import on (a speed patch, not a CPU fix).

    megatron/core/jit.py sets jit_fuser = torch.compile when megatron.core is first imported, and 41
    functions (fusions, activations, the torch RMSNorm, the MoE router) are decorated with it at import. On this
    CPU machine that costs about 5 of the 11 CPU-seconds of importing megatron.core per process (torch._dynamo
    and inductor come in, one compile wrapper per function) and, at a decorated function's first call, an inductor
    C++ build. The test suite starts several hundred Megatron processes on two cores, so it spends minutes there.
    Megatron-LM's own switch (--disable-jit-fuser: megatron/training/global_vars.py:156 calls
    megatron.core.jit.disable_jit_fuser()) comes after those imports, too late to save either, so here
    torch.compile is an identity decorator while megatron.core is first imported, then restored; the decorated
    functions run eagerly, as --disable-jit-fuser would run them. yeto-patch calls none of them. A process that
    imported megatron.core before apply() keeps the fuser it got."""
    if "megatron.core" in sys.modules:
        return
    real = torch.compile

    def identity(model=None, **_options):
        return model if model is not None else (lambda fn: fn)
    torch.compile = identity
    try:
        import megatron.core.jit as jit
    finally:
        torch.compile = real
    jit.disable_jit_fuser()


def apply(sequence_parallel_norm=True):
    """Install every patch once per process (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    # --- (0) jit_fuser: Megatron's own --disable-jit-fuser, in effect from the first import ---
    if "jit_fuser" not in _SKIP:
        _disable_jit_fuser()
    # --- (1) rng: CUDA RNG -> CPU RNG (megatron/core/tensor_parallel/random.py CudaRNGStatesTracker,
    #          0.19.2 random.py:303-345, model_parallel_cuda_manual_seed random.py:490) ---
    if "rng" not in _SKIP:
        torch.cuda.get_rng_state = _stub("get_rng_state", fn=lambda device="cuda": torch.get_rng_state())
        torch.cuda.manual_seed = _stub("manual_seed", fn=torch.manual_seed)
        import megatron.core.tensor_parallel.random as r
        r._get_cuda_rng_state = _stub("(mcore)_get_cuda_rng_state", fn=lambda *a, **k: torch.get_rng_state())
        r._set_cuda_rng_state = _stub("(mcore)_set_cuda_rng_state", fn=lambda s, *a, **k: torch.set_rng_state(s))
    # --- (2) cuda_api: torch.cuda device/stream/sync API stubs ---
    if "cuda_api" not in _SKIP:
        torch.cuda.current_device = _stub("current_device", ret="cpu")
        torch.cuda.synchronize = _stub("synchronize")
        torch.cuda.empty_cache = _stub("empty_cache")
        torch.cuda.Stream = _FakeStream
        torch.cuda.Event = _FakeEvent
        torch.cuda.current_stream = _stub("current_stream", fn=lambda *a, **k: _FakeStream())
        torch.cuda.default_stream = _stub("default_stream", fn=lambda *a, **k: _FakeStream())
        torch.cuda.stream = _stub("stream", fn=lambda *a, **k: contextlib.nullcontext())
    # --- (2b) moe_te_gemm: megatron-core 0.16.1 bug, moe_utils referenced te_general_gemm when TE is
    #          absent (NameError, 0.16.1 moe_utils.py:1192/1225).  FIXED in 0.19.2 (moe_utils.py:41-53 sets
    #          it to None), so this is a no-op there (kept for 0.16.x). ---
    import megatron.core.transformer.moe.moe_utils as mu
    if "moe_te_gemm" not in _SKIP and not hasattr(mu, "te_general_gemm"):
        mu.te_general_gemm = None
    # --- (2c) moe_split_numpy: MoE alltoall dispatcher: maybe_move_tensor_to_cpu() only converts split
    #          sizes to numpy when tensor.is_cuda (0.16.1 moe_utils.py:1093; 0.19.2 moe_utils.py:1184); on CPU
    #          the splits stay tensors and dist.all_to_all_single rejects them (TypeError). Callers:
    #          0.19.2 token_dispatcher.py:930/933/936.  Convert CPU tensors too. ---
    if "moe_split_numpy" not in _SKIP:
        import megatron.core.transformer.moe.token_dispatcher as td
        _orig_mmtc = mu.maybe_move_tensor_to_cpu

        def _mmtc(tensor, as_numpy=False, record_stream=False):
            if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
                _trace("(mcore)maybe_move_tensor_to_cpu")
                return tensor.numpy()
            return _orig_mmtc(tensor, as_numpy=as_numpy, record_stream=record_stream)

        mu.maybe_move_tensor_to_cpu = _mmtc
        td.maybe_move_tensor_to_cpu = _mmtc
    # --- (2d) torch_norm_sp: let the torch-native LayerNorm work with sequence_parallel=True ---
    if sequence_parallel_norm and "torch_norm_sp" not in _SKIP:
        _patch_torch_norm_for_sequence_parallel()
    # --- (2e) hdo_cpu: HybridDeviceOptimizer (--optimizer-cpu-offload) on CPU, see the function above ---
    if "hdo_cpu" not in _SKIP:
        _patch_hybrid_device_optimizer_for_cpu()
    # --- (2f) gloo_uneven: uneven all_gather / reduce_scatter (MoE with expert-TP > 1), see above ---
    if "gloo_uneven" not in _SKIP:
        _patch_gloo_uneven_collectives()
    # --- (3) mode: device='cuda' literals, Tensor.cuda(), Tensor.type() string checks ---
    if "mode" not in _SKIP:
        CudaToCpuMode().__enter__()

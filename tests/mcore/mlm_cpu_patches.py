"""TEST-ONLY patches for running megatron.training (the Megatron-LM training loop shipped in the megatron-core 0.19.2
wheel) on CPU with gloo.  apply() = cpu_patches.apply() (megatron.core level, see cpu_patches.py) + the
training-level patches T1..Tn below (each one was added because the run failed without it; file:line refer
to the 0.19.2 wheel).  Import and apply() BEFORE megatron.training is used: pretrain_gpt_cpu.py does it as
its first import.  megatron.training exists only in megatron-core >= 0.17 (not in 0.16.1).  MLM_CPU_SKIP=T1,T3 leaves patches out (ablation); MCORE_CPU_TRACE=1 logs call sites.
"""
import functools
import os

from tests.mcore import cpu_patches
from tests.mcore.cpu_patches import _stub, _trace

_APPLIED = False
_SKIP = set(filter(None, os.environ.get("MLM_CPU_SKIP", "").split(",")))


def _on(name):
    return name not in _SKIP


def apply():
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    import torch
    torch.set_num_threads(int(os.environ.get("MLM_CPU_THREADS", "1")))
    cpu_patches.apply()

    # T1 validate_args (training/arguments.py:1414/1444/1484) calls get_device_arch_version()
    #    = torch.cuda.get_device_properties("cuda:0") -> "Found no NVIDIA driver".  Report Hopper (9);
    #    with TP>1 that path then asserts CUDA_DEVICE_MAX_CONNECTIONS == "1" (arguments.py:1437) -> set it.
    if _on("T1"):
        import megatron.training.arguments as A
        import megatron.training.utils.common_utils as CU
        import megatron.training.utils as U
        fake_arch = _stub("(mlm)get_device_arch_version", ret=9)
        A.get_device_arch_version = CU.get_device_arch_version = U.get_device_arch_version = fake_arch
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    # T2 initialize_megatron(allow_no_cuda=False) asserts torch.cuda.is_available() (initialize.py:66).
    #    pretrain() calls it without that flag (training.py:1091) -> rebind the name training.py imported
    #    with allow_no_cuda=True.  (Patching torch.cuda.is_available itself would also switch on
    #    DataLoader pin_memory via torch.accelerator.is_available -> crash.)
    if _on("T2"):
        import megatron.training.training as TR
        import megatron.training.initialize as INI
        TR.initialize_megatron = functools.partial(INI.initialize_megatron, allow_no_cuda=True)

    # T3 torch.cuda.device_count() == 0 skips mpu.initialize_model_parallel (initialize.py:270 read, :358 gate, :370 call) and
    #    tensor_parallel.model_parallel_cuda_manual_seed (initialize.py:447) -> report 1 device; then
    #    torch.cuda.set_device(local_rank) (initialize.py:282, only if dist not yet initialized) -> no-op.
    if _on("T3"):
        torch.cuda.device_count = _stub("device_count", ret=1)
        torch.cuda.set_device = _stub("set_device")

    # T4 _compile_dependencies (initialize.py:165) runs `make -C megatron/core/datasets` on rank 0, but the
    #    wheel ships the prebuilt helpers_cpp*.so and no Makefile -> make fails -> sys.exit(1).
    if _on("T4"):
        import megatron.core.datasets.utils as DU
        DU.compile_helpers = _stub("(mlm)compile_helpers")

    # T5 (not CPU-specific: any run WITHOUT TransformerEngine/Apex, i.e. torch.optim.Adam(W) inside the
    #    DistributedOptimizer) -- resume (--load) fails: load_checkpoint -> generate_state_dict ->
    #    DistributedOptimizer.sharded_state_dict(is_loading=True) (distrib_optimizer.py:1532) ->
    #    state_dict() collects 'step' from the inner torch optimizer state, which is still empty before
    #    the first step -> `assert len(steps) == 1` (distrib_optimizer.py:839).  Seed a temporary step=0
    #    so state_dict() works; the real step comes from the checkpoint right after (load_state_dict).
    if _on("T5"):
        import megatron.core.optimizer.distrib_optimizer as DOm
        _orig_sd = DOm.DistributedOptimizer.state_dict

        def state_dict(self):
            inner = getattr(self, "optimizer", None)
            if (not DOm.HAVE_APEX_OR_TE and inner is not None
                    and not isinstance(inner, DOm.HybridDeviceOptimizer) and len(inner.state) == 0):
                _trace("(mlm)DistOpt.state_dict step=0")
                for g in inner.param_groups:
                    for p in g["params"]:
                        inner.state[p]["step"] = torch.tensor(0.0)
                try:
                    return _orig_sd(self)
                finally:
                    inner.state.clear()
            return _orig_sd(self)

        DOm.DistributedOptimizer.state_dict = state_dict

    # T6 (not CPU-specific, same no-TE/Apex torch-Adam path as T5) -- after resume the Adam 'step' is
    #    silently wrong (0 instead of the checkpoint's step; found by diag_opt_dump.py: masters, exp_avg,
    #    exp_avg_sq bit-identical, only 'step' differs).  load_state_dict() first restores 'step' from the
    #    param_groups (distrib_optimizer.py:1027-1033), then load_parameter_state_from_dp_reshardable ->
    #    _set_main_param_and_optimizer_states (distrib_optimizer.py:1216-1225) copies EVERY tensor in the
    #    Adam state, including 'step', from the loaded bucket state -- but 'step' there is a
    #    LocalNonpersistentObject (distrib_optimizer.py:1956-1960) holding the pre-load placeholder, so the
    #    restored step is overwritten.  Skip 'step' there (fs_model_space loading already skips it, :2108).
    if _on("T6"):
        import megatron.core.optimizer.distrib_optimizer as DOm
        _orig_set = DOm.DistributedOptimizer._set_main_param_and_optimizer_states

        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            if "step" in tensors and not DOm.HAVE_APEX_OR_TE:
                _trace("(mlm)DistOpt._set_main_param.. skip step")
                tensors = {**tensors, "step": None}  # non-tensor -> skipped by the original loop
            return _orig_set(self, model_param, tensors)

        DOm.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states

    # T7 (not CPU-specific, same no-TE/Apex torch-Adam path) -- after resume, training diverges from the
    #    uninterrupted run from the 2nd resumed step on: DistributedOptimizer.load_state_dict sets ONE
    #    shared tensor as state['step'] of every param (distrib_optimizer.py:1029-1033), torch's
    #    Optimizer.load_state_dict keeps 'step' uncopied (torch/optim/optimizer.py:794-798), and Adam's
    #    per-param `step_t += 1` then advances it by n_params per optimizer.step() (seen: 10 -> 28 with
    #    18 params) -> wrong bias correction.  Give every param its own step tensor after loading.
    if _on("T7"):
        import megatron.core.optimizer.distrib_optimizer as DOm
        _orig_lsd = DOm.DistributedOptimizer.load_state_dict

        def load_state_dict(self, state_dict):
            _orig_lsd(self, state_dict)
            inner = getattr(self, "optimizer", None)
            if not DOm.HAVE_APEX_OR_TE and inner is not None and not isinstance(inner, DOm.HybridDeviceOptimizer):
                _trace("(mlm)DistOpt.load_state_dict unshare step")
                for s in inner.state.values():
                    if torch.is_tensor(s.get("step")):
                        s["step"] = s["step"].clone()

        DOm.DistributedOptimizer.load_state_dict = load_state_dict

    # T8 (EXPERIMENTAL, only for --optimizer-cpu-offload resume without TE/Apex) -- the torch-Adam branch of
    #    DistributedOptimizer.state_dict() (distrib_optimizer.py:837-840) is taken before the HDO branch, and
    #    HybridDeviceOptimizer.state is empty before its first step -> same assert as T5.  Seed step=0 into
    #    HDO.state too, and un-share 'step' after load (HDO state dicts are shared with its sub-optimizers).
    if _on("T8"):
        import megatron.core.optimizer.distrib_optimizer as DOm
        _sd_t5 = DOm.DistributedOptimizer.state_dict
        _lsd_t7 = DOm.DistributedOptimizer.load_state_dict

        def state_dict_hdo(self):
            inner = getattr(self, "optimizer", None)
            if (not DOm.HAVE_APEX_OR_TE and isinstance(inner, DOm.HybridDeviceOptimizer)
                    and len(inner.state) == 0):
                _trace("(mlm)HDO state_dict step=0")
                for g in inner.param_groups:
                    for p in g["params"]:
                        inner.state[p]["step"] = torch.tensor(0.0)
                try:
                    return _sd_t5(self)
                finally:
                    inner.state.clear()
            return _sd_t5(self)

        def load_state_dict_hdo(self, state_dict):
            _lsd_t7(self, state_dict)
            inner = getattr(self, "optimizer", None)
            if not DOm.HAVE_APEX_OR_TE and isinstance(inner, DOm.HybridDeviceOptimizer):
                for s in inner.state.values():
                    if torch.is_tensor(s.get("step")):
                        s["step"] = s["step"].clone()

        DOm.DistributedOptimizer.state_dict = state_dict_hdo
        DOm.DistributedOptimizer.load_state_dict = load_state_dict_hdo

"""TEST-ONLY: the REAL Megatron-Bridge 0.6.2 pretrain() of a tiny GPT on CPU (gloo, mock data, NullTokenizer), as
a user's Bridge training script; it knows nothing about DiLoCo (yeto-patch attaches through PYTHONPATH + YETO_*).

  torchrun --nproc-per-node 2 bridge_pretrain_cpu.py [--tp 2] [--bf16] [--iters 4] [--save DIR] [--load DIR]

Uses tests/launchers/cpu/bridge_stubs.py (import stubs) and tests/mcore/mlm_cpu_patches.py (CUDA->CPU patches).
Nothing of Bridge or megatron-core is edited on disk.
"""
import argparse
import functools
import os
import sys
import warnings

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
from tests.launchers.cpu import bridge_stubs  # noqa: E402,F401  (nvrx + TE import stubs, before megatron.bridge)
from tests.mcore import mlm_cpu_patches  # noqa: E402  (project's CUDA->CPU patches for megatron.core)


def main():
    # everything runs under main(): checkpoint saving starts helper processes with the 'spawn' method, which
    # re-import __main__ (an unguarded script would start a second pretrain() in them and hang)
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--iters", type=int, default=4)
    p.add_argument("--save", default=None)
    p.add_argument("--save-interval", type=int, default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--exit-interval", type=int, default=None)
    opts = p.parse_args()

    import torch  # noqa: E402
    torch.set_num_threads(1)
    # the project's patches: cpu_patches (megatron.core on CPU) + mlm_cpu_patches T3 (device_count=1, set_device
    # no-op) and T5-T7 (resume bugs of megatron-core's DistributedOptimizer on the plain torch-Adam path, hit by
    # Bridge's --load too). T1/T2/T4 are for megatron.training.pretrain only (Bridge has its own B1/B2 below).
    os.environ.setdefault("MLM_CPU_SKIP", "T1,T2,T4")
    mlm_cpu_patches.apply()
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")

    # --- Bridge-level CPU patches (B1..Bn, each added because the run failed without it) ---
    import megatron.bridge.training.setup as BS  # noqa: E402
    import megatron.bridge.training.initialize as BI  # noqa: E402
    # B1 setup() calls initialize_megatron(cfg, ...) without allow_no_cuda -> assert torch.cuda.is_available()
    BS.initialize_megatron = functools.partial(BI.initialize_megatron, allow_no_cuda=True)
    # B2 initialize_megatron -> compile_helpers() runs `make -C megatron/core/datasets`; the wheel ships the prebuilt
    #    helpers_cpp .so and no Makefile -> make fails -> sys.exit(1)  (same as the project's mlm T4)
    BI.compile_helpers = lambda: None
    # B3 _set_random_seed() seeds the (CPU-patched) model-parallel RNG tracker only if torch.cuda.device_count() > 0
    #    (initialize.py:869) -> "cuda rng state model-parallel-rng is not added"; report 1 device and make
    #    torch.cuda.set_device (then called by _initialize_distributed) a no-op (same as the project's mlm T3)
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *a, **k: None

    from megatron.bridge.models.gpt_provider import GPTModelProvider, local_layer_spec  # noqa: E402
    from megatron.bridge.training.config import (CheckpointConfig, ConfigContainer, DistributedDataParallelConfig,  # noqa: E402
                                                 DistributedInitConfig, LoggerConfig, MockGPTDatasetConfig,
                                                 OptimizerConfig, RNGConfig, SchedulerConfig, TrainingConfig,
                                                 ValidationConfig)
    from megatron.bridge.training.tokenizers.config import TokenizerConfig  # noqa: E402
    from megatron.bridge.training.gpt_step import forward_step  # noqa: E402
    from megatron.bridge.training.pretrain import pretrain  # noqa: E402
    SEQ = 64
    dtype = torch.bfloat16 if opts.bf16 else torch.float32
    model = GPTModelProvider(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, seq_length=SEQ,
        make_vocab_size_divisible_by=128,
        transformer_layer_spec=local_layer_spec,
        tensor_model_parallel_size=opts.tp, pipeline_model_parallel_size=opts.pp,
        pipeline_dtype=dtype if opts.pp > 1 else None,
        bf16=opts.bf16, params_dtype=dtype, use_cpu_initialization=True,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False, cross_entropy_loss_fusion=False,
        attention_softmax_in_fp32=True, normalization="LayerNorm",
    )
    cfg = ConfigContainer(
        model=model,
        train=TrainingConfig(train_iters=opts.iters, global_batch_size=4, micro_batch_size=1, exit_signal_handler=False,
                             exit_interval=opts.exit_interval),
        validation=ValidationConfig(eval_iters=0, eval_interval=None),
        optimizer=OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, bf16=opts.bf16, fp16=False,
                                  use_distributed_optimizer=True, clip_grad=1.0, weight_decay=0.0),
        scheduler=SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0, start_weight_decay=0.0,
                                  end_weight_decay=0.0, weight_decay_incr_style="constant"),
        ddp=DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True,
                                          overlap_grad_reduce=False, overlap_param_gather=False),
        dataset=MockGPTDatasetConfig(seq_length=SEQ, random_seed=1234, reset_attention_mask=False,
                                     reset_position_ids=False, eod_mask_loss=False, num_dataset_builder_threads=1,
                                     dataloader_type="single", num_workers=0, split="1,1,1", mmap_bin_files=False),
        logger=LoggerConfig(log_interval=1),
        tokenizer=TokenizerConfig(tokenizer_type="NullTokenizer", vocab_size=1000),
        checkpoint=CheckpointConfig(save=opts.save, load=opts.load, save_interval=opts.save_interval,
                                    ckpt_format="torch_dist", async_save=False, fully_parallel_save=False),
        dist=DistributedInitConfig(distributed_backend="gloo"),
        rng=RNGConfig(seed=opts.seed),
    )
    pretrain(cfg, forward_step)
    if os.environ.get("RANK", "0") == "0":
        print("[bridge_pretrain_cpu] pretrain() returned normally", flush=True)


if __name__ == "__main__":
    main()

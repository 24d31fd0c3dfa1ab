"""Megatron-LM's own training loop on CPU, in the style of Megatron-LM's pretrain_gpt.py (test-only): a GPT with
the local (non-Transformer-Engine) layer spec, mock data or indexed text files, megatron.training.pretrain. Knows
nothing about DiLoCo. Usage: torchrun --nproc-per-node 2 pretrain_gpt_cpu.py <Megatron-LM arguments> [--export-npz PATH]
[--crash-at-iteration N] [--export-npz-at-start PATH] [--wait-for-file PATH] [--valid-seed N]
[--sleep-per-iteration S]
[--hold-at-iteration N PATH] [--no-ft-keepalive]

--sleep-per-iteration S: each iteration takes S seconds longer (a slower island). --hold-at-iteration N PATH
(repeatable): iteration N waits (up to 30 min) until PATH exists (a test decides when an island may go on).

--export-npz PATH: after pretrain() returns (also when --load reached --train-iters and nothing trained), each
rank writes PATH.rank<r>.npz with its part of the full model (full_model.py: FP32 masters and weights).
--export-npz-at-start PATH: the same at the first forward step of the run (inside the first train_step, so after
anything that runs before it: with yeto-patch attached, the island's start), tied output-layer copy included.
--no-ft-keepalive: yeto-patch's hook of Megatron-LM's FT integration (yeto_patch/hooks/mlm_ft.py) is removed, so
the island's waits do not restart NVIDIA FT's sections (the control of tests/shim/test_ft_launcher.py).
--valid-seed N: the validation split's samples are drawn with seed N instead of --seed, so that runs of different
seeds evaluate the same held-out sequences."""
import os
import sys
import warnings
from functools import partial

warnings.filterwarnings("ignore")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.mcore import mlm_cpu_patches  # noqa: E402  test-only CPU support, applied before Megatron runs
mlm_cpu_patches.apply()

import torch  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,  # noqa: E402
                                                       get_gpt_layer_local_spec)
from megatron.training import get_args, get_tokenizer, pretrain  # noqa: E402
from megatron.training.argument_utils import (core_transformer_config_from_args,  # noqa: E402
                                              pretrain_cfg_container_from_args)
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils.common_utils import (get_blend_and_blend_per_split,  # noqa: E402
                                                   is_first_or_last_pipeline_stage)


def layer_spec(args, config, vp_stage):
    """The local spec as Megatron-LM's pretrain_gpt.py chooses it (megatron/training/models/gpt.py): MoE models
    get the decoder block spec, the others the layer spec with --normalization and --qk-layernorm."""
    if args.num_experts:
        return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                          vp_stage=vp_stage)
    return get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm,
                                    args.multi_latent_attention, normalization=args.normalization)


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    args = get_args()
    config = core_transformer_config_from_args(args)
    return GPTModel(config=config, transformer_layer_spec=layer_spec(args, config, vp_stage),
                    vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process,
                    share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                    position_embedding_type=args.position_embedding_type, vp_stage=vp_stage)


def get_batch(data_iterator, vp_stage=None):
    if not is_first_or_last_pipeline_stage(vp_stage):
        return None, None, None, None, None
    b = next(data_iterator)
    return b["tokens"], b["labels"], b["loss_mask"], b.get("attention_mask"), b["position_ids"]


def loss_func(loss_mask, output_tensor):
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model, return_schedule_plan=False):
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


VALID_SEED = None   # --valid-seed


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    """Mock data with --mock-data; otherwise Megatron's GPTDataset over --data-path or --train/valid-data-path
    (indexed .bin/.idx files), as pretrain_gpt.py builds it."""
    args = get_args()
    blend, blend_per_split = (None, None) if args.mock_data else get_blend_and_blend_per_split(args)
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                              blend_per_split=blend_per_split, split=None if blend_per_split else "99,1,0",
                              tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, create_attention_mask=False,
                              path_to_cache=args.data_cache_path, mmap_bin_files=False)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    ready = lambda: is_first_or_last_pipeline_stage(vp_stage)  # noqa: E731
    train, valid, test = BlendedMegatronDatasetBuilder(cls, num_samples, ready, config).build()
    if VALID_SEED is not None:   # the held-out samples do not depend on --seed (runs of any seed compare)
        config.random_seed = VALID_SEED
        _, valid, _ = BlendedMegatronDatasetBuilder(cls, num_samples, ready, config).build()
    return train, valid, test


def export_npz(path, model_chunks, optimizer, tied_copy=False):
    import numpy as np
    from full_model import full_model
    args = get_args()
    arrays = full_model(model_chunks, optimizer, args.num_layers, not args.untie_embeddings_and_output_weights,
                        tied_copy=tied_copy)
    np.savez(f"{path}.rank{torch.distributed.get_rank()}.npz", **arrays)


if __name__ == "__main__":
    export = None
    if "--export-npz" in sys.argv:
        i = sys.argv.index("--export-npz")
        export = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    crash_at = None   # --crash-at-iteration N: SIGKILL this worker at a random moment of iteration N (tests)
    if "--crash-at-iteration" in sys.argv:
        i = sys.argv.index("--crash-at-iteration")
        crash_at = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    if "--valid-seed" in sys.argv:   # --valid-seed N: the validation split is sampled with seed N, not --seed
        i = sys.argv.index("--valid-seed")
        VALID_SEED = int(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    wait_for = None   # --wait-for-file PATH: the first train_step waits (up to 30 min) until PATH exists (tests)
    if "--wait-for-file" in sys.argv:
        i = sys.argv.index("--wait-for-file")
        wait_for = sys.argv[i + 1]
        del sys.argv[i:i + 2]
    sleep_s = 0.0
    if "--sleep-per-iteration" in sys.argv:
        i = sys.argv.index("--sleep-per-iteration")
        sleep_s = float(sys.argv[i + 1])
        del sys.argv[i:i + 2]
    holds = {}   # iteration -> file (repeatable)
    while "--hold-at-iteration" in sys.argv:
        i = sys.argv.index("--hold-at-iteration")
        holds[int(sys.argv[i + 1])] = sys.argv[i + 2]
        del sys.argv[i:i + 3]
    import time

    import megatron.training.training as T
    if "--no-ft-keepalive" in sys.argv:   # (importing the loop imported ft_integration: yeto-patch hooked it)
        sys.argv.remove("--no-ft-keepalive")
        from yeto_patch.hooks import mlm_ft
        mlm_ft.unpatch()
    if sleep_s or holds:
        _slow_step = T.train_step

        def train_step(*a, **k):   # (outside yeto-patch's hooks: the island's own pace)
            gate = holds.get(get_args().curr_iteration + 1)
            if gate is not None:
                t_end = time.time() + 1800
                while not os.path.exists(gate) and time.time() < t_end:
                    time.sleep(0.2)
            out = _slow_step(*a, **k)
            time.sleep(sleep_s)
            return out
        T.train_step = train_step
    if wait_for is not None:
        _first_step = T.train_step

        def train_step(*a, **k):   # outside any hook on train_step: it runs before them
            t_end = time.time() + 1800
            while not os.path.exists(wait_for) and time.time() < t_end:
                time.sleep(0.2)
            T.train_step = _first_step
            return _first_step(*a, **k)
        T.train_step = train_step
    if crash_at is not None:
        import random
        import signal
        import threading
        _train_step = T.train_step

        def train_step(*a, **k):
            if get_args().curr_iteration + 1 == crash_at and torch.distributed.get_rank() == 0:
                threading.Timer(random.uniform(0.0, 0.15), os.kill, (os.getpid(), signal.SIGKILL)).start()
            return _train_step(*a, **k)
        T.train_step = train_step
    built = {}
    export_start = None
    if "--export-npz-at-start" in sys.argv:
        i = sys.argv.index("--export-npz-at-start")
        export_start = sys.argv[i + 1]
        del sys.argv[i:i + 2]
        _forward_step = forward_step

        def forward_step(data_iterator, model, return_schedule_plan=False):   # noqa: F811
            if not built.get("exported_start"):
                built["exported_start"] = True
                export_npz(export_start, built["model"], built["optimizer"], tied_copy=True)
            return _forward_step(data_iterator, model, return_schedule_plan)
    _setup = T.setup_model_and_optimizer

    def setup_model_and_optimizer(*a, **k):   # keep a handle on the model for the export
        res = _setup(*a, **k)
        built["model"], built["optimizer"] = res[0], res[1]
        return res
    T.setup_model_and_optimizer = setup_model_and_optimizer
    train_valid_test_datasets_provider.is_distributed = True
    args = parse_and_validate_args(args_defaults={"tokenizer_type": "NullTokenizer"})
    pretrain(pretrain_cfg_container_from_args(args), train_valid_test_datasets_provider,
             ModelType.encoder_or_decoder, forward_step, model_provider=model_provider)
    if export:
        export_npz(export, built["model"], built["optimizer"])

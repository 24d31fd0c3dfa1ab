"""Hook for ``megatron.training.training`` (Megatron-LM's loop, shipped in megatron-core >= 0.17 wheels):
``train_step``, and ``save_checkpoint`` / ``load_checkpoint`` (the island's sync state is saved beside every
checkpoint and restored on load). ``pretrain`` -> ``train`` -> ``train_step`` looks ``train_step`` up as a global of this module,
so the module attribute is what gets wrapped."""

import os

from . import _train_step, _wrap
from ._runtime import RUNTIME
from ._targets import Target

TARGET = "megatron.training.training"
LAUNCHER = "Megatron-LM"
DISTRIBUTION = "megatron-core"     # megatron.training ships in its wheels >= 0.17
TARGETS = (Target(TARGET, None, "train_step"),
           Target(TARGET, None, "save_checkpoint"),   # island restart: sync state saved beside the checkpoint
           Target(TARGET, None, "load_checkpoint"))   # ... and restored from it
SUPPORTED_VERSIONS = {"megatron-core": ">=0.17"}   # megatron.training ships in megatron-core wheels from 0.17
# the writers Megatron-LM opens (on the last rank), where the island's figures go (yeto/*; YETO_DILOCO_FIGURES)
WRITERS = (("TensorBoard", "tensorboard", "get_tensorboard_writer(), with --tensorboard-dir"),
           ("W&B", "wandb", "get_wandb_writer(), with --wandb-project"))


def writers() -> list:
    """The TensorBoard and W&B writers Megatron-LM opened on this rank (None for those it did not)."""
    from megatron.training import global_vars
    return [getattr(global_vars, name, lambda: None)() for name in ("get_tensorboard_writer", "get_wandb_writer")]


def _facts(bound) -> dict:
    facts = dict(model=bound.get("model"), optimizer=bound.get("optimizer"), iteration=bound.get("iteration"),
                 train_iters=None, tokens=None, vocab_size=None, writers=writers)
    try:
        from megatron.training.global_vars import get_args
        args = get_args()
    except Exception:
        args = None
    if args is None:
        return facts
    if facts["iteration"] is None:
        facts["iteration"] = getattr(args, "curr_iteration", None)
    facts["train_iters"] = getattr(args, "train_iters", None)
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        facts["tokens"] = int(get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
                              * args.seq_length)
    except Exception:
        pass
    try:
        from megatron.training.global_vars import get_tokenizer
        tok = get_tokenizer()
        facts["vocab_size"] = int(tok.vocab_size) if tok is not None else None
    except Exception:
        pass
    return facts


def _exit_after_this_iteration(facts):
    """Make Megatron-LM's own --exit-interval rule fire after this iteration: it saves (with the iteration number
    after the step) and leaves the loop. Every release since the flag existed checks it after each iteration."""
    try:
        from megatron.training.global_vars import get_args
        args = get_args()
    except Exception:
        return False
    it = facts.get("iteration")
    if it is None or not hasattr(args, "exit_interval"):
        return False
    args.exit_interval = it + 1
    return True


def train_step_wrapper(wrapped, instance, args, kwargs):
    facts = _facts(_train_step.bind(wrapped, args, kwargs))
    return _train_step.run(wrapped, args, kwargs, facts, on_early_exit=lambda: _exit_after_this_iteration(facts))


def _args():
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except Exception:
        return None


def save_checkpoint_wrapper(wrapped, instance, args, kwargs):
    """After Megatron saved a checkpoint, the island's sync state goes beside it (in its --save directory)."""
    result = wrapped(*args, **kwargs)
    bound = _train_step.bind(wrapped, args, kwargs)
    a = _args()
    if bound.get("iteration") is not None and a is not None and not bound.get("non_persistent_ckpt"):
        RUNTIME.checkpoint_saved(getattr(a, "save", None), int(bound["iteration"]))
    return result


def _has_checkpoint(a, load_arg: str) -> bool:
    """Whether load_checkpoint will find weights: a checkpoint in --load (or the directory `load_arg` names), or in
    --pretrained-checkpoint, which Megatron-LM falls back to (a fine-tune). With none it returns iteration 0 and the
    model keeps its fresh weights, as with a checkpoint loaded by --finetune: only this tells the two apart."""
    try:
        from megatron.training.checkpointing import checkpoint_exists
    except ImportError:   # releases before it: the tracker file is what it checks
        def checkpoint_exists(d):
            return os.path.isfile(os.path.join(d, "latest_checkpointed_iteration.txt"))
    try:
        return any(bool(d) and checkpoint_exists(d) for d in (getattr(a, load_arg, None),
                                                              getattr(a, "pretrained_checkpoint", None)))
    except Exception:  # noqa: BLE001 - a storage the check cannot read: said not loaded (the old behaviour)
        return False


def load_checkpoint_wrapper(wrapped, instance, args, kwargs):
    """Megatron loaded a checkpoint (before training): the island restores the sync state saved with it, or (none
    beside it) knows its run starts from loaded weights (a fine-tune's --load --finetune)."""
    bound = _train_step.bind(wrapped, args, kwargs)
    a = _args()
    load_arg = bound.get("load_arg", "load") or "load"
    weights = a is not None and _has_checkpoint(a, load_arg)
    result = wrapped(*args, **kwargs)
    if a is not None and isinstance(result, tuple) and result:
        directory = getattr(a, load_arg, None) or getattr(a, "pretrained_checkpoint", None)
        RUNTIME.checkpoint_loaded(directory, int(result[0] or 0), weights=weights)
    return result


# train_step, save_checkpoint and load_checkpoint as the loop sees them: globals of megatron.training.training
patch, unpatch, patched = _wrap.hook(TARGET, [
    (None, "train_step", train_step_wrapper),
    (None, "save_checkpoint", save_checkpoint_wrapper),
    (None, "load_checkpoint", load_checkpoint_wrapper)], __name__)

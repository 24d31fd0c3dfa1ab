"""Hook for ``megatron.training.training`` (Megatron-LM's loop, shipped in megatron-core >= 0.17 wheels):
``train_step``. ``pretrain`` -> ``train`` -> ``train_step`` looks ``train_step`` up as a global of this module,
so the module attribute is what gets wrapped."""

from . import _train_step, _wrap

TARGET = "megatron.training.training"


def _facts(bound) -> dict:
    facts = dict(model=bound.get("model"), optimizer=bound.get("optimizer"), iteration=bound.get("iteration"),
                 train_iters=None, tokens=None, vocab_size=None)
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


patch, unpatch, patched = _wrap.function_hook(TARGET, "train_step", train_step_wrapper, __name__)

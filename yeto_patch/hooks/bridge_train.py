"""Hook for ``megatron.bridge.training.train`` (Megatron-Bridge's loop): ``train_step``, looked up as a global of
that module by ``train``, so the module attribute is what gets wrapped. Bridge passes a ``GlobalState`` whose
``cfg`` holds the schedule and ``train_state.step`` the iteration."""

from . import _train_step, _wrap
from ._targets import Target

TARGET = "megatron.bridge.training.train"
TARGETS = (Target(TARGET, None, "train_step"),)
SUPPORTED_VERSIONS = {"megatron-bridge": "*"}   # tested only against stand-ins of its train_step signatures


def _facts(bound) -> dict:
    facts = dict(model=bound.get("model"), optimizer=bound.get("optimizer"), iteration=None, train_iters=None,
                 tokens=None, vocab_size=None)
    gs = bound.get("global_state", bound.get("state"))
    if gs is None:
        return facts
    try:
        facts["iteration"] = int(gs.train_state.step)
    except Exception:
        pass
    cfg = getattr(gs, "cfg", None)
    train = getattr(cfg, "train", None)
    facts["train_iters"] = getattr(train, "train_iters", None)
    try:
        seq = getattr(cfg.model, "seq_length", None) or cfg.dataset.sequence_length
        facts["tokens"] = int(train.global_batch_size * seq)
    except Exception:
        pass
    for owner in (getattr(gs, "tokenizer", None), getattr(cfg, "tokenizer", None)):
        v = getattr(owner, "vocab_size", None)
        if isinstance(v, int) and v > 0:
            facts["vocab_size"] = v
            break
    return facts


def train_step_wrapper(wrapped, instance, args, kwargs):
    facts = _facts(_train_step.bind(wrapped, args, kwargs))
    return _train_step.run(wrapped, args, kwargs, facts)


patch, unpatch, patched = _wrap.function_hook(TARGET, "train_step", train_step_wrapper, __name__)

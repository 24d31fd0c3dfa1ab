"""Hook for ``megatron.bridge.training.train`` (Megatron-Bridge's loop): ``train_step``, looked up as a global of
that module by ``train``, so the module attribute is what gets wrapped. Bridge passes a ``GlobalState`` whose
``cfg`` holds the schedule and ``train_state.step`` the iteration.

At a final cut before Bridge's last iteration, Bridge's own exit rule is used (``cfg.train.exit_interval`` = this
iteration + 1): after the step it saves a checkpoint numbered by the steps it holds and leaves the loop. (Bridge's
checkpoint-and-exit flags would save before ``train_state.step`` is incremented: a checkpoint labelled N holding
N + 1 updates, so a resume would train one batch twice.) The sync state travels with Bridge's checkpoints
through ``bridge_checkpointing``."""

from . import _train_step, _wrap
from ._targets import Target

TARGET = "megatron.bridge.training.train"
LAUNCHER = "Megatron-Bridge"
DISTRIBUTION = "megatron-bridge"
TARGETS = (Target(TARGET, None, "train_step"),)
SUPPORTED_VERSIONS = {"megatron-bridge": ">=0.6.2,<0.7"}   # tested here: 0.6.2 (megatron-core 0.19.2)
# the writers Bridge opens (on the last rank), where the island's figures go (yeto/*; YETO_DILOCO_FIGURES)
WRITERS = (("TensorBoard", "tensorboard", "GlobalState.tensorboard_logger, with cfg.logger.tensorboard_dir"),
           ("W&B", "wandb", "GlobalState.wandb_logger, with cfg.logger.wandb_project"))


def writers_of(gs):
    """A function returning the TensorBoard and W&B loggers of Bridge's GlobalState on this rank (Bridge makes
    them when first asked, on the last rank, when its configuration names them)."""
    def writers() -> list:
        return [getattr(gs, "tensorboard_logger", None), getattr(gs, "wandb_logger", None)]
    return writers


def _facts(bound) -> dict:
    facts = dict(model=bound.get("model"), optimizer=bound.get("optimizer"), iteration=None, train_iters=None,
                 tokens=None, vocab_size=None)
    gs = bound.get("global_state", bound.get("state"))
    if gs is None:
        return facts
    facts["writers"] = writers_of(gs)
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


def _exit_after_this_iteration(bound, iteration):
    """Bridge checks ``train_state.step % cfg.train.exit_interval == 0`` after every step (and saves first)."""
    gs = bound.get("global_state", bound.get("state"))
    train = getattr(getattr(gs, "cfg", None), "train", None)
    if iteration is None or train is None or not hasattr(train, "exit_interval"):
        return False
    train.exit_interval = iteration + 1
    return True


def train_step_wrapper(wrapped, instance, args, kwargs):
    bound = _train_step.bind(wrapped, args, kwargs)
    facts = _facts(bound)
    return _train_step.run(wrapped, args, kwargs, facts,
                           on_early_exit=lambda: _exit_after_this_iteration(bound, facts["iteration"]))


patch, unpatch, patched = _wrap.hook(TARGET, [(None, "train_step", train_step_wrapper)], __name__)

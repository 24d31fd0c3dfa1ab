"""Hook for ms-swift's own Megatron loop (``megatron sft`` / ``megatron pt``): ``swift.megatron.trainers.base``
``BaseMegatronTrainer``. Its ``train()`` calls ``self.train_step(train_data_iterator)`` (returning ``(metrics,
grad_norm, update_successful)``) and increments ``self.state.iteration`` after it; it never goes through
``megatron.training``, so without this hook only the optimizer hook would fire.

- ``train_step``: the facts come from ``self.state`` / ``self.args`` (iteration, train_iters, tokens per step =
  global batch x sequence length, the model's vocabulary). At a final cut before ms-swift's last iteration the
  loop is shortened to end after this step (``args.train_iters = state.iteration + 1``): ms-swift then saves its
  usual final checkpoint, numbered by the steps it holds, with the global model in it.
- ``save_checkpoint``: the island's sync state goes beside the checkpoint (``<output_dir>/checkpoint-N``).
- ``_load_checkpoint``: after a resume (``--mcore_model <output_dir>/checkpoint-N --finetune false``) the island
  restores the sync state saved with it; otherwise the run starts from the weights ms-swift loaded (the model's,
  or ``--mcore_model``'s): a pretrained start, which the syncer's outer lr ``auto`` takes 1.0 for.
"""

from . import _train_step, _wrap
from ._runtime import RUNTIME
from ._targets import Target

TARGET = "swift.megatron.trainers.base"
DISTRIBUTION = "ms-swift"
LAUNCHER = "ms-swift"
CLASS = "BaseMegatronTrainer"
METHODS = ("train_step", "save_checkpoint", "_load_checkpoint")
TARGETS = tuple(Target(TARGET, CLASS, m) for m in METHODS)
SUPPORTED_VERSIONS = {"ms-swift": ">=4.6.0,<4.7"}   # tested here: 4.6.0 (mcore-bridge 1.6.5, megatron-core 0.19.2)
# the writers ms-swift opens (on the last rank, --report_to; tensorboard is its default), where the island's
# figures go (yeto/*; YETO_DILOCO_FIGURES)
WRITERS = (("TensorBoard", "tensorboard", "TensorboardCallback.writer, with --report_to tensorboard (default)"),
           ("W&B", "wandb", "WandbCallback.writer, with --report_to wandb"))
_WRITER_CALLBACKS = ("TensorboardCallback", "WandbCallback")


def writers_of(trainer):
    """A function returning the writers of ms-swift's TensorBoard and W&B callbacks on this rank."""
    def writers() -> list:
        return [getattr(cb, "writer", None) for cb in getattr(trainer, "callbacks", None) or ()
                if type(cb).__name__ in _WRITER_CALLBACKS]
    return writers


def _int(v):
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def facts(trainer) -> dict:
    """What the engine needs, read from the trainer (missing pieces are None)."""
    args, state = getattr(trainer, "args", None), getattr(trainer, "state", None)
    out = dict(model=getattr(trainer, "wrapped_models", None), optimizer=getattr(trainer, "optimizer", None),
               iteration=_int(getattr(state, "iteration", None)), train_iters=_int(getattr(args, "train_iters", None)),
               tokens=None, vocab_size=None, writers=writers_of(trainer))
    seq = _int(getattr(args, "seq_length", None)) or _int(getattr(args, "max_length", None))
    gbs = _int(getattr(args, "global_batch_size", None))
    if seq and gbs:
        out["tokens"] = gbs * seq
    v = _int(getattr(getattr(trainer, "config", None), "vocab_size", None))
    out["vocab_size"] = v or None
    return out


def _stop_after_this_iteration(trainer, iteration):
    """ms-swift's loop runs while state.iteration < args.train_iters and saves when it reaches train_iters."""
    args = getattr(trainer, "args", None)
    if args is None or iteration is None or not hasattr(args, "train_iters"):
        return False
    args.train_iters = iteration + 1
    return True


def train_step_wrapper(wrapped, instance, args, kwargs):
    f = facts(instance)
    return _train_step.run(wrapped, args, kwargs, f,
                           on_early_exit=lambda: _stop_after_this_iteration(instance, f["iteration"]))


def save_checkpoint_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    state = getattr(instance, "state", None)
    directory, iteration = getattr(state, "last_model_checkpoint", None), _int(getattr(state, "iteration", None))
    if directory and iteration:
        RUNTIME.checkpoint_saved(directory, iteration)
    return result


def load_checkpoint_wrapper(wrapped, instance, args, kwargs):
    """After ``_load_checkpoint``: a resume (``--mcore_model DIR --finetune false``) restores the sync state saved
    with it. Every ms-swift run trains loaded weights (``--mcore_model``, or the Hugging Face model's, which
    ``prepare_model`` loaded before): without a sync state of this run beside them, a pretrained start."""
    result = wrapped(*args, **kwargs)
    a, state = getattr(instance, "args", None), getattr(instance, "state", None)
    directory = getattr(a, "mcore_model", None)
    if directory and not getattr(a, "finetune", True):
        RUNTIME.checkpoint_loaded(directory, _int(getattr(state, "iteration", None)) or 0, weights=True)
    else:
        source = directory or getattr(a, "model_dir", None) or getattr(a, "model", None)
        if isinstance(source, str) and source:
            RUNTIME.checkpoint_loaded(source, 0, weights=True)
    return result


_WRAPPERS = {"train_step": train_step_wrapper, "save_checkpoint": save_checkpoint_wrapper,
             "_load_checkpoint": load_checkpoint_wrapper}


patch, unpatch, patched = _wrap.hook(TARGET, [(CLASS, n, _WRAPPERS[n]) for n in METHODS], __name__,
                                     required=(CLASS,))

"""Hook for ``megatron.bridge.training.checkpointing`` (Megatron-Bridge's checkpoints): ``save_checkpoint`` and
``load_checkpoint``, called as globals of that module by its ``DefaultCheckpointManager``. The island's sync state
is saved beside every persistent checkpoint (in ``cfg.checkpoint.save``) and restored after a resume from
``cfg.checkpoint.load``, as for Megatron-LM's checkpoints (``mlm_training``); weights loaded with no sync state
beside them (``checkpoint.pretrained_checkpoint``: a fine-tune) are the run's pretrained start. Hugging Face
weights a provider loaded itself (``to_megatron_provider(load_weights=True)``) are seen by ``bridge_hf_weights``."""

from . import _train_step, _wrap
from ._runtime import RUNTIME
from ._targets import Target

TARGET = "megatron.bridge.training.checkpointing"
LAUNCHER = "Megatron-Bridge"
DISTRIBUTION = "megatron-bridge"
TARGETS = (Target(TARGET, None, "save_checkpoint"),   # island restart: sync state saved beside the checkpoint
           Target(TARGET, None, "load_checkpoint"))   # ... and restored from it
SUPPORTED_VERSIONS = {"megatron-bridge": ">=0.6.2,<0.7"}   # tested here: 0.6.2 (megatron-core 0.19.2)


def _step(state):
    try:
        v = int(state.train_state.step)
    except Exception:
        return None
    return v if v >= 0 else None


def save_checkpoint_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    bound = _train_step.bind(wrapped, args, kwargs)
    state = bound.get("state")
    directory = getattr(getattr(getattr(state, "cfg", None), "checkpoint", None), "save", None)
    iteration = _step(state)
    if directory and iteration and not bound.get("non_persistent_ckpt"):
        RUNTIME.checkpoint_saved(directory, iteration)
    return result


def _has_checkpoint(ckpt) -> bool:
    """Whether load_checkpoint will find weights: a checkpoint (Megatron's or a Hugging Face directory) in
    ``checkpoint.load``, or in ``checkpoint.pretrained_checkpoint``, which Bridge falls back to (a fine-tune)."""
    try:
        from megatron.bridge.training.checkpointing import checkpoint_exists, is_hf_checkpoint_dir
        return any(bool(d) and (checkpoint_exists(d) or is_hf_checkpoint_dir(d))
                   for d in (getattr(ckpt, "load", None), getattr(ckpt, "pretrained_checkpoint", None)))
    except Exception:  # noqa: BLE001 - another release, or a storage the check cannot read: said not loaded
        return False


def load_checkpoint_wrapper(wrapped, instance, args, kwargs):
    bound = _train_step.bind(wrapped, args, kwargs)
    state = bound.get("state")
    ckpt = getattr(getattr(state, "cfg", None), "checkpoint", None)
    weights = _has_checkpoint(ckpt)
    result = wrapped(*args, **kwargs)
    directory = getattr(ckpt, "load", None) or getattr(ckpt, "pretrained_checkpoint", None)
    if directory and isinstance(result, tuple) and result and isinstance(result[0], int):
        RUNTIME.checkpoint_loaded(directory, result[0], weights=weights)
    return result


patch, unpatch, patched = _wrap.hook(TARGET, [
    (None, "save_checkpoint", save_checkpoint_wrapper),
    (None, "load_checkpoint", load_checkpoint_wrapper)], __name__)

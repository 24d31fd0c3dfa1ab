"""Checkpoints of a custom training loop: tell yeto-patch what the loop saved and loaded.

Megatron-LM, Megatron-Bridge and ms-swift are hooked where they save and load (``mlm_training``,
``bridge_checkpointing``, ``swift_megatron``). A loop of its own (megatron-core's optimizer, the optimizer hooks
only) calls these two functions instead, on every rank of the island::

    from yeto_patch import hooks as yeto

    if resumed_iteration:                          # before the first optimizer step
        yeto.checkpoint_loaded(save_dir, resumed_iteration)
    elif loaded_pretrained_weights:                # a fine-tune: the syncer's outer lr auto goes by it
        yeto.checkpoint_loaded(pretrained_dir, 0, weights=True)
    ...
    save_my_checkpoint(save_dir, iteration)
    yeto.checkpoint_saved(save_dir, iteration)     # every rank: the island's sync state goes beside it

``iteration`` counts the optimizer steps the loop has done under DiLoCo (the steps ``YETO_DILOCO_TOTAL_STEPS``
counts). ``checkpoint_saved`` writes the island's sync state to ``<directory>/yeto_sync/iter_<N:07d>.bin``
(island/boundary/sync_state.py); ``checkpoint_loaded`` makes the island restore it when it starts, and continue
its step count from ``iteration``, so its boundaries and its final cut stay where they were.

Both are inert where yeto-patch is not attached (no ``YETO_*`` configuration, or ``YETO_DILOCO_DISABLE``): a
loop may call them unconditionally. Neither imports torch or Megatron.
"""
from __future__ import annotations

import logging
import operator
import os

from ._runtime import RUNTIME

__all__ = ["checkpoint_saved", "checkpoint_loaded"]

log = logging.getLogger("yeto_patch")


def _checked(directory, iteration, *, loaded: bool):
    if directory is not None and not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"yeto-patch: checkpoint directory must be a path, not {type(directory).__name__}")
    if iteration is None and loaded:
        return directory, 0
    if isinstance(iteration, bool):
        raise TypeError("yeto-patch: iteration must be an integer, not a bool")
    try:
        iteration = operator.index(iteration)
    except TypeError:
        raise TypeError(f"yeto-patch: iteration must be an integer, not {type(iteration).__name__}") from None
    if iteration < 0:
        raise ValueError(f"yeto-patch: iteration must be >= 0, not {iteration}")
    return (os.fspath(directory) if directory is not None else None), iteration


def checkpoint_saved(directory, iteration) -> None:
    """The loop saved the checkpoint of `iteration` into `directory`: the island writes its sync state beside it.
    Call it on every rank of the island (rank 0 writes; the others take part in draining the boundaries in
    flight), after the loop's own files are written. Raises on every rank if the island cannot write it."""
    directory, iteration = _checked(directory, iteration, loaded=False)
    if directory is None:
        raise ValueError("yeto-patch: checkpoint_saved needs the checkpoint directory")
    RUNTIME.checkpoint_saved(directory, iteration)


def checkpoint_loaded(directory, iteration, weights=None) -> None:
    """The loop resumed from the checkpoint of `iteration` in `directory`; call it on every rank before the first
    optimizer step (the island joins the syncer there). ``iteration`` 0 or None: nothing was loaded (a fresh
    start), unless ``weights=True``: the loop loaded pretrained weights from `directory` (a fine-tune), and the
    syncer's outer lr ``auto`` takes its fine-tune value. ``weights`` defaults to whether ``iteration`` > 0 (a
    resume loads its weights). Too late once the island started: then it is logged and ignored."""
    if weights is not None and not isinstance(weights, bool):
        raise TypeError(f"yeto-patch: weights must be True or False, not {type(weights).__name__}")
    directory, iteration = _checked(directory, iteration, loaded=True)
    engine = RUNTIME.engine
    if engine is not None and engine.started:
        log.warning("yeto-patch: checkpoint_loaded(%r, %d) after the island started: ignored (call it before the "
                    "first optimizer step)", directory, iteration)
        return
    RUNTIME.checkpoint_loaded(directory, iteration, weights=weights)

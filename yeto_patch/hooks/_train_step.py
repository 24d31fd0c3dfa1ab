"""Shared by the ``train_step`` hooks of Megatron-LM and Megatron-Bridge: call the engine around a training step
and, at the final cut, tell Megatron's loop to checkpoint and stop.

``train_step`` differs across releases (Megatron-LM 0.17 takes no ``pg_collection``/``p2p_communicator`` and
returns 7 values; 0.19 returns 8; Megatron-Bridge 0.6 takes 9 arguments, ``global_state`` among them, and returns
8; releases before 0.12 returned 4 values without the checkpoint/exit flags; ms-swift's
``BaseMegatronTrainer.train_step`` returns 3). Arguments are found by name through the wrapped function's
signature, so positional or keyword calls both work.

At the final cut:
- at the loop's own last iteration nothing is changed: the loop ends and saves as usual (iteration = train_iters);
- earlier (YETO_DILOCO_TOTAL_STEPS < train_iters), the loop is asked to stop through its own rule (the caller's
  ``on_early_exit``: Megatron-LM's and Bridge's exit interval = this iteration + 1, ms-swift's train_iters = this
  iteration + 1), so its checkpoint carries the right iteration number; when that is not available the returned
  flags ``(loss, skipped, should_checkpoint, should_exit, exit_code, ...)`` are set to checkpoint and exit
  (Megatron then labels the checkpoint with the iteration before this step's increment).
"""
from __future__ import annotations

import inspect
import logging

from ._runtime import RUNTIME

log = logging.getLogger("yeto_patch")

_sig_cache = {}


def bind(wrapped, args, kwargs) -> dict:
    """Arguments of this call by parameter name ({} if the signature cannot be read or bound)."""
    fn = inspect.unwrap(wrapped)
    sig = _sig_cache.get(fn)
    if sig is None:
        try:
            sig = _sig_cache[fn] = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = _sig_cache[fn] = False
    if sig is False:
        return dict(kwargs)
    try:
        return dict(sig.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


def run(wrapped, args, kwargs, facts: dict, on_early_exit=None):
    """Engine start/step around ``wrapped``; at a final cut before Megatron's last iteration, asks the loop to
    checkpoint and stop: through ``on_early_exit()`` when given (returns True if it arranged it), else through
    the returned flags."""
    RUNTIME.train_step_start(**facts)
    finished = False
    try:
        result = wrapped(*args, **kwargs)
    finally:
        finished = RUNTIME.train_step_end()
    if not finished:
        return result
    iteration, train_iters = facts.get("iteration"), facts.get("train_iters")
    if iteration is not None and train_iters is not None and iteration + 1 >= train_iters:
        # the loop ends here by itself and saves as usual, with the right iteration number
        log.info("yeto-patch: final cut installed at Megatron's last iteration %d; the loop ends and saves",
                 iteration + 1)
        return result
    if on_early_exit is not None and on_early_exit():
        log.info("yeto-patch: final cut installed at iteration %s; Megatron saves and exits after this iteration",
                 None if iteration is None else iteration + 1)
        return result
    return report_checkpoint_and_exit(result)


def report_checkpoint_and_exit(result):
    if isinstance(result, tuple) and len(result) >= 5:
        out = list(result)
        out[2] = True   # should_checkpoint
        out[3] = True   # should_exit
        if not out[4]:
            out[4] = 0  # exit_code
        log.info("yeto-patch: final cut installed; asking Megatron to checkpoint and exit")
        return tuple(out)
    log.error("yeto-patch: final cut installed but this train_step returns %r, which has no checkpoint/exit "
              "flags; stop the loop yourself (yeto_patch.island.engine.finished())", type(result).__name__)
    return result

"""Shared by the ``train_step`` hooks of Megatron-LM and Megatron-Bridge: call the engine around a training step
and, at the final cut, tell Megatron's loop to checkpoint and stop.

``train_step`` differs across releases (Megatron-LM 0.17 takes no ``pg_collection``/``p2p_communicator`` and
returns 7 values; 0.19 returns 8; Megatron-Bridge takes ``global_state`` and returns 7; releases before 0.12
returned 4 values without the checkpoint/exit flags). Arguments are found by name through the wrapped
function's signature, so positional or keyword calls both work, and the result is changed only in the three
flag positions ``(loss, skipped, should_checkpoint, should_exit, exit_code, ...)``.
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


def run(wrapped, args, kwargs, facts: dict, on_legacy_exit=None):
    """Engine start/step around ``wrapped``; rewrites the result at the final cut."""
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
    return report_checkpoint_and_exit(result, on_legacy_exit)


def report_checkpoint_and_exit(result, on_legacy_exit=None):
    if isinstance(result, tuple) and len(result) >= 5:
        out = list(result)
        out[2] = True   # should_checkpoint
        out[3] = True   # should_exit
        if not out[4]:
            out[4] = 0  # exit_code
        log.info("yeto-patch: final cut installed; asking Megatron to checkpoint and exit")
        return tuple(out)
    if on_legacy_exit is not None and on_legacy_exit():
        return result
    log.error("yeto-patch: final cut installed but this train_step returns %r, which has no checkpoint/exit "
              "flags; stop the loop yourself (yeto_patch.island.engine.finished())", type(result).__name__)
    return result

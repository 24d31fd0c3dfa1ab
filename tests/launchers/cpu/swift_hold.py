"""TEST-ONLY: with LAUNCHER_TEST_HOLD_AT=N, every rank of ms-swift's Megatron loop stops when N iterations are
done (at the entry of the next ``BaseMegatronTrainer.train_step``) and waits there to be killed, so a test stops
an island at a known point instead of racing its loop (the restart test: after checkpoint-2 and the push of
step 3, before step 4). Applied by tests/launchers/site/sitecustomize.py; nothing reaches ms-swift's command line."""
import os
import time

import wrapt

TARGET = "swift.megatron.trainers.base"


def _hold(at):
    def train_step(wrapped, instance, args, kwargs):
        if getattr(getattr(instance, "state", None), "iteration", None) == at:
            print(f"launcher test hold: {at} iterations done, waiting to be killed", flush=True)
            while True:
                time.sleep(60)
        return wrapped(*args, **kwargs)
    return train_step


def apply():
    at = os.environ.get("LAUNCHER_TEST_HOLD_AT")
    if not at:
        return
    wrapper = _hold(int(at))
    wrapt.register_post_import_hook(
        lambda module: wrapt.wrap_function_wrapper(module, "BaseMegatronTrainer.train_step", wrapper), TARGET)

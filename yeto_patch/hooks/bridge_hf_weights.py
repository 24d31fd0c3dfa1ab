"""Hook for ``megatron.bridge.models.conversion.model_bridge`` (Megatron-Bridge's Hugging Face conversion):
``MegatronModelBridge.load_weights_hf_to_megatron``. A provider made by ``AutoBridge.to_megatron_provider(
load_weights=True)`` (Bridge's fine-tune recipes from a Hugging Face model) runs it on the model before it is
wrapped, outside ``load_checkpoint``: the island learns here that its run starts from pretrained weights, which
every push then says (the syncer's outer lr ``auto`` takes its fine-tune value). A later ``load_checkpoint`` that
resumes the run's own checkpoint (``bridge_checkpointing``) decides instead: its sync state says how the run began.
"""

import os

from . import _wrap
from ._runtime import RUNTIME
from ._targets import Target

TARGET = "megatron.bridge.models.conversion.model_bridge"
LAUNCHER = "Megatron-Bridge"
DISTRIBUTION = "megatron-bridge"
CLASS = "MegatronModelBridge"
# optional: a release that renamed it loses only the fine-tune's outer lr, which --outer-lr 1.0 sets by hand
TARGETS = (Target(TARGET, CLASS, "load_weights_hf_to_megatron", required=False),)
SUPPORTED_VERSIONS = {"megatron-bridge": ">=0.6.2,<0.7"}   # tested here: 0.6.2


def _source(hf_pretrained) -> str:
    """A name for where the weights came from (the Hugging Face model's path when it says one)."""
    for attr in ("model_name_or_path", "name_or_path", "path"):
        v = getattr(hf_pretrained, attr, None)
        if isinstance(v, (str, os.PathLike)) and os.fspath(v):
            return os.fspath(v)
    return "a Hugging Face model"


def load_weights_wrapper(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    hf = args[0] if args else kwargs.get("hf_pretrained")
    RUNTIME.checkpoint_loaded(_source(hf), 0, weights=True)
    return result


patch, unpatch, patched = _wrap.hook(TARGET, [(CLASS, "load_weights_hf_to_megatron", load_weights_wrapper)],
                                     __name__, required=())

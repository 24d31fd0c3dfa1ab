"""Settings the island decides at its start, once the model is known: the ``auto`` values of config.TABLE that
depend on the model's size.

- Error feedback (``YETO_DILOCO_ERROR_FEEDBACK=auto``, the default): on for quantized pushes (every push dtype but
  ``f32``), because carrying the quantization residual into the next push is what keeps int4/int8 pushes as good
  as f32 ones over many rounds (docs/convergence.md); it costs 4 bytes per parameter on rank 0's host, so it stays
  off when that residual would take more than a quarter of the host's memory (a 120B model's residual is 480 GB),
  with a warning that names the variable.  An explicit ``0`` or ``1`` is kept as it is. int1 and the sparse
  family send only a sign or a fraction of each push: without error feedback the rest is lost for good, so an
  island that runs them without it (explicitly, or because the residual would not fit) is warned that way.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional, Tuple

from ..wire import codec_names

log = logging.getLogger("yeto_patch")

__all__ = ["resolve", "error_feedback", "host_memory_bytes", "needs_error_feedback"]

#: the largest share of rank 0's host memory the automatic error feedback may take
EF_MEMORY_SHARE = 0.25


def host_memory_bytes() -> Optional[int]:
    """Physical memory of this host (None when the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def error_feedback(push_dtype: str, numel: int, memory: Optional[int]) -> Tuple[bool, str]:
    """(on, why) of the automatic error feedback for a model of ``numel`` parameters."""
    if push_dtype == "f32":
        return False, "pushes are f32 (nothing is quantized)"
    need = 4 * int(numel)
    if memory is not None and need > EF_MEMORY_SHARE * memory:
        return False, (f"its residual ({need / 2**30:.1f} GiB on rank 0's host) would take more than a quarter of "
                       f"this host's memory ({memory / 2**30:.1f} GiB); set YETO_DILOCO_ERROR_FEEDBACK=1 to keep it "
                       f"on anyway")
    return True, f"{push_dtype} pushes carry their quantization residual ({need / 2**20:.1f} MiB on rank 0's host)"


def needs_error_feedback(push_dtype: str) -> bool:
    """Whether pushes in ``push_dtype`` lose most of each push without error feedback (int1: only signs; the
    sparse family: only a fraction of the values)."""
    return push_dtype == "int1" or codec_names.sparse(push_dtype) is not None


def resolve(settings, numel: int, rank: int, memory: Optional[int] = None):
    """``settings`` with every ``auto`` value decided for a model of ``numel`` parameters (said on rank 0)."""
    if settings.error_feedback is not None:
        if rank == 0 and not settings.error_feedback and needs_error_feedback(settings.push_dtype):
            log.warning("yeto-patch: %s pushes without error feedback (YETO_DILOCO_ERROR_FEEDBACK=0): what a push "
                        "does not send is lost for good and training drifts; set it to 1 or use int4",
                        settings.push_dtype)
        return settings
    on, why = error_feedback(settings.push_dtype, numel, host_memory_bytes() if memory is None else memory)
    if not on and needs_error_feedback(settings.push_dtype):
        why += f"; {settings.push_dtype} pushes without it lose what they do not send: use int4 instead"
    if rank == 0:
        (log.info if on or settings.push_dtype == "f32" else log.warning)(
            "yeto-patch: error feedback %s (YETO_DILOCO_ERROR_FEEDBACK=auto): %s", "on" if on else "off", why)
    return dataclasses.replace(settings, error_feedback=on)

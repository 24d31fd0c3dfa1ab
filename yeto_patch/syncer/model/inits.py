"""An INIT from the wire to the coordinator: whether the island may send it, its body read as checked float32
values, and their install as the fragment's initial base (docs/protocol.md, "Initialization: INIT"). Nothing here
keeps state: the coordinator owns the bases, ``Initializing`` the chosen island, and server.py (which holds its
INIT lock around this) answers a refusal and announces the run's start."""
from __future__ import annotations

import numpy as np

from .guard import too_large
from .initializer import Initializing
from ..rounds.coordinator import Coordinator
from ..rounds.pushes import PushRefused

__all__ = ["init_values", "take_init"]


def init_values(meta: dict, body) -> tuple:
    """(fragment, float32 values, body bytes) of an INIT message; PushRefused("bad-init") for a body that is not
    float32 or holds values too large for a usable base (KeyError, ValueError, TypeError: malformed)."""
    idx = meta["fragment"]
    mv = memoryview(body).cast("B")
    if meta.get("dtype", "f32") != "f32" or mv.nbytes % 4:
        raise PushRefused("bad-init", "INIT bodies are float32")
    arr = np.frombuffer(mv, np.float32)
    if arr.ctypes.data % 4 or not arr.flags.writeable:
        arr = arr.copy()
    why = too_large(f"INIT of fragment {idx}", arr)
    if why:
        raise PushRefused("bad-init", why + " (a base must stay usable)")
    return idx, arr, mv.nbytes


def take_init(coord: Coordinator, init: Initializing, s, meta: dict, body) -> tuple[bool, int]:
    """Install session ``s``'s INIT of one fragment: (True when every fragment has its base now, body bytes).
    Raises PushRefused whose message the ERROR ``init`` that answers it carries: an INIT after the run was
    initialized, from an island not asked for it, refused by the coordinator or malformed."""
    if coord.initialized:   # (docs/protocol.md: a second INIT is an ERROR init)
        raise PushRefused("init", "INIT after the run was initialized; refused")
    if not init.expects(s):
        raise PushRefused("init", "INIT not expected from this island (another island initializes the run)")
    try:
        idx, arr, nbytes = init_values(meta, body)
        return coord.init_fragment(idx, arr), nbytes
    except (KeyError, ValueError, TypeError) as e:
        raise PushRefused("init", f"malformed INIT: {e}") from None

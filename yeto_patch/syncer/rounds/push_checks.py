"""The checks a push passes before the coordinator takes it, holding no state: its counters, its fragment, base and
codec against the layout, and its standing against the fragment's state now (lag, duplicate). Each raises
``PushRefused`` naming what is wrong; separate from rounds.py, which owns the state they read and the rounds."""
from __future__ import annotations

from typing import Callable, Optional

from ...wire import codecs
from ...wire.frames import CodecError
from ..model.fragment import Fragment
from .settings import INT64_MAX, MAX_PATIENCE_S, MAX_PUSH_STEPS, MAX_PUSH_TOKENS, Push, PushRefused, bounded_int, shown

__all__ = ["check_counters", "push_target", "push_standing"]


def check_counters(p: Push) -> None:
    """Refuse a push whose step and token counters are out of range (exact in float64: syncer/rounds/weights.py); a
    patience that is not a number in range becomes None (unknown)."""
    for name, hi in (("local_step", INT64_MAX), ("steps", MAX_PUSH_STEPS), ("tokens", MAX_PUSH_TOKENS)):
        v = getattr(p, name)
        if not bounded_int(v, hi):
            raise PushRefused("bad-push", f"push reports {name} = {shown(v)}; need an integer in [0, {hi}]")
    pt = p.patience
    if not (isinstance(pt, (int, float)) and not isinstance(pt, bool) and 0 <= pt <= MAX_PATIENCE_S):
        p.patience = None


def push_target(p: Push, initialized: bool, frags: list,
                owner_refusal: Callable[[int, str], Optional[PushRefused]]) -> Fragment:
    """The fragment ``p`` is for, after checking that the run is initialized, that the fragment exists and this
    shard owns it (``owner_refusal``: Coordinator.owner_refusal), that its base exists and its codec is known."""
    if not initialized:
        raise PushRefused("not-initialized", "the run has no base yet (waiting for INIT); push refused")
    if not bounded_int(p.fragment, len(frags) - 1):
        raise PushRefused("bad-fragment", f"push for fragment {shown(p.fragment)}; the layout has "
                                          f"{len(frags)} fragments")
    wrong = owner_refusal(p.fragment, "push")
    if wrong is not None:
        raise wrong
    f = frags[p.fragment]
    if not bounded_int(p.base_version, f.version):
        raise PushRefused("bad-base", f"push of fragment {f.index} relative to base v{shown(p.base_version)}, "
                                      f"but the syncer's newest is v{f.version}")
    try:
        codecs.check_codec(p.codec, p.block)
    except CodecError as e:
        raise PushRefused("bad-codec", str(e)) from None
    return f


def push_standing(p: Push, f: Fragment, seen: set, max_base_lag: int) -> tuple[Optional[str], int]:
    """The checks of a push against the fragment's state now: ("closed", 0) when the fragment takes no more
    pushes, else (None, lag); raises PushRefused for a stale push or a duplicate (``seen``: accepted
    (island, fragment, base_version))."""
    if f.closed:
        return "closed", 0
    lag = f.version - p.base_version + (1 if f.round.closed else 0)
    if lag > max_base_lag:
        raise PushRefused("stale", f"push of fragment {f.index} is relative to base v{p.base_version} but the "
                                   f"syncer is at v{f.version} (lag {lag} > max-base-lag "
                                   f"{max_base_lag}); pull the current base and push again")
    if (p.island, f.index, p.base_version) in seen:
        raise PushRefused("duplicate", f"island {p.island!r} already pushed fragment {f.index} relative to "
                                       f"base v{p.base_version}; duplicate refused")
    return None, lag

"""Idempotent, undoable wrapping of class methods and module functions with wrapt (used by every hook module).

A wrapper installed here is a ``wrapt.FunctionWrapper`` carrying ``_self_yeto_state`` (a small dict), so a second
``wrap`` of the same attribute is a no-op and ``unwrap`` restores exactly the object that was there before.
When something else re-wrapped our wrapper afterwards (torch's optimizer profiling hook can do this to ``step``
of ``torch.optim.Optimizer`` subclasses), ``unwrap`` cannot splice it out; the wrapper then stays in place but
is switched off and calls straight through.
"""
from __future__ import annotations

import wrapt


class _YetoWrapper(wrapt.FunctionWrapper):
    """Our wrapper: a FunctionWrapper that carries its state dict (wrapt keeps ``_self_`` attributes on the proxy)."""

    def __init__(self, wrapped, wrapper, state: dict):
        super().__init__(wrapped, wrapper)
        self._self_yeto_state = state


def _own(owner, name):
    # the owner's own namespace only: an inherited attribute is wrapped where it is defined
    return vars(owner).get(name)


def _state(obj):
    """Our state dict if obj is our FunctionWrapper (or a bound view of it), else None."""
    if isinstance(obj, wrapt.ObjectProxy):
        for cand in (obj, getattr(obj, "_self_parent", None)):
            if isinstance(cand, _YetoWrapper):
                return cand._self_yeto_state
    return None


def _buried_state(obj):
    """Our state, directly or under other wrappers that keep ``__wrapped__`` (functools.wraps, wrapt), else None."""
    for _ in range(8):
        st = _state(obj)
        if st is not None:
            return st
        obj = getattr(obj, "__wrapped__", None)
        if obj is None:
            return None
    return None


def is_wrapped(owner, name) -> bool:
    st = _buried_state(_own(owner, name))
    return st is not None and st["enabled"]


def wrap(owner, name, wrapper, tag: str) -> bool:
    """Wrap ``owner.<name>`` (defined on owner itself) with ``wrapper(wrapped, instance, args, kwargs)``.
    Returns True if it wrapped now, False if it was already wrapped or is not defined on owner."""
    obj = _own(owner, name)
    if obj is None:
        return False
    st = _buried_state(obj)
    if st is not None:
        st["enabled"] = True
        return False
    if isinstance(obj, (staticmethod, classmethod)):
        raise TypeError(f"yeto-patch {tag}: {owner.__name__}.{name} is a {type(obj).__name__}; not supported")
    state = {"enabled": True, "tag": tag}

    def gated(wrapped, instance, args, kwargs):
        if not state["enabled"]:
            return wrapped(*args, **kwargs)
        return wrapper(wrapped, instance, args, kwargs)

    setattr(owner, name, _YetoWrapper(obj, gated, state))
    return True


def unwrap(owner, name) -> bool:
    """Undo ``wrap``: True if the original object was put back, False if there was nothing of ours on top (or
    ours sits under someone else's wrapper, in which case it is switched off)."""
    obj = _own(owner, name)
    st = _state(obj)
    if st is not None:
        st["enabled"] = False
        setattr(owner, name, obj.__wrapped__)
        return True
    st = _buried_state(obj)
    if st is not None:
        st["enabled"] = False
    return False


def hook(target: str, wraps, tag: str, required=()):
    """``(patch, unpatch, patched)`` of a hook module, written once for every hook: ``wraps`` lists
    ``(owner, attribute, wrapper)`` of module ``target``: a class name, or None for a module-level function. An
    attribute the owner does not define itself (inherited) is wrapped where it is defined, not here; an owner the
    module lacks is skipped unless it is in ``required`` (then ``patch`` raises AttributeError)."""
    import sys
    wraps = tuple(wraps)

    def owner_of(module, owner):
        return module if owner is None else getattr(module, owner, None)

    def patch(module=None) -> list:
        """Wrap what is defined (idempotent); returns what is wrapped."""
        module = module or sys.modules[target]
        for owner, attribute, wrapper in wraps:
            o = owner_of(module, owner)
            if o is None:
                if owner in required:
                    raise AttributeError(f"{target} has no {owner}")
                continue
            wrap(o, attribute, wrapper, tag)
        return _patched(module)

    def unpatch() -> None:
        module = sys.modules.get(target)
        for owner, attribute, _ in wraps if module is not None else ():
            o = owner_of(module, owner)
            if o is not None:
                unwrap(o, attribute)

    def _patched(module) -> list:
        out = []
        for owner, attribute, _ in wraps if module is not None else ():
            o = owner_of(module, owner)
            if o is not None and is_wrapped(o, attribute):
                out.append(f"{target}.{attribute}" if owner is None else f"{target}.{owner}.{attribute}")
        return out

    def patched() -> list:
        return _patched(sys.modules.get(target))

    return patch, unpatch, patched

"""What a hook module declares it patches, and where each declared target stands in this process.

A hook module lists its targets as data (see the package docstring for the format)::

    TARGETS = (Target("megatron.training.training", None, "train_step"),                       # a function
               Target("megatron.core.optimizer.optimizer", "FP32Optimizer", "step"),           # a method
               Target("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer", "step",
                      required=False))                                                          # where defined
    SUPPORTED_VERSIONS = {"megatron-core": ">=0.16"}

A target is *defined* when its owner (the module itself, or the named class of it) has the attribute in its OWN
namespace: an inherited method is wrapped where it is defined, by the target that names that class. A required
target that is not defined once its module is imported is an error (``missing``); an optional one is fine.
"""
from __future__ import annotations

import importlib.metadata
import re
import sys
from typing import NamedTuple, Optional

from . import _wrap

PATCHED, NOT_PATCHED, MISSING, NOT_IMPORTED = "patched", "not patched", "missing", "not imported"


class Target(NamedTuple):
    module: str              # dotted module name, e.g. "megatron.training.training"
    owner: Optional[str]     # class name inside the module; None: the attribute is a module-level function
    attribute: str           # e.g. "step", "train_step"
    required: bool = True    # False: may be absent (or inherited) in some releases

    @property
    def name(self) -> str:
        """``Owner.attribute`` (or ``attribute``), as doctor prints it."""
        return f"{self.owner}.{self.attribute}" if self.owner else self.attribute

    @property
    def qualname(self) -> str:
        """The dotted name ``patched()`` reports once it is wrapped."""
        return f"{self.module}.{self.name}"

    def owner_in(self, module):
        """The object holding the attribute (the module or its class), or None when the class is absent."""
        return module if self.owner is None else getattr(module, self.owner, None)

    def defined_in(self, module) -> bool:
        owner = self.owner_in(module)
        return owner is not None and self.attribute in vars(owner)

    def status(self) -> str:
        """patched / not patched (present; yeto-patch did not wrap it) / missing / not imported."""
        module = sys.modules.get(self.module)
        if module is None:
            return NOT_IMPORTED
        if not self.defined_in(module):
            return MISSING
        return PATCHED if _wrap.is_wrapped(self.owner_in(module), self.attribute) else NOT_PATCHED


def missing_required(targets, module) -> list:
    """The required targets of ``module`` (an imported module object) that it does not define."""
    return [t for t in targets if t.required and t.module == module.__name__ and not t.defined_in(module)]


# ------------------------------------------------------------------------------------------------ versions
def _numbers(version: str) -> tuple:
    out = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if not m:
            break
        out.append(int(m.group()))
    return tuple(out)


def version_ok(version: str, spec: str) -> Optional[bool]:
    """Whether ``version`` meets ``spec`` (comma-separated ``>=``, ``>``, ``<=``, ``<``, ``==`` clauses, or
    ``*``); None when either cannot be read."""
    have = _numbers(version)
    if not have:
        return None
    for clause in (c.strip() for c in spec.split(",")):
        if clause in ("", "*"):
            continue
        m = re.match(r"^(>=|<=|==|>|<)\s*([0-9][0-9.]*)$", clause)
        if not m:
            return None
        op, want = m.group(1), _numbers(m.group(2))
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        if not {">=": a >= b, "<=": a <= b, "==": a == b, ">": a > b, "<": a < b}[op]:
            return False
    return True


def versions(supported: dict) -> list:
    """(distribution, spec, installed version or None, ok) for each entry of a SUPPORTED_VERSIONS dict."""
    rows = []
    for dist, spec in supported.items():
        try:
            have = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            rows.append((dist, spec, None, None))
            continue
        rows.append((dist, spec, have, version_ok(have, spec)))
    return rows

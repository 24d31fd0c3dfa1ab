"""The codec names: the ONE list that config, island, syncer, benchmarks and docs use (stdlib only, so that
``yeto_patch.config`` can import it without numpy).

Dense codecs have fixed names (:data:`DENSE`). The sparse family is one name per (fraction, bits):
``topk:F+intB`` -- per block of ``block`` values, the ``K = max(1, round(F * block))`` largest by magnitude,
each sent as a ``B``-bit sign and magnitude code with a float32 scale per block and its index in the block
(docs/protocol.md, "Codecs"). ``F`` is written canonically: a decimal in ``[0.001, 0.5]`` with at most four
digits after the point and no trailing zero (``0.02``, not ``0.020`` or ``2e-2``); ``B`` is one of
:data:`SPARSE_BITS`. A peer's name is accepted only in its canonical spelling (one name per format), and
:func:`canonical` turns what a user typed (``TopK:0.020+INT2``) into it.
"""
from __future__ import annotations

import re
from typing import NamedTuple, Optional

__all__ = ["PLAIN", "BLOCK", "DENSE", "BASE_WIRE", "BASE_UPDATES", "SPARSE_BITS", "SPARSE_FORM", "MAX_NAME",
           "Sparse", "sparse", "known", "canonical", "describe", "is_blockwise", "examples", "base_wire_ok",
           "is_base_update", "describe_base_wire", "canonical_base_wire", "block_refusal"]

PLAIN = ("f32", "bf16")                       # one value after another
BLOCK = ("int8", "int4", "int4-log", "int1")  # a float32 scale per block, then one code per value
DENSE = PLAIN + BLOCK
BASE_WIRE = ("f32", "bf16", "int8", "int4")   # how a syncer may send merged bases (--base-wire), or any sparse name
BASE_UPDATES = ("int8", "int4")               # base updates relative to the island's previous base (and sparse ones)
SPARSE_BITS = (2, 4, 8)
SPARSE_FORM = "topk:F+intB"
SPARSE_MIN_E4, SPARSE_MAX_E4 = 10, 5000       # F in units of 1e-4: 0.001 .. 0.5
SPARSE_MAX_BLOCK = 1 << 16                    # indices are uint8 (block <= 256) or uint16 little-endian
MAX_NAME = 32                                 # longest name a peer may send

_SPARSE_RE = re.compile(r"^topk:0\.(\d{0,3}[1-9])\+int([248])$")
_USER_RE = re.compile(r"^\s*topk\s*:\s*(\d*\.?\d*)\s*\+\s*int(\d+)\s*$", re.I)


class Sparse(NamedTuple):
    """A parsed sparse codec name: ``frac_e4`` (F in units of 1e-4) and ``bits``."""
    name: str
    frac_e4: int
    bits: int

    def per_block(self, block: int) -> int:
        """K, the values kept per full block of ``block`` (integer arithmetic: every peer computes the same)."""
        return max(1, min(int(block), (self.frac_e4 * int(block) + 5000) // 10000))


def sparse(name) -> Optional[Sparse]:
    """The sparse codec ``name`` names in its canonical spelling (None: not one)."""
    if not isinstance(name, str) or len(name) > MAX_NAME:
        return None
    m = _SPARSE_RE.match(name)
    if not m:
        return None
    frac_e4 = int(m.group(1).ljust(4, "0"))
    if not SPARSE_MIN_E4 <= frac_e4 <= SPARSE_MAX_E4:
        return None
    return Sparse(name, frac_e4, int(m.group(2)))


def known(name) -> bool:
    return isinstance(name, str) and (name in DENSE or sparse(name) is not None)


def is_base_update(name) -> bool:
    """Whether merged bases sent as ``name`` go out as the encoded change from the base the island holds, the
    error carried by the syncer's shadow base (int8, int4 and every sparse name)."""
    return name in BASE_UPDATES or sparse(name) is not None


def base_wire_ok(name) -> bool:
    """Whether a syncer may send merged bases as ``name`` (--base-wire)."""
    return name in BASE_WIRE or sparse(name) is not None


def describe_base_wire() -> str:
    return f"{', '.join(BASE_WIRE)}, or {SPARSE_FORM} (as for pushes)"


def canonical_base_wire(text: str) -> Optional[str]:
    """The canonical --base-wire name of what a user typed (None: not a way to send bases)."""
    name = canonical(text)
    return name if base_wire_ok(name) else None


def is_blockwise(name: str) -> bool:
    """Whether ``name``'s layout is per block (a scale per block): every codec but f32 and bf16."""
    return name not in PLAIN


#: codecs whose codes pack several values a byte: the block (and so every piece) must fill whole bytes
_PACKED = {"int4": 2, "int4-log": 2, "int1": 8}


def block_refusal(name: str, block: int) -> Optional[str]:
    """Why codec ``name`` cannot use quantization blocks of ``block`` values (None: it can). The rule of the
    packed codecs; the sparse family's own bound on the block is checked by the wire layer."""
    per = _PACKED.get(name, 1)
    if block % per:
        return f"codec {name} needs a block that is a multiple of {per}, got {block}"
    return None


def describe() -> str:
    """The accepted names, for error messages and docs."""
    return (f"{', '.join(DENSE)}, or {SPARSE_FORM} (F in 0.001..0.5, at most 4 decimals; B in "
            f"{'/'.join(map(str, SPARSE_BITS))}; e.g. topk:0.02+int2)")


def examples() -> tuple:
    """A few sparse names (tests and fuzzers)."""
    return ("topk:0.02+int2", "topk:0.05+int4", "topk:0.1+int8", "topk:0.5+int2", "topk:0.001+int4")


def canonical(text: str) -> Optional[str]:
    """The canonical name of what a user typed (case and spacing free, ``0.020`` -> ``0.02``); None: no codec."""
    if not isinstance(text, str):
        return None
    t = text.strip()
    for d in DENSE:
        if t.lower() == d:
            return d
    m = _USER_RE.match(t)
    if not m or not m.group(1) or m.group(1) == ".":
        return None
    digits = m.group(1)
    whole, _, frac = digits.partition(".")
    if whole.strip("0") or len(frac.rstrip("0")) > 4:
        return None   # F >= 1 or more than 4 decimals
    name = f"topk:0.{frac.rstrip('0')}+int{int(m.group(2))}"
    return name if sparse(name) else None

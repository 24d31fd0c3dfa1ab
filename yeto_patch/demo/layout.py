"""Island layouts for the demo: ``tp2`` / ``pp2`` / ``tp2pp2`` / ``dp2`` ... -> (tp, pp, dp)."""
import re
from dataclasses import dataclass

__all__ = ["Layout", "parse_layout", "parse_layouts"]

_PART = re.compile(r"(tp|pp|dp)(\d+)")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def nproc(self):
        return self.tp * self.pp * self.dp

    @property
    def name(self):
        parts = [f"{k}{v}" for k, v in (("tp", self.tp), ("pp", self.pp), ("dp", self.dp)) if v > 1]
        return "".join(parts) or "single"

    def flags(self):
        return ["--tensor-model-parallel-size", str(self.tp), "--pipeline-model-parallel-size", str(self.pp)]


def parse_layout(text):
    s = text.strip().lower().replace("x", "").replace("-", "").replace("_", "")
    if s in ("single", "1", ""):
        return Layout()
    pos, got = 0, {}
    for m in _PART.finditer(s):
        if m.start() != pos or m.group(1) in got:
            break
        got[m.group(1)] = int(m.group(2))
        pos = m.end()
    if pos != len(s) or not got or any(v < 1 for v in got.values()):
        raise ValueError(f"layout {text!r} is not understood: use e.g. tp2, pp2, tp2pp2, dp2, single")
    return Layout(got.get("tp", 1), got.get("pp", 1), got.get("dp", 1))


def parse_layouts(text, islands):
    """Comma-separated layouts, repeated cyclically to `islands` entries."""
    items = [parse_layout(t) for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError("no layouts given")
    return [items[i % len(items)] for i in range(islands)]

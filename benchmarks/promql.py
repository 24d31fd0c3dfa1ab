"""The subset of PromQL the syncer's dashboard (docs/grafana/yeto-syncer.json) uses, parsed and evaluated over
scraped samples: so a test can check that every metric and label it queries is one the syncer exports, and
benchmarks/dashboard_shot.py can draw its panels from a real run without Grafana or Prometheus.

Supported: selectors ``name{label="v", label!="v", label=~"re"}``; ``rate`` / ``increase`` of a range
``name[...]`` (``$__rate_interval`` or ``30s`` / ``5m``); ``sum`` / ``count`` / ``max`` / ``min`` / ``avg`` with
``by (labels)`` before or after the argument; ``histogram_quantile(q, expr)``; binary ``*`` and ``/`` between an
expression and a number, or two expressions with the same labels. Anything else is a ``ValueError``.
"""
from __future__ import annotations

import math
import re
from typing import Dict, FrozenSet, List, NamedTuple, Optional, Tuple

Labels = FrozenSet[Tuple[str, str]]
Vector = Dict[Labels, float]
_TOKEN = re.compile(r'\s*(?:(?P<num>\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|'
                    r'(?P<var>\$__\w+)|(?P<id>[A-Za-z_:][\w:]*)|(?P<op>=~|!=|==|[-+*/(){}\[\],=]))')
AGGS = ("sum", "count", "max", "min", "avg")


class Node(NamedTuple):
    kind: str            # number, selector, range_fn, agg, quantile, binary
    value: object = None  # number; (name, matchers); fn name; agg name; q; operator
    args: tuple = ()
    by: Tuple[str, ...] = ()
    window: Optional[str] = None


def _tokens(text: str) -> List[Tuple[str, str]]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"cannot read PromQL at {text[pos:pos + 20]!r}")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


class _Parser:
    def __init__(self, text: str):
        self.t, self.i, self.text = _tokens(text), 0, text

    def peek(self, k=0):
        return self.t[self.i + k] if self.i + k < len(self.t) else (None, None)

    def take(self, value=None):
        kind, v = self.peek()
        if kind is None or (value is not None and v != value):
            raise ValueError(f"expected {value!r} in {self.text!r}, got {v!r}")
        self.i += 1
        return kind, v

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.t):
            raise ValueError(f"unexpected {self.peek()[1]!r} in {self.text!r}")
        return node

    def expr(self) -> Node:
        node = self.term()
        while self.peek()[1] in ("*", "/"):
            op = self.take()[1]
            node = Node("binary", op, (node, self.term()))
        return node

    def _by(self) -> Tuple[str, ...]:
        self.take("by")
        self.take("(")
        names = []
        while self.peek()[1] != ")":
            names.append(self.take()[1])
            if self.peek()[1] == ",":
                self.take(",")
        self.take(")")
        return tuple(names)

    def term(self) -> Node:
        kind, v = self.peek()
        if kind == "num":
            self.take()
            return Node("number", float(v))
        if v == "(":
            self.take("(")
            node = self.expr()
            self.take(")")
            return node
        if kind != "id":
            raise ValueError(f"unexpected {v!r} in {self.text!r}")
        if v in AGGS:
            self.take()
            by = self._by() if self.peek()[1] == "by" else ()
            self.take("(")
            arg = self.expr()
            self.take(")")
            if not by and self.peek()[1] == "by":
                by = self._by()
            return Node("agg", v, (arg,), by)
        if v in ("rate", "increase"):
            self.take()
            self.take("(")
            sel = self.selector()
            self.take("[")
            window = self.take()[1]
            if self.peek()[0] == "id":      # 5m: the number and its unit are two tokens
                window += self.take()[1]
            self.take("]")
            self.take(")")
            return Node("range_fn", v, (sel,), window=window)
        if v == "histogram_quantile":
            self.take()
            self.take("(")
            q = float(self.take()[1])
            self.take(",")
            arg = self.expr()
            self.take(")")
            return Node("quantile", q, (arg,))
        return self.selector()

    def selector(self) -> Node:
        kind, name = self.take()
        if kind != "id":
            raise ValueError(f"expected a metric name in {self.text!r}, got {name!r}")
        matchers = []
        if self.peek()[1] == "{":
            self.take("{")
            while self.peek()[1] != "}":
                label = self.take()[1]
                op = self.take()[1]
                kind, s = self.take()
                if kind != "str" or op not in ("=", "!=", "=~"):
                    raise ValueError(f"bad matcher {label}{op}{s} in {self.text!r}")
                matchers.append((label, op, s[1:-1]))
                if self.peek()[1] == ",":
                    self.take(",")
            self.take("}")
        return Node("selector", (name, tuple(matchers)))


def parse(text: str) -> Node:
    return _Parser(text).parse()


def selectors(node: Node) -> List[Tuple[str, Tuple[str, ...]]]:
    """(metric name, the labels the expression needs it to have) for every selector in `node`."""
    out = []

    def walk(n: Node, need: Tuple[str, ...]):
        if n.kind == "selector":
            name, matchers = n.value
            out.append((name, tuple(sorted(set(need) | {m[0] for m in matchers}))))
        elif n.kind == "agg":
            for a in n.args:
                walk(a, need + n.by)
        elif n.kind == "quantile":
            for a in n.args:
                walk(a, need + ("le",))
        else:
            for a in n.args:
                walk(a, need)
    walk(node, ())
    return out


# ------------------------------------------------------------------------------------------------ evaluation
def _seconds(window: str, rate_interval: float) -> float:
    if window == "$__rate_interval":
        return rate_interval
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h)", window)
    if m is None:
        raise ValueError(f"bad range {window!r}")
    return float(m.group(1)) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def _matches(labels: dict, matchers) -> bool:
    for label, op, want in matchers:
        have = labels.get(label, "")
        if (op == "=" and have != want) or (op == "!=" and have == want) or \
                (op == "=~" and re.fullmatch(want, have) is None):
            return False
    return True


class Samples:
    """Scrapes of a Prometheus text endpoint: [(time, {(name, labels): value})]."""

    def __init__(self, scrapes: List[Tuple[float, Dict[Tuple[str, Labels], float]]]):
        self.scrapes = sorted(scrapes, key=lambda s: s[0])

    def instant(self, t: float, name: str, matchers) -> Vector:
        for ts, data in reversed(self.scrapes):
            if ts <= t:
                return {lab: v for (n, lab), v in data.items() if n == name and _matches(dict(lab), matchers)}
        return {}

    def series(self, t: float, window: float, name: str, matchers) -> Dict[Labels, List[Tuple[float, float]]]:
        out: Dict[Labels, List[Tuple[float, float]]] = {}
        for ts, data in self.scrapes:
            if t - window < ts <= t:
                for (n, lab), v in data.items():
                    if n == name and _matches(dict(lab), matchers):
                        out.setdefault(lab, []).append((ts, v))
        return out


def _increase(points) -> Optional[float]:
    if len(points) < 2:
        return None
    inc = 0.0
    for (_, a), (_, b) in zip(points, points[1:]):
        inc += b - a if b >= a else b          # a counter reset starts again from zero
    return inc


def _quantile(q: float, buckets: List[Tuple[float, float]]) -> float:
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank, prev_le, prev_c = q * buckets[-1][1], 0.0, 0.0
    for le, c in buckets:
        if c >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0.0)
        prev_le, prev_c = le, c
    return buckets[-1][0]


def evaluate(node: Node, samples: Samples, t: float, rate_interval: float = 60.0):
    """A number or a Vector ({labels: value}) at time t."""
    k = node.kind
    if k == "number":
        return node.value
    if k == "selector":
        name, matchers = node.value
        return samples.instant(t, name, matchers)
    if k == "range_fn":
        name, matchers = node.args[0].value
        window = _seconds(node.window, rate_interval)
        out = {}
        for lab, pts in samples.series(t, window, name, matchers).items():
            inc = _increase(pts)
            if inc is None:
                continue
            span = pts[-1][0] - pts[0][0]
            rate = inc / span if span > 0 else 0.0
            out[lab] = rate if node.value == "rate" else rate * window
        return out
    if k == "agg":
        vec = evaluate(node.args[0], samples, t, rate_interval)
        groups: Dict[Labels, List[float]] = {}
        for lab, v in vec.items():
            key = frozenset((a, b) for a, b in lab if a in node.by)
            groups.setdefault(key, []).append(v)
        fn = {"sum": sum, "count": len, "max": max, "min": min, "avg": lambda xs: sum(xs) / len(xs)}[node.value]
        return {key: float(fn(vs)) for key, vs in groups.items() if vs}
    if k == "quantile":
        vec = evaluate(node.args[0], samples, t, rate_interval)
        groups: Dict[Labels, List[Tuple[float, float]]] = {}
        for lab, v in vec.items():
            d = dict(lab)
            le = d.pop("le", None)
            if le is None:
                continue
            groups.setdefault(frozenset(d.items()), []).append((float(le), v))
        return {key: _quantile(node.value, b) for key, b in groups.items()}
    if k == "binary":
        a, b = (evaluate(x, samples, t, rate_interval) for x in node.args)
        op = (lambda x, y: x * y) if node.value == "*" else (lambda x, y: x / y if y else math.nan)
        if isinstance(a, dict) and isinstance(b, dict):
            return {lab: op(v, b[lab]) for lab, v in a.items() if lab in b}
        if isinstance(a, dict):
            return {lab: op(v, b) for lab, v in a.items()}
        if isinstance(b, dict):
            return {lab: op(a, v) for lab, v in b.items()}
        return op(a, b)
    raise ValueError(f"cannot evaluate {k}")


def parse_exposition(text: str) -> Dict[Tuple[str, Labels], float]:
    """{(sample name, labels): value} of a Prometheus text exposition (what /metrics serves)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r'^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)', line)
        if m is None:
            continue
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out

"""The syncer's Grafana dashboard (docs/grafana/yeto-syncer.json) drawn over a real run, for the docs, where
Grafana cannot be installed (it is in neither Debian's archive nor PyPI, and npm carries only its libraries).

    python -m benchmarks.dashboard_shot --out /tmp/dash           # run, scrape, draw, screenshot
    python -m benchmarks.dashboard_shot --out /tmp/dash --series /tmp/dash/series.json   # draw again

1. runs ``yeto-patch demo`` (a real syncer and two real megatron-core islands, TP2 and DP2) with the syncer's
   ``--metrics-port``, scraped every ``--every`` seconds by Debian's Prometheus (benchmarks/prometheus_run.py,
   on loopback, with the alert rules loaded);
2. asks that Prometheus for every panel's PromQL over the run (``query_range``, one point per scrape: the queries
   as they are in the JSON; ``$__rate_interval`` = 4 scrape intervals, Grafana's rule) and keeps the answers in
   ``series.json``;
3. lays the panels out by their ``gridPos`` (24 columns) in Grafana's dark theme as SVG in an HTML page, and
   screenshots it with headless Chromium (``apt-get install chromium``) into ``--png``.
The picture is this renderer's, not Grafana's: same panels, queries, units and legends, plain drawing.
"""
from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import subprocess
import sys
import time

from benchmarks import headless
from benchmarks.prometheus_run import Prometheus, dashboard_queries
from tests.shim.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "yeto-syncer.json")
COLORS = ("#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9", "#FADE2A", "#96D98D")
COL_W, ROW_H = 56, 30   # px per grid column / grid row


def record(out: str, every: float, demo_args: list) -> str:
    """Run the demo under a real Prometheus; returns the path of series.json (every panel's query_range)."""
    port = free_port()
    cmd = [sys.executable, "-m", "yeto_patch.demo", "--out", os.path.join(out, "demo"),
           "--syncer-arg=--metrics-port", f"--syncer-arg={port}", *demo_args]
    with Prometheus(os.path.join(out, "prom"), syncers=[f"127.0.0.1:{port}"], scrape=f"{every:g}s") as prom:
        t0 = time.time()
        with open(os.path.join(out, "demo.log"), "w") as log:
            rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": ROOT}).returncode
        time.sleep(2 * every)   # (the last scrapes)
        t1 = time.time()
        if rc != 0:
            raise SystemExit(f"the demo failed (see {os.path.join(out, 'demo.log')})")
        queries = {expr: prom.query_range(expr, t0, t1, every) for _, expr in dashboard_queries(f"{4 * every:g}s")}
    path = os.path.join(out, "series.json")
    with open(path, "w") as f:
        json.dump({"t0": t0, "t1": t1, "every": every, "queries": queries}, f)
    empty = [e for e, r in queries.items() if not r]
    print(f"demo exited 0; {len(queries)} queries over {t1 - t0:.0f} s in {path}"
          + (f"; {len(empty)} with no series: {empty}" if empty else "; every one has series"))
    return path


def load(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _legend(fmt: str, labels) -> str:
    d = dict(labels)
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt)


def _fmt(v: float, unit: str) -> str:
    if v is None or math.isnan(v):
        return "-"
    if unit == "percentunit":
        return f"{100 * v:.0f}%"
    if unit == "Bps":
        for u, s in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
            if abs(v) >= s:
                return f"{v / s:.1f} {u}"
        return f"{v:.0f} B/s"
    if unit == "s":
        return f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.2f} s"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"


def series(panel: dict, run: dict) -> list:
    """[(legend, [(t, value)])] of a panel's queries (Prometheus' query_range answers)."""
    out = []
    for tgt in panel["targets"]:
        expr = tgt["expr"].replace("$__rate_interval", f"{4 * run['every']:g}s")
        for r in sorted(run["queries"].get(expr, []), key=lambda r: sorted(r["metric"].items())):
            pts = [(float(t), float(v)) for t, v in r["values"]]
            out.append((_legend(tgt.get("legendFormat") or tgt["expr"], r["metric"].items()), pts))
    return out


def svg_panel(panel: dict, lines: list, t0: float, t1: float) -> str:
    g = panel["gridPos"]
    w, h = g["w"] * COL_W - 8, g["h"] * ROW_H - 8
    unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
    title = html.escape(panel["title"])
    parts = [f'<svg width="{w}" height="{h}" xmlns="http://www.w3.org/2000/svg">',
             f'<rect width="{w}" height="{h}" rx="3" fill="#181b1f" stroke="#2c3235"/>',
             f'<text x="10" y="20" fill="#ccccdc" font-size="13" font-weight="500">{title}</text>']
    if panel["type"] == "stat":
        last = [pts[-1][1] for _, pts in lines if pts and not math.isnan(pts[-1][1])]
        val = _fmt(sum(last), unit) if last else "-"
        parts.append(f'<text x="{w / 2}" y="{h / 2 + 18}" fill="#73BF69" font-size="34" font-weight="600" '
                     f'text-anchor="middle">{val}</text>')
        return "".join(parts) + "</svg>"
    x0, x1, y0, y1 = 58, w - 12, 32, h - 22 - 14 * min(3, (len(lines) + 2) // 3)
    vals = [v for _, pts in lines for _, v in pts if v is not None and not math.isnan(v) and not math.isinf(v)]
    lo, hi = (min(vals + [0.0]), max(vals + [0.0])) if vals else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    for i in range(5):
        y = y1 - (y1 - y0) * i / 4
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{y:.1f}" y2="{y:.1f}" stroke="#2c3235"/>'
                     f'<text x="{x0 - 6}" y="{y + 4:.1f}" fill="#8e8e8e" font-size="10" text-anchor="end">'
                     f'{html.escape(_fmt(lo + (hi - lo) * i / 4, unit))}</text>')
    span = max(t1 - t0, 1e-9)
    for i in range(4):
        x = x0 + (x1 - x0) * i / 3
        anchor = ("start", "middle", "middle", "end")[i]
        parts.append(f'<text x="{x:.1f}" y="{y1 + 14}" fill="#8e8e8e" font-size="10" text-anchor="{anchor}">'
                     f'{time.strftime("%H:%M:%S", time.localtime(t0 + span * i / 3))}</text>')
    for k, (legend, pts) in enumerate(lines):
        c = COLORS[k % len(COLORS)]
        pen, path = [], []
        for t, v in pts:
            if v is None or math.isnan(v) or math.isinf(v):
                if path:
                    pen.append(path)
                path = []
                continue
            path.append(f"{x0 + (x1 - x0) * (t - t0) / span:.1f},{y1 - (y1 - y0) * (v - lo) / (hi - lo):.1f}")
        if path:
            pen.append(path)
        for p in pen:
            parts.append(f'<polyline points="{" ".join(p)}" fill="none" stroke="{c}" stroke-width="1.6"/>')
        lx, ly = 12 + (k % 3) * (w - 24) / 3, y1 + 30 + 14 * (k // 3)
        if k < 9:
            parts.append(f'<rect x="{lx:.0f}" y="{ly - 7:.0f}" width="12" height="3" fill="{c}"/>'
                         f'<text x="{lx + 16:.0f}" y="{ly - 2:.0f}" fill="#ccccdc" font-size="10">'
                         f'{html.escape(legend[:34])}</text>')
    return "".join(parts) + "</svg>"


def render(run: dict, out: str) -> str:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    t0, t1 = run["t0"], run["t1"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    body = []
    for p in dash["panels"]:
        g = p["gridPos"]
        body.append(f'<div style="position:absolute;left:{g["x"] * COL_W + 4}px;top:{g["y"] * ROW_H + 44}px">'
                    f'{svg_panel(p, series(p, run), t0, t1)}</div>')
    page = (f'<html><body style="margin:0;background:#111217;font-family:Inter,Helvetica,Arial,sans-serif;'
            f'width:{24 * COL_W + 8}px;height:{rows * ROW_H + 52}px;position:relative">'
            f'<div style="position:absolute;left:10px;top:12px;color:#ccccdc;font-size:17px">'
            f'{html.escape(dash["title"])} &#8212; Prometheus\' answers over a real run of {t1 - t0:.0f} s '
            f'(benchmarks/dashboard_shot.py; not Grafana)</div>{"".join(body)}</body></html>')
    path = os.path.join(out, "dashboard.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def screenshot(page: str, png: str, width: int, height: int) -> None:
    headless.screenshot("file://" + os.path.abspath(page), png, width, height)
    print("wrote", png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--series", help="draw this series.json again instead of running")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between scrapes")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "grafana", "yeto-syncer.png"))
    ap.add_argument("demo_args", nargs="*", default=["--short", "--layouts", "tp2,dp2", "--steps", "120",
                                                     "--sync-every", "10", "--fragments", "2"])
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = a.series or record(a.out, a.every, a.demo_args)
    page = render(load(path), a.out)
    with open(DASHBOARD) as f:
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in json.load(f)["panels"])
    screenshot(page, a.png, 24 * COL_W + 8, rows * ROW_H + 52)
    return 0


if __name__ == "__main__":
    sys.exit(main())

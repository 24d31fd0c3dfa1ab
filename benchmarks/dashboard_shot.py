"""The syncer's Grafana dashboard (docs/grafana/yeto-syncer.json) drawn over a real run, for the docs, where
Grafana cannot be installed (it is in neither Debian's archive nor PyPI, and npm carries only its libraries).

    python -m benchmarks.dashboard_shot --out /tmp/dash           # run, scrape, draw, screenshot
    python -m benchmarks.dashboard_shot --out /tmp/dash --scrapes /tmp/dash/scrapes.jsonl   # draw again

1. runs ``yeto-patch demo`` (a real syncer and two real megatron-core islands, TP2 and DP2) with the syncer's
   ``--metrics-port``, and scrapes its ``/metrics`` every ``--every`` seconds (``scrapes.jsonl``), as Prometheus
   would;
2. evaluates every panel's PromQL over those scrapes at each scrape time (benchmarks/promql.py: the queries as
   they are in the JSON; ``$__rate_interval`` = 4 scrape intervals, Grafana's rule for a 15 s scrape);
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
import shutil
import subprocess
import sys
import time
import urllib.request

from benchmarks import promql
from tests.shim.procs import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "docs", "grafana", "yeto-syncer.json")
COLORS = ("#73BF69", "#F2CC0C", "#8AB8FF", "#FF780A", "#F2495C", "#5794F2", "#B877D9", "#FADE2A", "#96D98D")
COL_W, ROW_H = 56, 30   # px per grid column / grid row


def record(out: str, every: float, demo_args: list) -> str:
    port = free_port()
    path = os.path.join(out, "scrapes.jsonl")
    cmd = [sys.executable, "-m", "yeto_patch.demo", "--out", os.path.join(out, "demo"),
           "--syncer-arg=--metrics-port", f"--syncer-arg={port}", *demo_args]
    log = open(os.path.join(out, "demo.log"), "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": ROOT})
    n = 0
    with open(path, "w") as f:
        while proc.poll() is None:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
                f.write(json.dumps({"t": time.time(), "text": text}) + "\n")
                f.flush()
                n += 1
            except OSError:
                pass
            time.sleep(every)
    print(f"demo exited {proc.returncode}; {n} scrapes in {path}")
    if proc.returncode != 0:
        raise SystemExit(f"the demo failed (see {os.path.join(out, 'demo.log')})")
    return path


def load(path: str) -> promql.Samples:
    scrapes = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            scrapes.append((r["t"], promql.parse_exposition(r["text"])))
    return promql.Samples(scrapes)


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


def series(panel: dict, s: promql.Samples, step: float, rate_interval: float) -> list:
    """[(legend, [(t, value)])] of a panel's queries at every scrape time."""
    out = []
    times = [t for t, _ in s.scrapes]
    for tgt in panel["targets"]:
        node = promql.parse(tgt["expr"])
        lines = {}
        for t in times:
            v = promql.evaluate(node, s, t, rate_interval)
            vec = v if isinstance(v, dict) else {frozenset(): v}
            for lab, x in vec.items():
                lines.setdefault(lab, []).append((t, x))
        for lab, pts in sorted(lines.items(), key=lambda kv: sorted(kv[0])):
            out.append((_legend(tgt.get("legendFormat") or tgt["expr"], lab), pts))
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


def render(samples: promql.Samples, out: str, every: float) -> str:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    t0, t1 = samples.scrapes[0][0], samples.scrapes[-1][0]
    rate_interval = 4 * every
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"])
    body = []
    for p in dash["panels"]:
        g = p["gridPos"]
        body.append(f'<div style="position:absolute;left:{g["x"] * COL_W + 4}px;top:{g["y"] * ROW_H + 44}px">'
                    f'{svg_panel(p, series(p, samples, every, rate_interval), t0, t1)}</div>')
    page = (f'<html><body style="margin:0;background:#111217;font-family:Inter,Helvetica,Arial,sans-serif;'
            f'width:{24 * COL_W + 8}px;height:{rows * ROW_H + 52}px;position:relative">'
            f'<div style="position:absolute;left:10px;top:12px;color:#ccccdc;font-size:17px">'
            f'{html.escape(dash["title"])} &#8212; drawn from {len(samples.scrapes)} scrapes of a real run '
            f'(benchmarks/dashboard_shot.py; not Grafana)</div>{"".join(body)}</body></html>')
    path = os.path.join(out, "dashboard.html")
    with open(path, "w") as f:
        f.write(page)
    return path


def screenshot(page: str, png: str, width: int, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium here: apt-get install chromium (the page is at " + page + ")")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size={width},{height}", f"--screenshot={os.path.abspath(png)}",
                    "file://" + os.path.abspath(page)], check=True, timeout=120, capture_output=True)
    print("wrote", png)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scrapes", help="draw these scrapes again instead of running")
    ap.add_argument("--every", type=float, default=2.0, help="seconds between scrapes")
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "grafana", "yeto-syncer.png"))
    ap.add_argument("demo_args", nargs="*", default=["--short", "--layouts", "tp2,dp2", "--steps", "120",
                                                     "--sync-every", "10", "--fragments", "2"])
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = a.scrapes or record(a.out, a.every, a.demo_args)
    samples = load(path)
    page = render(samples, a.out, a.every)
    with open(DASHBOARD) as f:
        rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in json.load(f)["panels"])
    screenshot(page, a.png, 24 * COL_W + 8, rows * ROW_H + 52)
    return 0


if __name__ == "__main__":
    sys.exit(main())

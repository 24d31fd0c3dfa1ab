"""Loss-curve plots: PNG with matplotlib when it is installed (``pip install yeto-patch[plot]``), and always an
SVG written by hand (no dependency), so every demo run leaves a picture behind."""
import math

__all__ = ["ema", "plot_losses"]

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def ema(values, beta=0.9):
    out, m = [], None
    for v in values:
        if v is None or not math.isfinite(v):
            out.append(m)
            continue
        m = v if m is None else beta * m + (1 - beta) * v
        out.append(m)
    return out


def _png(path, series, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for i, s in enumerate(series):
        c = s.get("color", COLORS[i % len(COLORS)])
        xs, ys = zip(*[(x, y) for x, y in s["points"] if y is not None]) if s["points"] else ((), ())
        if s.get("markers"):
            ax.plot(xs, ys, marker="o", linestyle="--", color=c, label=s["label"])
        else:
            ax.plot(xs, ys, color=c, label=s["label"], linewidth=1.4)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _nice_ticks(lo, hi, n=6):
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    t = math.ceil(lo / step) * step
    out = []
    while t <= hi + 1e-9:
        out.append(round(t, 10))
        t += step
    return out


def _svg(path, series, title, w=900, h=500):
    pts = [(x, y) for s in series for x, y in s["points"] if y is not None and math.isfinite(y)]
    if not pts:
        return False
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    pad = (y1 - y0) * 0.05 or 0.1
    y0, y1 = y0 - pad, y1 + pad
    if x1 == x0:
        x1 = x0 + 1
    L, R, T, B = 70, 20, 40, 50
    X = lambda x: L + (x - x0) / (x1 - x0) * (w - L - R)  # noqa: E731
    Y = lambda y: T + (1 - (y - y0) / (y1 - y0)) * (h - T - B)  # noqa: E731
    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
         f'<rect width="{w}" height="{h}" fill="white"/>',
         f'<text x="{w / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>']
    for t in _nice_ticks(y0, y1):
        o.append(f'<line x1="{L}" x2="{w - R}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" stroke="#ddd"/>'
                 f'<text x="{L - 6}" y="{Y(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    for t in _nice_ticks(x0, x1):
        o.append(f'<line y1="{T}" y2="{h - B}" x1="{X(t):.1f}" x2="{X(t):.1f}" stroke="#eee"/>'
                 f'<text x="{X(t):.1f}" y="{h - B + 16}" text-anchor="middle">{t:g}</text>')
    o.append(f'<rect x="{L}" y="{T}" width="{w - L - R}" height="{h - T - B}" fill="none" stroke="#333"/>')
    o.append(f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">step</text>')
    o.append(f'<text x="16" y="{h / 2}" text-anchor="middle" transform="rotate(-90 16 {h / 2})">'
             f'loss (nats/byte)</text>')
    for i, s in enumerate(series):
        c = s.get("color", COLORS[i % len(COLORS)])
        p = [(X(x), Y(y)) for x, y in s["points"] if y is not None and math.isfinite(y)]
        if not p:
            continue
        d = " ".join(f"{a:.1f},{b:.1f}" for a, b in p)
        dash = ' stroke-dasharray="5,4"' if s.get("markers") else ""
        o.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5"{dash} points="{d}"/>')
        if s.get("markers"):
            o += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="3.5" fill="{c}"/>' for a, b in p]
        ly = T + 16 + 18 * i
        o.append(f'<line x1="{w - R - 250}" x2="{w - R - 225}" y1="{ly - 4}" y2="{ly - 4}" stroke="{c}" '
                 f'stroke-width="2"{dash}/><text x="{w - R - 220}" y="{ly}">{s["label"]}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o))
    return True


def plot_losses(base_path, series, title):
    """Write base_path.svg (always) and base_path.png (if matplotlib is installed).
    series: [{"label", "points": [(step, loss)], "markers": bool}]. Returns (written paths, note)."""
    written, note = [], None
    if _svg(base_path + ".svg", series, title):
        written.append(base_path + ".svg")
    if _png(base_path + ".png", series, title):
        written.append(base_path + ".png")
    else:
        note = "PNG plot skipped: matplotlib is not installed (pip install 'yeto-patch[plot]'); the SVG has the same curves"
    return written, note

"""The demo's closing table, summary.md, result.json fields and the loss plot."""
import math
import os
import zipfile

import numpy as np

from .plot import ema, plot_losses
from .progress import boundary_bytes, fmt_bytes
from .readers import read_jsonl

__all__ = ["build_report", "compare_npz", "allreduce_bytes"]


def allreduce_bytes(params, islands, steps, grad_bytes=4):
    """Bytes that would cross between the islands if they trained as one synchronous data-parallel job:
    a ring all-reduce of the FP32 gradient (Megatron reduces gradients in FP32 here) every step; each of the M
    islands sends 2 (M - 1) / M of the gradient per step."""
    return int(steps * islands * 2 * (islands - 1) / islands * params * grad_bytes)


def _read_npz(path):
    """{name: array} of an .npz without pickle."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for n in z.namelist():
            with z.open(n) as f:
                out[n[:-4] if n.endswith(".npy") else n] = np.lib.format.read_array(f, allow_pickle=False)
    return out


def compare_npz(paths):
    """(identical: bool, detail: str, max_abs_diff) comparing every array of every file bit for bit."""
    if len(paths) < 2:
        return None, "only one island", 0.0
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return False, f"missing model file(s): {', '.join(missing)}", float("nan")
    ref = _read_npz(paths[0])
    worst, first_bad, n = 0.0, None, 0
    for p in paths[1:]:
        other = _read_npz(p)
        if sorted(other) != sorted(ref):
            diff = sorted(set(other) ^ set(ref))
            return False, f"{os.path.basename(p)} has different parameter names (e.g. {diff[:3]})", float("nan")
        for k in sorted(ref):
            a, b = ref[k], other[k]
            n += a.size
            if a.shape != b.shape:
                return False, f"{k}: shape {a.shape} vs {b.shape} in {os.path.basename(p)}", float("nan")
            if a.tobytes() != b.tobytes():
                d = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))
                worst = max(worst, d)
                first_bad = first_bad or k
    if first_bad:
        return False, f"differ, first at {first_bad} (max |diff| {worst:.3g})", worst
    kinds = sorted({k.split("/", 1)[0] for k in ref})
    return True, f"bit-identical ({len(ref)} arrays: {', '.join(kinds)}; {n // (len(paths) - 1):,} values)", 0.0


def _events(recs, ev):
    return [r for r in recs if r.get("event") == ev]


def _final(recs):
    end = _events(recs, "end")
    if end:
        return end[-1].get("final_heldout_loss"), end[-1].get("initial_heldout_loss")
    ev = _events(recs, "eval")
    return (ev[-1]["heldout_loss"] if ev else None), (ev[0]["heldout_loss"] if ev else None)


def _f(x, nd=4):
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"


def _byte_rows(result, o, ar_diloco) -> list:
    """The report's bytes table: (what, bytes, note) rows from the result's byte counts."""
    r, rows = result, []
    steps, warm, ar = o.steps, r["warmup_steps"], r["allreduce_bytes"]
    if not o.without_yeto:
        rows.append(("islands -> syncer (measured on the link)", fmt_bytes(r["bytes_up"]),
                     f"of which {r['pushes']} delta pushes {fmt_bytes(r['bytes_pushed'])} ({o.push_dtype})"))
        rows.append(("syncer -> islands (measured on the link)", fmt_bytes(r["bytes_down"]),
                     f"bases after {r['merges']} merges ({o.base_wire}), initial + final model (f32)"))
        rows.append(("total between islands and syncer", fmt_bytes(r["bytes_between"]), ""))
    if warm and ar:
        rows.append((f"synchronous warm-up: {warm} steps of all-reduce", fmt_bytes(r["warmup_allreduce_bytes"]),
                     "counted with the DiLoCo bytes in the ratios below"))
        if r.get("bytes_ratio_diloco_only") and r.get("upload_ratio_diloco_only"):
            rows.append((f"DiLoCo only: all-reduce of its {steps - warm} steps", fmt_bytes(ar_diloco),
                         f"{r['bytes_ratio_diloco_only']:.0f}x the total; "
                         f"{r['upload_ratio_diloco_only']:.0f}x the pushes"))
    if ar:
        rows.append(("per-step FP32 gradient all-reduce, same steps", fmt_bytes(ar),
                     (f"{r['bytes_ratio']:.0f}x the total; {r['upload_ratio']:.0f}x the pushes"
                      if r.get("bytes_ratio") and r.get("upload_ratio") else "")))
    return rows


def _loss_series(isl, base, ids) -> list:
    """The plot's curves: each island's and the baseline's training loss (EMA), held-out losses as markers."""
    series = []
    for i in ids:
        tr = _events(isl[i], "train")
        series.append({"label": f"island {i} (train, EMA)",
                       "points": list(zip([r["step"] for r in tr], ema([r["loss"] for r in tr])))})
    if base:
        tr = _events(base, "train")
        series.append({"label": "sync DP baseline (train, EMA)", "color": "#555555",
                       "points": list(zip([r["step"] for r in tr], ema([r["loss"] for r in tr])))})
    for i in ids[:1]:
        ev = _events(isl[i], "eval")
        series.append({"label": f"island {i} held-out", "markers": True,
                       "points": [(r["step"], r["heldout_loss"]) for r in ev]})
    if base:
        ev = _events(base, "eval")
        series.append({"label": "baseline held-out", "markers": True, "color": "#000000",
                       "points": [(r["step"], r["heldout_loss"]) for r in ev]})
    return series


def build_report(result, o):
    out = result["out"]
    ids = result["ids"]
    isl = {i: read_jsonl(os.path.join(out, f"island-{i}.jsonl")) for i in ids}
    bounds = {i: read_jsonl(os.path.join(out, f"island-{i}.boundaries.jsonl")) for i in ids}
    tape = read_jsonl(os.path.join(out, "syncer-tape.jsonl"))
    base = read_jsonl(os.path.join(out, "baseline.jsonl")) if result.get("baseline") else []
    finals = {i: _final(isl[i]) for i in ids}
    start = _events(isl[ids[0]], "start")
    params = start[0]["params"] if start else None
    steps = o.steps
    island_final = [finals[i][0] for i in ids if finals[i][0] is not None]
    global_loss = float(np.mean(island_final)) if island_final else None
    initial = finals[ids[0]][1]
    base_final, base_initial = _final(base) if base else (None, None)
    warm = getattr(o, "sync_warmup", 0) or 0
    base_at_warm = [r["heldout_loss"] for r in _events(base, "eval") if r.get("step") == warm]
    ratio = global_loss / base_final if global_loss and base_final else None
    # bytes that crossed between islands and the syncer, measured on the demo's link (both ways)
    pushed = sum(boundary_bytes(r) for i in ids for r in bounds[i])
    n_push = sum(1 for i in ids for r in bounds[i] if r.get("event") == "boundary")
    merges = sum(1 for r in tape if r.get("ok", True))
    link = result.get("link") or {}
    up, down = link.get("up", 0), link.get("down", 0)
    total = up + down
    ar = allreduce_bytes(params, len(ids), steps) if params else None
    # a synchronous warm-up (--sync-warmup K) all-reduced every one of its K steps: those bytes count against
    # DiLoCo; the "DiLoCo only" ratios compare the islands' N - K steps with what crossed while they ran
    ar_warm = allreduce_bytes(params, len(ids), warm) if params else 0
    ar_diloco = allreduce_bytes(params, len(ids), steps - warm) if params else None
    identical, detail, _ = compare_npz([os.path.join(out, f"island-{i}.npz") for i in ids]) \
        if not o.without_yeto else (None, "not compared (islands trained independently)", 0.0)
    result.update(initial_heldout_loss=initial, island_final_heldout_loss={i: finals[i][0] for i in ids},
                  global_heldout_loss=global_loss, baseline_heldout_loss=base_final, loss_ratio=ratio,
                  params=params, bytes_pushed=pushed, pushes=n_push, bytes_up=up, bytes_down=down,
                  bytes_between=total, merges=merges, allreduce_bytes=ar,
                  bytes_ratio=(ar / (total + ar_warm)) if ar and total else None,
                  upload_ratio=(ar / (pushed + ar_warm)) if ar and pushed else None,
                  warmup_steps=warm, warmup_allreduce_bytes=ar_warm,
                  baseline_heldout_at_warmup=base_at_warm[-1] if warm and base_at_warm else None,
                  bytes_ratio_diloco_only=(ar_diloco / total) if ar_diloco and total else None,
                  upload_ratio_diloco_only=(ar_diloco / pushed) if ar_diloco and pushed else None,
                  islands_identical=identical, islands_compare=detail)
    name = "DiLoCo via yeto-patch" if not o.without_yeto else "independent islands (no yeto-patch)"
    rows = [(f"model after the synchronous warm-up (step {warm})" if warm else "initial model (held-out loss)",
             _f(initial), "")]
    for i in ids:
        rows.append((f"  island {i} after the final cut" if not o.without_yeto else f"  island {i}",
                     _f(finals[i][0]), ""))
    rows.append((f"{name}: final global model" if not o.without_yeto else "mean of the independent islands",
                 _f(global_loss),
                 f"{ratio:.4f}x baseline" if ratio else ""))
    if base:
        bw = result["baseline"].get("wall_s")
        rows.append(("synchronous data parallel, same tokens", _f(base_final),
                     "cached" if result["baseline"].get("cached") else f"trained in {bw:.0f}s"))
    brows = _byte_rows(result, o, ar_diloco)
    lines = ["", "=" * 78, f"{'held-out loss (nats/byte)':52s} {'':>10s}", "-" * 78]
    lines += [f"{a:52s} {b:>10s}  {c}" for a, b, c in rows]
    lines += ["-" * 78, "bytes"] + [f"  {a:50s} {b:>10s}  {c}" for a, b, c in brows]
    lines += ["-" * 78,
              f"{'wall time: islands':52s} {result['islands_wall_s']:>9.0f}s",
              f"{'wall time: whole demo':52s} {result['wall_s']:>9.0f}s"]
    if identical is not None or not o.without_yeto:
        lines.append(f"{'islands hold the same final model':52s} {('yes' if identical else 'NO'):>10s}  {detail}")
    lines.append("=" * 78)
    written, note = plot_losses(os.path.join(out, "losses"), _loss_series(isl, base, ids),
                                f"{name}: {len(ids)} islands, H={o.sync_every}, {o.push_dtype}")
    lines.append(f"plots: {', '.join(written) or 'none'}" + (f"\n{note}" if note else ""))
    lines.append(f"raw JSONL and logs: {out}")
    text = "\n".join(lines)
    print(text, flush=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("```\n" + text.strip() + "\n```\n")
    result["plots"] = written



"""The syncer's status page: ``GET /status`` on its metrics port (``--metrics-port``; same bounded server, same
bind address), a small read-only HTML page a person reads to see whether the run is healthy.

It shows the run id and shard; each island with its state (up / down since / finished), step and pace (steps/s,
as its heartbeats say), pushes by outcome and the time since its last push, its bytes; each fragment with its
version, the time since its last merge and its round period, who its open round has and waits for; refusals by
island and code; bytes in and out. Every string a peer supplied (island ids, refusal codes) and the run id are
HTML-escaped and cut to a bound; the page carries no script and loads nothing (its Content-Security-Policy
forbids both; it refreshes itself every 10 s with a meta tag).
"""
from __future__ import annotations

import html
import time
from typing import Callable, Dict, List, Optional, Tuple

from ...wire.scrape_server import Page
from ...wire.text import printable

__all__ = ["StatusPage", "HEADERS", "MAX_ISLAND_ROWS"]

HEADERS = (("Content-Security-Policy", "default-src 'none'; style-src 'unsafe-inline'; base-uri 'none'; "
            "form-action 'none'; frame-ancestors 'none'"),
           ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-store"))
MAX_ISLAND_ROWS = 256
MAX_TEXT = 80
STYLE = ("body{font:14px system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}"
         "h1{font-size:20px}h2{font-size:16px;margin-top:20px}table{border-collapse:collapse;background:#fff}"
         "td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#eee}"
         ".up{color:#176b1c}.down{color:#b00020;font-weight:600}.fin{color:#555}.muted{color:#777}")


def esc(s, limit: int = MAX_TEXT) -> str:
    """A peer-supplied (or any) value as HTML text: control characters shown as escapes, cut to `limit`
    characters, then HTML-escaped (quotes too)."""
    return html.escape(printable(s, limit), quote=True)


class StatusPage:
    """``render()`` -> a ``Page`` of the syncer's state now. `metrics`: the syncer's ``Metrics``; `coord`: its
    coordinator (members, roster and fragments, read under its lock); `run_id`: a callable giving the run id."""

    def __init__(self, metrics, coord, run_id: Callable[[], str], shard: str = "0/1",
                 wall: Callable[[], float] = time.time):
        self.metrics, self.coord, self.run_id, self.shard, self.wall = metrics, coord, run_id, shard, wall

    def render(self) -> Page:
        samples = self._samples()
        islands, fragments = self._state()
        body = "".join((
            f"<h1>yeto-syncer: run {esc(self.run_id())}</h1>",
            f'<p class="muted">shard {esc(self.shard)} &middot; {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.wall()))}'
            " &middot; refreshes every 10 s &middot; <a href=\"/metrics\">/metrics</a></p>",
            self._islands(islands, samples), self._fragments(fragments, samples), self._refusals(samples),
            self._bytes(samples)))
        page = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" '
                f'content="10"><title>yeto-syncer status</title><style>{STYLE}</style></head><body>{body}'
                "</body></html>")
        return Page(page.encode("utf-8"), "text/html; charset=utf-8", HEADERS)

    # ----------------------------------------------------------------------------------------- reading
    def _samples(self) -> Dict[str, List[Tuple[dict, float]]]:
        out: Dict[str, List[Tuple[dict, float]]] = {}
        for fam in self.metrics.registry.collect():
            for s in fam.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    def _state(self) -> Tuple[list, list]:
        """(islands, fragments) as the coordinator shows them (rounds/coordinator.py: ``islands_view`` and
        ``rounds_view``)."""
        c = self.coord
        with c.lock:
            now = c.clock()
            islands = []
            for m in c.islands_view(now)[:MAX_ISLAND_ROWS]:
                state = ("fin", "finished") if m.finished else ("up", "up") if m.up else \
                    ("down", f"down {_age(m.down_s)}")
                islands.append((m.island, state, m.step, m.rate, m.pushes, m.tokens))
            fragments = [(r.fragment, r.version, r.closed, r.answered, r.waits, r.age) for r in c.rounds_view(now)]
        return islands, fragments

    # ----------------------------------------------------------------------------------------- sections
    def _islands(self, islands: list, s: dict) -> str:
        now = self.wall()
        last_push = {lab["island"]: v for lab, v in s.get("yeto_syncer_island_last_push_timestamp_seconds", [])}
        nbytes = {lab["island"]: v for lab, v in s.get("yeto_syncer_island_bytes_received_total", [])}
        outcomes: Dict[str, Dict[str, float]] = {}
        for lab, v in s.get("yeto_syncer_island_pushes_total", []):
            d = outcomes.setdefault(lab["island"], {})
            d[lab["outcome"]] = d.get(lab["outcome"], 0) + v
        rows = []
        for island, (cls, state), step, rate, _merged, tokens in islands:
            o = outcomes.get(island, {})
            pushes = ", ".join(f"{esc(k)} {int(v)}" for k, v in sorted(o.items())) or "-"
            lp = last_push.get(island)
            rows.append(f'<tr><td>{esc(island)}</td><td class="{cls}">{esc(state)}</td><td>{int(step)}</td>'
                        f"<td>{rate:.2f}</td><td>{pushes}</td>"
                        f"<td>{_age(now - lp) + ' ago' if lp else '-'}</td><td>{_bytes(nbytes.get(island, 0))}</td>"
                        f"<td>{int(tokens)}</td></tr>")
        if not rows:
            return "<h2>Islands</h2><p>No island has joined yet.</p>"
        return ("<h2>Islands</h2><table><tr><th>island</th><th>state</th><th>step</th><th>pace (steps/s)</th>"
                "<th>pushes</th><th>last push</th><th>push bytes</th><th>tokens merged</th></tr>"
                + "".join(rows) + "</table>")

    def _fragments(self, fragments: list, s: dict) -> str:
        now = self.wall()
        last = {lab["fragment"]: v for lab, v in s.get("yeto_syncer_last_merge_timestamp_seconds", [])}
        period = {lab["fragment"]: v for lab, v in s.get("yeto_syncer_merge_interval_seconds", [])}
        rows = []
        for index, version, closed, has, waits, age in fragments:
            k = str(index)
            open_round = ("closed" if closed else
                          f"{len(has)} push(es) for {_age(age)}: {', '.join(esc(i) for i in has[:16])}" if has
                          else "no push yet")
            wait = ", ".join(esc(i) for i in waits[:16]) + (" ..." if len(waits) > 16 else "") if waits else "-"
            rows.append(f"<tr><td>{index}</td><td>{int(version)}</td>"
                        f"<td>{_age(now - last[k]) + ' ago' if k in last else '-'}</td>"
                        f"<td>{_age(period[k]) if k in period else '-'}</td><td>{open_round}</td><td>{wait}</td></tr>")
        q = s.get("yeto_syncer_quorum_wait_seconds_sum", [])
        n = s.get("yeto_syncer_quorum_wait_seconds_count", [])
        mean = f"{q[0][1] / n[0][1]:.2f} s" if q and n and n[0][1] else "-"
        return ("<h2>Rounds</h2><table><tr><th>fragment</th><th>version (rounds merged)</th><th>last merge</th>"
                "<th>round period</th><th>open round</th><th>waits for</th></tr>" + "".join(rows) + "</table>"
                f'<p class="muted">mean wait from a round\'s first push to its merge: {mean}</p>')

    def _refusals(self, s: dict) -> str:
        rows = [(lab["island"], lab["code"], v) for lab, v in s.get("yeto_syncer_island_pushes_total", [])
                if lab.get("outcome") == "refused" and v > 0]
        merges = sum(v for _, v in s.get("yeto_syncer_merge_refusals_total", []))
        head = f"<h2>Refusals</h2><p>refused merges (non-finite result): {int(merges)}</p>"
        if not rows:
            return head + "<p>No push refused.</p>"
        return (head + "<table><tr><th>island</th><th>code</th><th>pushes refused</th></tr>"
                + "".join(f"<tr><td>{esc(i)}</td><td>{esc(c)}</td><td>{int(v)}</td></tr>"
                          for i, c, v in sorted(rows)[:MAX_ISLAND_ROWS]) + "</table>")

    def _bytes(self, s: dict) -> str:
        cells = [(f"received ({esc(lab['kind'])})", v) for lab, v in s.get("yeto_syncer_bytes_received_total", [])]
        cells += [(f"sent ({esc(lab['kind'])})", v) for lab, v in s.get("yeto_syncer_bytes_sent_total", [])]
        if not cells:
            return "<h2>Bytes</h2><p>None yet.</p>"
        return ("<h2>Bytes</h2><table>" + "".join(f"<tr><td>{k}</td><td>{_bytes(v)}</td></tr>" for k, v in cells)
                + "</table>")


def _age(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    s = max(0.0, float(seconds))
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"

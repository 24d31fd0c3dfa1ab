"""Live progress of the demo: per island step, loss, merges installed and bytes pushed; the syncer's merges.

Sources: the training script's JSONL (``island-<id>.jsonl``: step, loss), the island's boundary records
(``island-<id>.boundaries.jsonl``, written by yeto-patch on island rank 0) and the syncer's tape.
"""
import os
import sys
import time

from .readers import JsonlTail

__all__ = ["Progress", "boundary_bytes", "boundary_installed", "fmt_bytes"]


def fmt_bytes(n):
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0


def boundary_bytes(rec):
    """Delta bytes pushed, from one of yeto-patch's boundary records (event "boundary": one push)."""
    if rec.get("event") != "boundary":
        return 0
    v = rec.get("bytes")
    return v if isinstance(v, (int, float)) else 0


def boundary_installed(rec):
    """1 when the record says a merged base was installed (an answer to our push, or a round merged without it)."""
    ev = rec.get("event")
    if ev == "boundary":
        return int(bool(rec.get("installed")))
    return int(ev == "install")


class _Island:
    def __init__(self, path, bpath):
        self.losses = JsonlTail(path)
        self.bounds = JsonlTail(bpath) if bpath else None
        self.step, self.loss, self.heldout, self.pushed, self.installs, self.boundaries = 0, None, None, 0, 0, 0
        self.ema = None
        self.done = False

    def poll(self):
        for r in self.losses.poll():
            ev = r.get("event")
            if ev == "train":
                self.step = r.get("step", self.step)
                self.loss = r.get("loss")
                if isinstance(self.loss, (int, float)):
                    self.ema = self.loss if self.ema is None else 0.9 * self.ema + 0.1 * self.loss
            elif ev == "eval":
                self.heldout = r.get("heldout_loss")
            elif ev == "end":
                self.done = True
        if self.bounds is not None:
            for r in self.bounds.poll():
                self.boundaries += 1
                self.pushed += boundary_bytes(r)
                self.installs += boundary_installed(r)


class Progress:
    def __init__(self, out, ids, steps, syncer_tape=None, files=None, stream=None, link=None):
        self.link = link
        self.t0, self.steps, self.ids = time.time(), steps, list(ids)
        files = files or {}
        self.islands = {}
        for i in ids:
            path = files.get(i) or os.path.join(out, f"island-{i}.jsonl")
            bpath = None if i in files else os.path.join(out, f"island-{i}.boundaries.jsonl")
            self.islands[i] = _Island(path, bpath if syncer_tape else None)
        self.tape = JsonlTail(syncer_tape) if syncer_tape else None
        self.merges, self.bytes_in = 0, 0
        self.responded = {i: 0 for i in ids}  # merges each island's pushes took part in (syncer tape)
        self.stream = stream or sys.stdout
        self._last = None

    def poll(self):
        for isl in self.islands.values():
            isl.poll()
        if self.tape is not None:
            for r in self.tape.poll():
                if r.get("ok", True):
                    self.merges += 1
                    self.bytes_in += r.get("bytes", 0) or 0
                    for resp in r.get("responders") or []:
                        if isinstance(resp, dict) and resp.get("island") in self.responded:
                            self.responded[resp["island"]] += 1

    def line(self):
        parts = []
        for i, isl in self.islands.items():
            loss = f"{isl.ema:.3f}" if isl.ema is not None else "  -  "
            s = f"{i}: step {isl.step:>{len(str(self.steps))}}/{self.steps} loss {loss}"
            if self.tape is not None:
                s += f" rounds {max(isl.installs, self.responded.get(i, 0))} pushed {fmt_bytes(isl.pushed)}"
            parts.append(s)
        if self.tape is not None:
            parts.append(f"syncer: {self.merges} merges")
        if self.link is not None:
            c = self.link.counters()
            if not c["gate_open"]:
                parts.append(f"link: {c['waiting_at_gate']} of {self.link.gate} islands connected, holding")
            else:
                parts.append(f"link: up {fmt_bytes(c['up'])} down {fmt_bytes(c['down'])}")
        return f"[{time.time() - self.t0:5.0f}s] " + " | ".join(parts)

    def tick(self):
        self.poll()
        ln = self.line()
        key = ln.split("] ", 1)[1]
        if key != self._last:
            print(ln, file=self.stream, flush=True)
            self._last = key

    def done(self):
        self.poll()
        print(self.line(), file=self.stream, flush=True)

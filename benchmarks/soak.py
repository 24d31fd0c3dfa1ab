#!/usr/bin/env python
"""Soak test over slow and lossy links (loopback only).

    python benchmarks/soak.py [--quick] [--rounds 40] [--numel 262144] [--seed 0] [--json out.json]
                              [--push-dtypes f32,topk:0.05+int2,int4,int1] [--base-wire topk:0.1+int2]

Three scripted islands (wire-level SyncerClient islands, no Megatron) run a fixed roster (--islands 3, quorum 3,
``--exact``, pushes in the codecs of ``--push-dtypes``, island i's push of round v in codec (i + v) mod their count
(default f32; --quick: f32, the sparse topk:0.05+int2, int4 and int1), tau = 0: each island pushes relative to the
newest base it holds and waits for the merged base; bases in the syncer's ``--base-wire``, default f32, --quick:
sparse updates topk:0.1+int2, which the islands add to the base they hold, or the full shadow after a reconnect)
through a relay that adds 50-200 ms latency per connection, throttles every direction to a few MB/s, pauses reading
a direction for 1-5 s at random and cuts connections at random. The islands reconnect with the same incarnation and
push again what was not answered (``duplicate`` means counted). Faults stop once every fragment reached
``rounds - 1`` merges (the last round and the final cut run over a slow but reliable link: an island cut off during
the final cut could not get the final model back from a syncer that already exited).

Checks: no connection was closed by an island or the syncer (only by the relay's cuts) while faults were on,
every round of every fragment merged exactly once and none was refused, and the final model is bit-identical to
the same run without the relay. Prints the counts (rounds, cuts, pauses, reconnects, drops) and exits 1 on a
violation.
"""
from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import socket
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from yeto_patch.syncer.rounds.settings import MergeSettings, RoundSettings  # noqa: E402
from yeto_patch.syncer.net.server import ServerConfig, SyncerServer  # noqa: E402
from yeto_patch.wire import codec_names, codecs  # noqa: E402
from yeto_patch.wire.client import SyncerClient, SyncerRefusal  # noqa: E402
from yeto_patch.wire.frames import ProtocolError  # noqa: E402

KEY = b"soak-key-" * 4
ISLANDS = ("island-a", "island-b", "island-c")
FRAGMENTS = 3


def manifest(numel: int) -> list:
    """Six tensors of about numel values in all."""
    q = max(16, numel // 8)
    return [("embedding.word_embeddings.weight", (2 * q,), "float32"), ("decoder.layers.0.qkv.weight", (2 * q,),
            "float32"), ("decoder.layers.0.fc1.weight", (q,), "float32"), ("decoder.layers.0.fc1.bias", (q,),
            "float32"), ("decoder.layers.1.fc2.weight", (q,), "float32"), ("decoder.final_layernorm.weight", (q,),
            "float32")]


# ------------------------------------------------------------------------------------------------ the relay
class _Dir:
    """One direction of one relayed connection: a reader (honours pauses) and a writer (latency, throttle)."""

    def __init__(self, link, conn, src, dst, name):
        self.link, self.conn, self.src, self.dst, self.name = link, conn, src, dst, name
        self.q = collections.deque()
        self.qbytes = 0
        self.cv = threading.Condition()
        self.pause_until = 0.0
        self.eof = False

    def reader(self):
        try:
            while not self.conn.dead:
                wait = self.pause_until - time.monotonic()
                if wait > 0:
                    time.sleep(min(wait, 0.05))
                    continue
                with self.cv:
                    while self.qbytes > self.link.max_queue and not self.conn.dead:
                        self.cv.wait(0.05)
                data = self.src.recv(1 << 16)
                if not data:
                    break
                with self.cv:
                    self.q.append((time.monotonic() + self.conn.latency, data))
                    self.qbytes += len(data)
                    self.cv.notify_all()
        except OSError:
            pass
        with self.cv:
            self.eof = True
            self.cv.notify_all()
        self.conn.ended(("the island" if self.name == "up" else "the syncer") + " closed its end")

    def writer(self):
        rate = self.link.rate
        try:
            while True:
                with self.cv:
                    while not self.q and not self.eof and not self.conn.dead:
                        self.cv.wait(0.05)
                    if self.conn.dead or (self.eof and not self.q):
                        break
                    due, data = self.q.popleft()
                    self.qbytes -= len(data)
                    self.cv.notify_all()
                d = due - time.monotonic()
                if d > 0:
                    time.sleep(d)
                for o in range(0, len(data), 16384):
                    piece = data[o:o + 16384]
                    self.dst.sendall(piece)
                    if rate:
                        time.sleep(len(piece) / rate)
        except OSError:
            self.conn.ended(("the syncer" if self.name == "up" else "the island") + " stopped taking data (closed)")
            return
        self.conn.ended(f"{self.name} direction ended")


class _Conn:
    def __init__(self, link, a, b, latency):
        self.link, self.a, self.b, self.latency = link, a, b, latency
        self.dead = False
        self.cut = False
        self.up = _Dir(link, self, a, b, "up")
        self.down = _Dir(link, self, b, a, "down")
        for d in (self.up, self.down):
            for fn in (d.reader, d.writer):
                threading.Thread(target=fn, daemon=True).start()

    def ended(self, why):
        with self.link.lock:
            if self.dead:
                return
            self.dead = True
            if not self.cut and self.link.faults:
                self.link.counts["drops"] += 1
                self.link.drop_log.append(f"connection closed during faults: {why}")
        for s in (self.a, self.b):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def kill(self):
        with self.link.lock:
            if self.dead:
                return
            self.cut = True
            self.link.counts["cuts"] += 1
        self.ended("cut")


class SlowLink:
    """A TCP relay to ``target`` with latency, throttling, random read pauses and random cuts."""

    def __init__(self, target, rng: random.Random, *, rate=4e6, latency=(0.05, 0.2), pause=(1.0, 5.0),
                 pause_every=4.0, cut_every=6.0, max_queue=8 << 20):
        self.target, self.rng, self.rate, self.latency = target, rng, rate, latency
        self.pause, self.pause_every, self.cut_every, self.max_queue = pause, pause_every, cut_every, max_queue
        self.lock = threading.Lock()
        self.conns: list[_Conn] = []
        self.counts = collections.Counter()
        self.drop_log: list = []
        self.faults = True
        self.closed = False
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()
        threading.Thread(target=self._chaos, daemon=True).start()

    def _accept(self):
        while not self.closed:
            try:
                a, _ = self.srv.accept()
            except OSError:
                return
            try:
                b = socket.create_connection(self.target, timeout=10)
                b.settimeout(None)
            except OSError:
                a.close()
                continue
            with self.lock:
                self.counts["connections"] += 1
                self.conns.append(_Conn(self, a, b, self.rng.uniform(*self.latency)))

    def _chaos(self):
        next_pause = time.monotonic() + self.rng.expovariate(1 / self.pause_every)
        next_cut = time.monotonic() + self.rng.expovariate(1 / self.cut_every)
        while not self.closed:
            time.sleep(0.05)
            now = time.monotonic()
            with self.lock:
                live = [c for c in self.conns if not c.dead]
                self.conns = live
                faults = self.faults
            if not faults or not live:
                continue
            if now >= next_pause:
                c = live[self.rng.randrange(len(live))]
                d = c.up if self.rng.random() < 0.5 else c.down
                d.pause_until = now + self.rng.uniform(*self.pause)
                with self.lock:
                    self.counts["pauses"] += 1
                next_pause = now + self.rng.expovariate(1 / self.pause_every)
            if now >= next_cut:
                live[self.rng.randrange(len(live))].kill()
                next_cut = now + self.rng.expovariate(1 / self.cut_every)

    def calm(self):
        """Stop pauses and cuts (latency and throttling stay); pauses in progress end."""
        with self.lock:
            self.faults = False
            for c in self.conns:
                c.up.pause_until = c.down.pause_until = 0.0

    def close(self):
        self.closed = True
        self.srv.close()
        with self.lock:
            conns = list(self.conns)
        for c in conns:
            c.kill()


# ----------------------------------------------------------------------------------------------- the islands
def init_values(man, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for _, s, _ in man]


def delta(island: str, f: int, v: int, base: np.ndarray, seed: int) -> np.ndarray:
    """tau = 0: a deterministic function of the island, the fragment, the version and the base it holds."""
    rng = np.random.default_rng([seed, ISLANDS.index(island), f, v])
    return (rng.standard_normal(base.size).astype(np.float32) * np.float32(0.01)
            + np.float32(1e-3) * base).astype(np.float32)


def held_then(held, b):
    """The base an island holds after receiving `b`: `b` itself, or `held` plus the update `b` carries."""
    return held.then(b) if b.relative else b


def run_island(name, addr, man, values, args, stats, stop):
    inc = 1000 + ISLANDS.index(name)
    dtypes = args.push_dtypes.split(",")
    bases: dict = {}
    final = None
    while not stop.is_set():
        c = SyncerClient(addr, KEY, name, man, incarnation=inc, timeout=args.island_timeout, connect_retries=30,
                         backoff=0.2, max_backoff=1.0)
        try:
            w = c.connect()
            got = c.wait_ready(args.island_timeout, init_source=lambda f: [values[i] for i in w.layout[f]])
            for f, b in got.items():
                if f not in bases or b.version >= bases[f].version:
                    bases[f] = held_then(bases.get(f), b)
            while True:
                todo = [f for f in range(FRAGMENTS) if bases[f].version < args.rounds and not bases[f].final]
                if not todo:
                    break
                for f in todo:
                    v = bases[f].version
                    codec = dtypes[(ISLANDS.index(name) + v) % len(dtypes)]   # (a re-sent push: the same codec)
                    try:
                        c.push(f, base_version=v, local_step=v + 1, steps=1, tokens=1, codec=codec,
                               body=codecs.encode(codec, delta(name, f, v, bases[f].values, args.seed)), wait=True)
                        stats["pushes"] += 1
                        stats["by_codec"][codec] += 1
                    except SyncerRefusal as e:
                        if e.code != "duplicate":
                            raise
                        stats["duplicates"] += 1
                    b = c.wait_base(f, v + 1, args.island_timeout)
                    stats["base_updates"] += int(b.relative)
                    bases[f] = held_then(bases.get(f), b)
            final = c.finish(last_step=args.rounds, timeout=args.island_timeout)
            c.close()
            return final
        except (ProtocolError, OSError) as e:
            stats["reconnects"] += 1
            stats["errors"].append(f"{name}: {type(e).__name__}: {str(e)[:160]}")
            c.abort()
            time.sleep(0.1)
    return final


def run(args, relay: bool) -> dict:
    man = manifest(args.numel)
    values = init_values(man, args.seed)
    tmp = tempfile.mkdtemp(prefix="yeto-soak-")
    tape = os.path.join(tmp, "tape.jsonl")
    cfg = ServerConfig(listen="127.0.0.1:0", islands=len(ISLANDS), fragments=FRAGMENTS, key=KEY,
                       merge=MergeSettings(exact=True),   # (fixed roster: the run is compared bit for bit)
                       rounds=RoundSettings(islands=len(ISLANDS), quorum=len(ISLANDS), grace_s=0.0, timeout_s=600.0,
                                            lease_s=args.lease,
                                            total_rounds=args.rounds),
                       base_wire=args.base_wire, io_timeout_s=args.io_timeout, final_ack_timeout_s=30.0, tape=tape,
                       merge_threads=2)
    server = SyncerServer(cfg)
    host, port = server.start()
    rng = random.Random(args.seed)
    link = SlowLink((host, port), rng, rate=args.rate, pause=(args.pause_min, args.pause_max),
                    pause_every=args.pause_every, cut_every=args.cut_every) if relay else None
    addr = f"127.0.0.1:{link.port if link else port}"
    stats = collections.Counter()
    stats["errors"] = []
    stats["by_codec"] = collections.Counter()
    results, stop = {}, threading.Event()
    t0 = time.monotonic()

    def go(name):
        try:
            results[name] = run_island(name, addr, man, values, args, stats, stop)
        except Exception as e:  # noqa: BLE001
            stats["errors"].append(f"{name}: failed: {e!r}")

    th = [threading.Thread(target=go, args=(n,), daemon=True) for n in ISLANDS]
    for t in th:
        t.start()
    deadline = t0 + args.max_seconds
    while any(t.is_alive() for t in th) and time.monotonic() < deadline:
        if link and link.faults and min(server.coord.versions() or [0]) >= args.rounds - 1:
            link.calm()
        time.sleep(0.05)
    stop.set()
    timed_out = any(t.is_alive() for t in th)
    code = server.wait(30)
    server.stop()
    if link:
        link.close()
    elapsed = time.monotonic() - t0
    recs = [json.loads(x) for x in open(tape)]
    merged = collections.Counter((r["fragment"], r["version"]) for r in recs if r["ok"])
    final = {f: server.coord.frags[f].t.base.copy() for f in range(FRAGMENTS)}
    return {"seconds": elapsed, "timed_out": timed_out, "exit_code": code, "final": final, "results": results,
            "merges": sum(merged.values()), "refused_merges": sum(1 for r in recs if not r["ok"]),
            "each_round_once": sorted(merged) == [(f, v) for f in range(FRAGMENTS) for v in range(1, args.rounds + 1)]
            and set(merged.values()) == {1}, "pushes": stats["pushes"], "duplicates": stats["duplicates"],
            "base_updates": stats["base_updates"], "pushes_by_codec": dict(stats["by_codec"]),
            "reconnects": stats["reconnects"], "errors": stats["errors"],
            **({k: link.counts[k] for k in ("connections", "cuts", "pauses", "drops")} if link else {}),
            "drop_log": link.drop_log if link else []}


def check(args) -> dict:
    ref = run(args, relay=False)
    soak = run(args, relay=True)
    v = []
    for name, r in (("reference", ref), ("soak", soak)):
        if r["timed_out"] or r["exit_code"] != 0:
            v.append(f"{name}: the run did not finish (timed out {r['timed_out']}, syncer exit {r['exit_code']})")
        if not r["each_round_once"] or r["refused_merges"]:
            v.append(f"{name}: rounds not merged exactly once each ({r['merges']} merges, {r['refused_merges']} "
                     "refused)")
        if sorted(r["results"]) != sorted(ISLANDS) or any(x is None for x in r["results"].values()):
            v.append(f"{name}: not every island got the final model ({sorted(r['results'])})")
    if soak.get("drops"):
        v.append(f"soak: {soak['drops']} connection(s) dropped by an island or the syncer: {soak['drop_log'][:5]}")
    same = all(np.array_equal(ref["final"][f], soak["final"][f]) for f in range(FRAGMENTS))
    if not same:
        v.append("soak: the final model differs from the run without the relay")
    for name, res in soak["results"].items():
        if res and not all(np.array_equal(res[f].values, ref["final"][f]) for f in range(FRAGMENTS)):
            v.append(f"soak: island {name}'s final model differs from the reference")
    out = {k: soak.get(k) for k in ("seconds", "merges", "pushes", "duplicates", "base_updates", "reconnects",
                                    "connections", "cuts", "pauses", "drops", "pushes_by_codec")}
    out.update(rounds=args.rounds, fragments=FRAGMENTS, islands=len(ISLANDS), numel=args.numel,
               base_wire=args.base_wire, reference_seconds=ref["seconds"], bit_identical=same, violations=v,
               island_errors=soak["errors"][:20])
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="CI setting: 8 rounds, a small model, pauses 1-2 s")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--numel", type=int, default=262144, help="parameters of the scripted model")
    p.add_argument("--rate", type=float, default=4e6, help="bytes/s per direction of each relayed connection")
    p.add_argument("--pause-min", type=float, default=1.0)
    p.add_argument("--pause-max", type=float, default=5.0)
    p.add_argument("--pause-every", type=float, default=4.0, help="mean seconds between pauses")
    p.add_argument("--cut-every", type=float, default=6.0, help="mean seconds between cuts")
    p.add_argument("--io-timeout", type=float, default=10.0, help="the syncer's io timeout (> the longest pause)")
    p.add_argument("--lease", type=float, default=30.0)
    p.add_argument("--island-timeout", type=float, default=60.0)
    p.add_argument("--max-seconds", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--push-dtypes", default=None, help="the islands' push codecs, in turn by island and round "
                   "(default f32; --quick: f32,topk:0.05+int2,int4,int1)")
    p.add_argument("--base-wire", default=None, help="the syncer's --base-wire (default f32; --quick: "
                   "topk:0.1+int2)")
    a = p.parse_args(argv)
    if a.base_wire is None:
        a.base_wire = "topk:0.1+int2" if a.quick else "f32"
    if not codec_names.base_wire_ok(a.base_wire):
        p.error(f"--base-wire: use {codec_names.describe_base_wire()}")
    if a.push_dtypes is None:
        a.push_dtypes = "f32,topk:0.05+int2,int4,int1" if a.quick else "f32"
    for d in a.push_dtypes.split(","):
        codecs.check_codec(d)
    if a.quick:
        a.rounds, a.numel, a.pause_max, a.pause_every, a.cut_every = 8, 4096, 2.0, 1.5, 2.5
        a.max_seconds = min(a.max_seconds, 120.0)
    return a


def main(argv=None) -> int:
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    a = parse_args(argv)
    res = check(a)
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())

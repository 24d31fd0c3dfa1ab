#!/usr/bin/env python
"""A WAN for benchmarks on one Linux host: each participant (an island, a torchft replica group) in a network
namespace of its own, joined to the root namespace by a veth pair on a bridge, its access link shaped both ways by
`tc tbf` (rate, burst, queue) and cut on demand (an outage: the root end set down, then up).

Needs root (ip netns, ip link, tc). This kernel has no sch_netem, so no propagation delay is added: the link's
latency is what the tbf queue adds under load (at most `latency_ms`). Traffic between two namespaces crosses both
participants' access links (each shaped at the same rate); traffic to a process of the root namespace (a syncer, a
relay, torchft's lighthouse) crosses one, at `host_ip`.

    with NetLab(2, rate_mbit=8) as lab:
        subprocess.run(lab.wrap(0, ["python", "train.py"]))     # runs in namespace 0, reaches lab.host_ip
        lab.counters(0)                                            # bytes on its access link, both ways
        lab.outage(1, 5.0)                                         # participant 1's link down for 5 s

`python -m benchmarks.netlab island-python REAL_PYTHON MAP HOST_IP ARGS...` is the interpreter a `yeto_patch.demo`
run gets as `--python` (see `island_python`): a child with YETO_DILOCO_ISLAND_ID in MAP runs in that namespace and
reaches the syncer (the demo's relay on 127.0.0.1) through a forwarder on HOST_IP; every other child (the syncer,
the baseline) runs as is.
"""
from __future__ import annotations

import os
import random
import socket
import stat
import subprocess
import sys
import threading
import time

__all__ = ["NetLab", "available", "island_python", "Forwarder"]


def _ip(*args, ns=None, check=True):
    argv = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"netlab: {' '.join(argv)} failed: {r.stderr.strip()}")
    return r


def available():
    """None if namespaces, veth, a bridge and tbf work here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc)"
    try:
        with NetLab(1, rate_mbit=100):
            pass
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    return None


class NetLab:
    def __init__(self, n, rate_mbit=None, burst_kb=32, latency_ms=200):
        self.n, self.rate_mbit, self.burst_kb, self.latency_ms = n, rate_mbit, burst_kb, latency_ms
        tag = f"{os.getpid() % 10000:04d}{random.randrange(100):02d}"
        self.prefix = f"nl{tag}"                          # interface names: at most 15 characters
        self.net = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.bridge = f"{self.prefix}br"
        self.host_ip = f"{self.net}.1"
        self.ns = [f"{self.prefix}n{k}" for k in range(n)]
        self.host_end = [f"{self.prefix}h{k}" for k in range(n)]
        self.outages = []                                 # (participant, start, seconds)
        self._up = False

    def ip_of(self, k):
        return f"{self.net}.{k + 2}"

    def __enter__(self):
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._up = True
        return self

    def __exit__(self, *exc):
        self.close()

    def _build(self):
        _ip("ip", "link", "add", self.bridge, "type", "bridge")
        _ip("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
        _ip("ip", "link", "set", self.bridge, "up")
        for k, ns in enumerate(self.ns):
            _ip("ip", "netns", "add", ns)
            _ip("ip", "link", "set", "lo", "up", ns=ns)
            _ip("ip", "link", "add", self.host_end[k], "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("ip", "link", "set", self.host_end[k], "master", self.bridge)
            _ip("ip", "link", "set", self.host_end[k], "up")
            _ip("ip", "addr", "add", f"{self.ip_of(k)}/24", "dev", "eth0", ns=ns)
            _ip("ip", "link", "set", "eth0", "up", ns=ns)
            _ip("ip", "route", "add", "default", "via", self.host_ip, ns=ns)
            if self.rate_mbit:
                shape = ["root", "tbf", "rate", f"{self.rate_mbit}mbit", "burst", f"{self.burst_kb}kb", "latency",
                         f"{self.latency_ms}ms"]
                _ip("tc", "qdisc", "add", "dev", self.host_end[k], *shape)     # towards the participant
                _ip("tc", "qdisc", "add", "dev", "eth0", *shape, ns=ns)        # from it

    def close(self):
        for ns in self.ns:
            _ip("ip", "netns", "del", ns, check=False)      # takes its veth pair with it
        _ip("ip", "link", "del", self.bridge, check=False)
        self._up = False

    def wrap(self, k, argv):
        """argv run inside participant k's namespace."""
        return ["ip", "netns", "exec", self.ns[k]] + list(argv)

    def counters(self, k):
        """Bytes that crossed participant k's access link (at its root end, Ethernet frames as sent: IP and TCP
        headers included): dict(up=from it, down=to it)."""
        base = f"/sys/class/net/{self.host_end[k]}/statistics/"
        with open(base + "rx_bytes") as f:
            up = int(f.read())
        with open(base + "tx_bytes") as f:
            down = int(f.read())
        return dict(up=up, down=down)

    def set_link(self, k, up):
        _ip("ip", "link", "set", self.host_end[k], "up" if up else "down")

    def outage(self, k, seconds):
        """Participant k's link down for `seconds` (blocking), then up again."""
        self.outages.append((k, time.time(), seconds))
        self.set_link(k, False)
        try:
            time.sleep(seconds)
        finally:
            self.set_link(k, True)


class Forwarder:
    """TCP forwarder: connections to (host, port 0 -> self.port) are relayed to `target` (host, port)."""

    def __init__(self, host, target):
        self.target = target
        self.srv = socket.create_server((host, 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
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
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src, dst):
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def island_python(directory, lab, islands):
    """An executable `python` in `directory` for yeto_patch.demo's --python: `islands` maps island ids to
    participant numbers of `lab` (see the module docstring)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "python")
    mapping = ",".join(f"{iid}={lab.ns[k]}" for iid, k in islands.items())
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nif [ -z \"$YETO_DILOCO_ISLAND_ID\" ]; then exec {sys.executable} \"$@\"; fi\n"
                f"PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} -m benchmarks.netlab "
                f"island-python {sys.executable} {mapping} {lab.host_ip} \"$@\"\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def _island_python(real, mapping, host_ip, args):
    ns = dict(kv.split("=", 1) for kv in mapping.split(","))[os.environ["YETO_DILOCO_ISLAND_ID"]]
    fwd = []
    addrs = []
    for addr in os.environ["YETO_DILOCO_SYNCER"].split(","):
        h, _, p = addr.strip().rpartition(":")
        fwd.append(Forwarder(host_ip, (h, int(p))))
        addrs.append(f"{host_ip}:{fwd[-1].port}")
    # the island's own gloo stays on its loopback (its ranks share the namespace)
    env = dict(os.environ, YETO_DILOCO_SYNCER=",".join(addrs), GLOO_SOCKET_IFNAME="lo")
    p = subprocess.Popen(["ip", "netns", "exec", ns, real] + args, env=env)
    while True:
        try:
            return p.wait()
        except KeyboardInterrupt:
            continue


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "island-python":
        sys.exit(_island_python(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]))
    print(__doc__)
    sys.exit(2)

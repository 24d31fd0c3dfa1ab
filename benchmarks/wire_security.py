"""Cost of frame protection: INIT / BASE / PUSH messages over loopback with frames unprotected (insecure
mode: xxh3 digests), authenticated (``mac``, AES-256-GMAC, the default with a key) and encrypted (``aead``,
AES-256-GCM, ``--encrypt``), against a raw socket sending the same bytes (no framing at all) into one buffer of the message's size.

    python benchmarks/wire_security.py [--mib 256] [--repeat 3] [--handshakes 200]

Each figure is the median of ``--repeat`` transfers of one ``--mib`` MiB message (chunked as the transport does:
4 MiB chunks), sender and receiver in two threads of this process; each transfer's ratio is to a raw-socket
transfer measured just before it (the host is noisy: ratios of neighbours, not of separate runs), and the CPU
seconds (both ends, this process) the raw transfer took over those the framed one took: on a host shared with
other work the wall-clock ratio follows the CPU share the two threads get, the CPU ratio does not. The frame keys
come from real handshakes (protocol 3: an X25519 exchange, wire/secure.py). Then what a handshake costs: the key
exchange and derivations of both sides alone, and ``--handshakes`` whole authenticated handshakes (CHALLENGE,
PROBE, protected WELCOME) with an in-process syncer over loopback.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from yeto_patch.wire import secure, transport  # noqa: E402
from yeto_patch.wire.frames import MsgType  # noqa: E402
from yeto_patch.wire.handshake import IslandHello, probe  # noqa: E402

KEY = b"k" * 32

PIECE = 4 << 20


def _socketpair():
    ls = transport.listen("127.0.0.1:0")
    a = socket.create_connection(ls.getsockname()[:2])
    b, _ = ls.accept()
    ls.close()
    for s in (a, b):
        transport._tune(s)
    return a, b


def raw(nbytes: int) -> tuple:
    """(bytes/s, CPU seconds of both ends) of the same bytes over a plain socket, received (like the transport
    does) into one fresh buffer of the message's size."""
    a, b = _socketpair()

    def reader():
        got = 0
        mv = memoryview(np.empty(nbytes, np.uint8))
        while got < nbytes:
            got += b.recv_into(mv[got:], min(PIECE, nbytes - got))

    data = memoryview(np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8))
    th = threading.Thread(target=reader)
    t0, c0 = time.perf_counter(), time.process_time()
    th.start()
    for o in range(0, nbytes, PIECE):
        a.sendall(data[o:o + PIECE])
    th.join()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    a.close()
    b.close()
    return nbytes / dt, dc


def session(mode: str):
    """Both sides' session keys of one protocol-3 handshake (the island's IslandHello, the syncer's derivation)."""
    syncer_e = secure.Ephemeral()
    ch = {"nonce": os.urandom(32).hex(), "protocol": 3, "auth": True, "frames": mode, "ephemeral": syncer_e.public.hex()}
    hello = IslandHello(ch, KEY, "bench", 1, bytes(32))
    th = secure.transcript(ch, hello.meta)
    syncer = secure.SessionKeys(KEY, syncer_e.shared(bytes.fromhex(hello.meta["ephemeral"])), mode, th)
    return hello.session(), syncer


def framed(nbytes: int, mode: str, msg_type: MsgType) -> tuple:
    """(bytes/s, CPU seconds of both ends) of one ``msg_type`` message through two transport connections."""
    a, b = _socketpair()
    tx, rx = transport.Connection(a, timeout=30), transport.Connection(b, timeout=30)
    rx.set_limits({msg_type: nbytes + (1 << 20)})
    if mode != "none":
        island, syncer = session(mode)
        tx.protect(island.c2s, island.s2c, island.encrypt)
        rx.protect(syncer.s2c, syncer.c2s, syncer.encrypt)
    body = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    box = {}

    def reader():
        box["msg"] = rx.recv(timeout=30)

    th = threading.Thread(target=reader)
    t0, c0 = time.perf_counter(), time.process_time()
    th.start()
    mv = memoryview(body)
    tx.send(msg_type, {"fragment": 0, "numel": nbytes // 4}, body_len=nbytes,
            body_iter=(mv[o:o + PIECE] for o in range(0, nbytes, PIECE)))
    th.join()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    assert box["msg"][0] == msg_type and len(box["msg"][2]) == nbytes
    tx.close()
    rx.close()
    return nbytes / dt, dc


def handshakes(n: int) -> tuple:
    """(median seconds of both sides' key exchange and derivations, median seconds of a whole handshake with an
    in-process syncer over loopback)."""
    from yeto_patch.syncer.net.server import ServerConfig, SyncerServer
    crypto = []
    for _ in range(max(n, 1) * 5):
        t0 = time.perf_counter()
        session("mac")
        crypto.append(time.perf_counter() - t0)
    server = SyncerServer(ServerConfig(listen="127.0.0.1:0", key=KEY, merge_threads=1))
    host, port = server.start()
    whole = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            probe(f"{host}:{port}", KEY, timeout=10)
            whole.append(time.perf_counter() - t0)
    finally:
        server.stop()
    return statistics.median(crypto), statistics.median(whole) if whole else float("nan")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--handshakes", type=int, default=200)
    a = p.parse_args(argv)
    n = a.mib << 20
    cases = [(t, mode) for t in (MsgType.INIT, MsgType.BASE, MsgType.PUSH) for mode in ("none", "mac", "aead")]
    raws, rates, ratios, cpu = [], {c: [] for c in cases}, {c: [] for c in cases}, {c: [] for c in cases}
    raw(n)   # warm-up (first allocations, socket buffers)
    for _ in range(a.repeat):   # interleaved: each repetition measures the raw socket next to every case
        for c in cases:
            base, base_cpu = raw(n)
            r, r_cpu = framed(n, c[1], c[0])
            raws.append(base)
            rates[c].append(r)
            ratios[c].append(r / base)
            cpu[c].append(base_cpu / max(r_cpu, 1e-9))
    print(f"loopback, {a.mib} MiB messages, {a.repeat} interleaved repetitions; raw socket median "
          f"{statistics.median(raws) / 1e9:.2f} GB/s (min {min(raws) / 1e9:.2f}, max {max(raws) / 1e9:.2f}); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'message':8s} {'mode':5s} {'GB/s':>6s} {'x raw':>6s} {'CPU x raw':>9s}   (medians; x raw: against the raw "
          "transfer measured just before; CPU x raw: its CPU seconds over ours)")
    for c in cases:
        print(f"{c[0].name:8s} {c[1]:5s} {statistics.median(rates[c]) / 1e9:6.2f} {statistics.median(ratios[c]):6.2f} "
              f"{statistics.median(cpu[c]):9.2f}")
    if a.handshakes:
        crypto, whole = handshakes(a.handshakes)
        print(f"handshake (protocol 3): X25519 exchange and session derivations of both sides {crypto * 1e3:.2f} ms; "
              f"a whole authenticated handshake over loopback (CHALLENGE, PROBE, WELCOME) {whole * 1e3:.2f} ms "
              f"(medians of {a.handshakes})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One island's connection on the syncer: its outbox, the bases queued for it, and the writer thread.

The reader (the server's connection handler) posts messages and base requests; the writer thread sends them
in order, streaming bases from the live arrays of a :class:`~..model.fragment.GlobalFragment` under its read lock.
Requests
to send the same fragment's base coalesce, so an island slower than the merges receives the newest version.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional

from ...wire import codec_names, codecs
from ...wire.frames import MsgType, ProtocolError
from ...wire.schema import base_meta
from ...wire.transport import Connection
from ..model.fragment import GlobalFragment

__all__ = ["Session", "SEND_CHUNK"]

log = logging.getLogger("yeto.syncer")
SEND_CHUNK = 4 << 20  # bytes per body piece handed to the transport


class Session:
    """One island's connection. ``send_base(session, fragment, dtype, final)`` sends one queued base (the server's:
    it knows the fragments); ``quiet()`` says whether a failed send is expected (the run is over) and not worth a
    warning; ``host``: the peer's address (what the handshake slots count).

    Its state is written only through its own methods: the handshake names it (``named``), marks it authenticated
    (``authenticate``), records what its MANIFEST declared (``declare``) and joins it (``join``); the reader records
    its pushes in flight (``push_started`` / ``push_done``), its FINAL acknowledgement (``acked``) and its BYE
    (``said_bye``); the server starts its threads (``start``). Everything else reads the properties."""

    def __init__(self, conn: Connection, send_base: Callable[["Session", int, str, bool], None],
                 quiet: Callable[[], bool] = lambda: False, host: str = "?"):
        self.conn = conn
        self._send_base = send_base
        self._quiet = quiet
        self._host = host
        self._since = time.monotonic()   # accepted at (the oldest handshake gives way first)
        self.cv = threading.Condition()
        self._outbox: collections.deque = collections.deque()
        self._bases: "collections.OrderedDict[int, tuple[str, bool]]" = collections.OrderedDict()
        self._closed = False
        self._send_failure_told = False
        self._island: Optional[str] = None
        self._incarnation = 0
        self._authenticated = False   # the HELLO's MAC verified (a key holder: gives way only when idle)
        self._declared: Optional[list] = None   # MANIFEST's per-tensor digests of the weights the island holds
        self._declares_init = False   # MANIFEST's "initializer": its weights are the run's start
        self._joined = False
        self._bye = False
        self._final_acked: Optional[list] = None
        self._writer: Optional[threading.Thread] = None
        self._reader: Optional[threading.Thread] = None
        self._sending = False
        self._pushes_inflight = 0
        self._sent: dict = {}   # fragment -> version of the last base sent on this connection (writer thread)

    # ---------------------------------------------------------------------------------------- what it is
    island = property(lambda self: self._island)
    incarnation = property(lambda self: self._incarnation)
    host = property(lambda self: self._host)
    since = property(lambda self: self._since)
    closed = property(lambda self: self._closed)
    authenticated = property(lambda self: self._authenticated)
    declared = property(lambda self: self._declared)
    declares_init = property(lambda self: self._declares_init)
    joined = property(lambda self: self._joined)
    bye = property(lambda self: self._bye)
    final_acked = property(lambda self: self._final_acked)

    def threads(self) -> list:
        return [t for t in (self._reader, self._writer) if t is not None]

    # ------------------------------------------------------------------------------------ the handshake
    def start(self, reader: Callable[["Session"], None]) -> None:
        """Start the reader thread (``reader(self)``: the server's connection handler)."""
        self._reader = threading.Thread(target=reader, args=(self,), daemon=True, name=f"yeto-conn-{self.conn.peer}")
        self._reader.start()

    def start_writer(self) -> None:
        self._writer = threading.Thread(target=self.writer_loop, daemon=True, name=f"yeto-send-{self._island}")
        self._writer.start()

    def named(self, island: str) -> None:
        """The HELLO named island id ``island`` (checked by the handshake)."""
        self._island = island

    def authenticate(self) -> None:
        self._authenticated = True

    def declare(self, held: Optional[list], initializer: bool) -> None:
        """What the MANIFEST declared: the digests of the weights it holds, whether they are the run's start."""
        self._declared, self._declares_init = held, bool(initializer)

    def join(self, incarnation: int) -> None:
        self._incarnation = incarnation
        self._joined = True

    # ------------------------------------------------------------------------------------- the reader
    def acked(self, versions: Optional[list]) -> None:
        """Its ACK of the final model (the versions it installed, checked by the server)."""
        self._final_acked = versions

    def said_bye(self) -> None:
        self._bye = True

    def push_started(self, limit: int) -> None:
        """Wait (the reader) until fewer than ``limit`` of its pushes are in flight (or the connection closed), then
        count one more (``push_done`` when it is accepted or refused)."""
        with self.cv:
            while self._pushes_inflight >= limit and not self._closed:
                self.cv.wait(0.5)
            self._pushes_inflight += 1

    def push_done(self) -> None:
        with self.cv:
            self._pushes_inflight -= 1
            self.cv.notify_all()

    def wait_pushes(self, timeout: float) -> None:
        """Wait (bounded) until the pushes this connection handed to the fold pool are accepted or refused."""
        end = time.monotonic() + timeout
        with self.cv:
            while self._pushes_inflight and time.monotonic() < end:
                self.cv.wait(0.05)

    def drain(self, timeout: float) -> None:
        """Wait (bounded) until everything posted so far was sent."""
        end = time.monotonic() + timeout
        with self.cv:
            while (self._outbox or self._bases or self._sending) and not self._closed:
                left = end - time.monotonic()
                if left <= 0:
                    return
                self.cv.wait(min(left, 0.05))

    # ---------------------------------------------------------------------------------------- outbox
    def post(self, msg_type: MsgType, meta: dict) -> None:
        with self.cv:
            if not self._closed:
                self._outbox.append((msg_type, meta))
                self.cv.notify()

    def post_base(self, fragment: int, dtype: str, final: bool = False) -> None:
        """Ask the writer to send fragment's current base (coalesces; f32 and final win over bf16)."""
        with self.cv:
            if self._closed:
                return
            old = self._bases.pop(fragment, None)
            if old is not None:
                dtype = "f32" if "f32" in (dtype, old[0]) else "check" if "check" in (dtype, old[0]) else dtype
                final = final or old[1]
            self._bases[fragment] = (dtype, final)
            self.cv.notify()

    def close(self) -> None:
        with self.cv:
            self._closed = True
            self.cv.notify_all()
        self.conn.close()

    def writer_loop(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self._closed and not self._outbox and not self._bases:
                        self.cv.wait()
                    if self._closed:
                        return
                    if self._outbox:
                        item = ("msg",) + self._outbox.popleft()
                    else:
                        frag, (dtype, final) = self._bases.popitem(last=False)
                        item = ("base", frag, dtype, final)
                    self._sending = True
                if item[0] == "msg":
                    self.conn.send(item[1], item[2])
                else:
                    self._send_base(self, item[1], item[2], item[3])
                with self.cv:
                    self._sending = False
                    self.cv.notify_all()
        except (ProtocolError, OSError) as e:
            self.send_failed(e)

    def send_failed(self, cause: Exception) -> None:
        """Log why a send on this connection failed, once, and close it. Called by the writer, and by the reader
        when the writer's failure shut the socket down under it (whichever thread gets here first)."""
        with self.cv:
            first = not self._closed and not self._send_failure_told
            self._send_failure_told = True
        if first and not self._quiet():
            log.warning("island %s: send failed (%s); closing its connection", self.island, cause)
        self.close()

    # ------------------------------------------------------------------------------------------ bases
    def stream_base(self, f: GlobalFragment, declared_ok: Callable[[list], bool], sizes: list, down_block: int,
                    dtype: str, final: bool, merge: Optional[tuple] = None) -> Optional[int]:
        """(writer thread) Send fragment ``f``'s current base as BASE (or FINAL_BASE) in ``dtype``: "f32",
        "bf16", a base update codec (when this connection holds the previous version, else f32) or "check"
        ("held" without a body when ``declared_ok(digests)`` says the island declared exactly this base, else
        f32). ``sizes``: the fragment's tensor sizes. ``merge``: (version, this island's figures of the merge that
        made it), sent as meta ``merge`` when the base streamed is that version. Returns the body bytes sent
        (None: nothing to send)."""
        frag = f.index
        with f.reading():
            if not final and self._sent.get(frag) == f.version:
                return None   # this connection already carried this version (an island joining while INIT completed)
            base = f.outgoing(final)
            n = f.numel
            down = None if final or not codec_names.is_base_update(dtype) else f.update_for(self._sent.get(frag))
            if dtype == "check":   # the island declared what it holds: skip the download when it is this base
                dtype = "held" if (not final and frag not in self._sent and declared_ok(f.digests(base, sizes))) \
                    else "f32"
            if codec_names.is_base_update(dtype) and down is None:
                dtype = "f32"   # the island does not hold the previous version: the full shadow
            meta = base_meta(frag, f.version, dtype, n, final,
                             merge=merge[1] if merge is not None and merge[0] == f.version else None,
                             delta_from=f.version - 1 if down is not None else None,
                             block=down_block if down is not None else None)
            step = SEND_CHUNK // 4
            if dtype == "held":
                body_len, it = 0, iter(())
            elif down is not None:
                body = memoryview(down).cast("B")
                body_len = body.nbytes
                it = (body[a:a + SEND_CHUNK] for a in range(0, body_len, SEND_CHUNK))
            elif dtype == "f32":
                body_len = 4 * n
                it = (memoryview(base[a:a + step]).cast("B") for a in range(0, n, step))
            else:
                body_len = 2 * n
                it = (codecs.encode("bf16", base[a:a + step], name=f"fragment {frag}", threads=1)
                      for a in range(0, n, step))
            self.conn.send(MsgType.FINAL_BASE if final else MsgType.BASE, meta, body_len=body_len, body_iter=it)
            self._sent[frag] = f.version
        return body_len

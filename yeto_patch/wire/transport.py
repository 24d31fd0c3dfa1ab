"""Framed, chunked, digested message transport over a stream socket.

``Connection.send`` writes one message: a single frame when the payload (meta prefix + body) fits in one
chunk, otherwise CHUNK frames cut from the prefix and the body buffers (or ``body_iter``) without joining
them. ``Connection.recv`` reads frames, verifies every digest, reassembles chunked messages straight into one
preallocated buffer of the announced size (after the per-type maximum is checked) and returns
``(MsgType, meta, body)``. Every socket operation has a timeout (:class:`WireTimeout`); a peer's ERROR
message is raised as :class:`PeerError`. The socket is non-blocking and each direction waits for it with its
own deadline (``poll``), so a receive waiting for the next message never shortens a concurrent send's
timeout (and the other way round). After a framing error or a timeout in the middle of a frame the
stream cannot be trusted: the connection is marked broken and every later call raises.
"""
from __future__ import annotations

import itertools
import math
import random
import select
import socket
import threading
import time
from typing import Iterable, Optional, Union

import numpy as np
import xxhash

from . import chunks as _chunks
from .chunks import DEFAULT_CHUNK, ENVELOPE, ENVELOPE_SIZE, MAX_CHUNK, Reassembler, parse_envelope
from .frames import (HEADER_SIZE, MAX_PAYLOAD, BrokenHere, DigestError, FrameAuthError, FrameError, MsgType,
                     PeerError, ProtocolError, WireTimeout, decode_header, encode_header)
from .message import pack_meta, unpack
from . import scratch
from .scratch import PIECE
from .secure import FLAG_AUTH, FLAG_ENC, TAG_SIZE, InvalidTag, Opener, Sealer

# Back-off jitter from a generator of our own, seeded by the OS: Megatron seeds the `random` module with --seed, so
# every island of a run would draw the same jitter and redial a restarted syncer in step.
_JITTER = random.Random()

__all__ = ["Connection", "ConnectError", "connect", "listen", "parse_address", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 60.0
SOCK_BUF = 4 << 20
_IOV_MAX = 512


class ConnectError(ProtocolError, ConnectionError):
    """Could not connect within the allowed attempts."""


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6addr]:port"`` -> (host, port)."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"address must be 'host:port', got {address!r}")
    host, _, port = address.strip().rpartition(":")
    host = host.strip("[]")
    try:
        p = int(port)
    except ValueError:
        raise ValueError(f"address {address!r}: port {port!r} is not a number") from None
    if not 0 <= p < 65536 or not host:
        raise ValueError(f"address {address!r}: bad host or port")
    return host, p


def _tune(sock: socket.socket) -> None:
    options = [(socket.SOL_SOCKET, opt, SOCK_BUF) for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF)]
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        options.append((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1))
    for level, opt, value in options:
        try:
            sock.setsockopt(level, opt, value)
        except OSError:   # (best effort: the defaults still work)
            pass


Body = Union[bytes, bytearray, memoryview, "list", None]


class Connection:
    """One framed connection. ``timeout``: seconds any single socket operation may stall (and the default
    wait for the next message in :meth:`recv`). ``max_payload`` overrides per-type maxima for receiving
    (e.g. the syncer's expected fragment size), ``max_partial`` / ``max_reassembly_bytes`` bound reassembly."""

    def __init__(self, sock: socket.socket, *, timeout: float = DEFAULT_TIMEOUT, chunk_size: int = DEFAULT_CHUNK,
                 max_payload: Optional[dict] = None, max_partial: int = 4,
                 max_reassembly_bytes: Optional[int] = None):
        if not 0 < chunk_size <= MAX_CHUNK:
            raise ValueError(f"chunk_size must be in (0, {MAX_CHUNK}]")
        self.sock = sock
        self.timeout = timeout
        self.chunk_size = chunk_size
        self.max_payload = dict(MAX_PAYLOAD)
        self._reasm = Reassembler(max_partial, max_reassembly_bytes, self.max_payload)
        self.set_limits(max_payload or {}, max_reassembly_bytes)
        self._end: Optional[float] = None  # monotonic time by which the message being received must be complete
        self._within: Optional[float] = None
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._broken: Optional[str] = None
        self._error_ok = False   # broken at a message boundary: an ERROR may still be sent
        self._closed = False
        self._tx: Optional[Sealer] = None   # frame protection (after the handshake), per direction
        self._rx: Optional[Opener] = None
        self._rx_clear_error = False
        _tune(sock)
        # non-blocking: each direction polls with its own deadline (a socket timeout would be shared by a
        # receive and a concurrent send on another thread, shortening the send's to the receive's wait)
        sock.setblocking(False)
        try:
            self.peer = "%s:%s" % sock.getpeername()[:2]
        except (OSError, TypeError):
            self.peer = "?"

    def set_limits(self, max_payload: dict, max_reassembly_bytes: Optional[int] = None) -> None:
        """Lower the per-type receive maxima (never above the protocol's) and bound the combined size of the
        messages being reassembled; for the next message on (e.g. once a peer has authenticated)."""
        for t, n in max_payload.items():
            self.max_payload[MsgType(t)] = min(int(n), MAX_PAYLOAD[MsgType(t)])
        self._reasm.max_payload = dict(self.max_payload)
        self._reasm.max_bytes = max_reassembly_bytes

    def protect(self, send_key: bytes, recv_key: bytes, encrypt: bool, clear_error_first: bool = False) -> None:
        """From the next frame on, authenticate (``encrypt``: and encrypt) every frame in both directions with
        these keys (wire/secure.py). ``clear_error_first``: the next received frame may still be an
        unprotected ERROR (a refusal sent before the peer switched); anything else unprotected is refused."""
        with self._send_lock, self._recv_lock:
            self._tx = Sealer(send_key, encrypt)
            self._rx = Opener(recv_key, encrypt)
            self._rx_clear_error = clear_error_first

    @property
    def protection(self) -> str:
        return "none" if self._tx is None else "aead" if self._tx.encrypt else "mac"

    # -------------------------------------------------------------------------------------- state
    def _check_usable(self, error: bool = False) -> None:
        """``error``: an ERROR message, which may still go out after a bad meta (see :meth:`recv`)."""
        if self._closed:
            raise ProtocolError(f"connection to {self.peer} is closed")
        if self._broken and not (error and self._error_ok):
            raise ProtocolError(f"connection to {self.peer} is unusable after an earlier error: {self._broken}")

    def _break(self, why: str) -> None:
        if not self._broken:
            self._broken = why
        self._error_ok = False
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    @property
    def broken(self) -> Optional[str]:
        return self._broken

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------------------------------- send
    def _wait_io(self, event: int, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until the socket is ready for ``event`` (POLLIN/POLLOUT) or has an
        error/hang-up pending (the next socket call then reports it); False on timeout."""
        try:
            p = select.poll()
            p.register(self.sock, event | select.POLLERR | select.POLLHUP)
        except (ValueError, OSError):  # closed by another thread
            raise ProtocolError(f"connection to {self.peer} is closed") from None
        while True:
            try:
                return bool(p.poll(max(0, math.ceil(timeout * 1000))))
            except InterruptedError:
                continue

    def _sendmsg_all(self, parts: list) -> None:
        """Write all ``parts`` (buffers) with scatter-gather I/O; each stall is bounded by the timeout (the
        send's own: a concurrent receive does not change it)."""
        views = [memoryview(p).cast("B") for p in parts if len(p)]
        while views:
            batch = views[:_IOV_MAX]
            try:
                n = self.sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                t0 = time.monotonic()
                if not self._wait_io(select.POLLOUT, self.timeout):
                    why = (f"send to {self.peer} stalled for more than {self.timeout}s (the peer read nothing "
                           f"for {time.monotonic() - t0:.1f}s)")
                    self._break(why)
                    raise WireTimeout(why) from None
                continue
            except OSError as e:
                why = f"send to {self.peer} failed: {e}"
                self._break(why)
                raise ProtocolError(why) from e
            while n:
                if n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                else:
                    views[0] = views[0][n:]
                    n = 0

    def _send_frame(self, msg_type: MsgType, parts: list, flags: int = 0) -> None:
        length = 0
        for p in parts:
            length += memoryview(p).nbytes
        if self._tx is None:
            h = xxhash.xxh3_64()
            for p in parts:
                h.update(p)
            header = encode_header(msg_type, length, h.intdigest(), flags)
            with self._send_lock:
                self._check_usable(msg_type == MsgType.ERROR)
                self._sendmsg_all([header] + parts)
            return
        with self._send_lock:   # sealed under the lock: the sequence numbers follow the wire order
            self._check_usable(msg_type == MsgType.ERROR)
            header = encode_header(msg_type, length, 0, flags | self._tx.flags)
            # sealed and written piece by piece: the socket drains one piece while the next is sealed
            self._tx.stream(header, parts, self._sendmsg_all, clear=1 if msg_type == MsgType.CHUNK else 0)

    def send(self, msg_type: int, meta: Optional[dict] = None, body: Body = b"", *,
             body_len: Optional[int] = None, body_iter: Optional[Iterable] = None) -> None:
        """Send one message. ``body`` is a buffer or a list of buffers (sent without joining); for streaming,
        pass ``body_iter`` (yielding buffers) with ``body_len`` given up front. Payloads larger than the chunk
        size go out as CHUNK frames, one lock acquisition per frame (other messages may interleave)."""
        self._check_usable(msg_type == MsgType.ERROR)
        t = MsgType(msg_type)
        if t == MsgType.CHUNK:
            raise FrameError("CHUNK frames are produced by the transport, not sent directly")
        if body_iter is not None:
            if body_len is None:
                raise FrameError("body_iter needs body_len up front")
            if body is not None and not (isinstance(body, (bytes, bytearray, memoryview)) and len(body) == 0):
                raise FrameError("give either body or body_iter, not both")
            source = body_iter
        else:
            parts = [] if body is None else (list(body) if isinstance(body, (list, tuple)) else [body])
            parts = [memoryview(p).cast("B") for p in parts]
            n = sum(len(p) for p in parts)
            if body_len is not None and body_len != n:
                raise FrameError(f"body_len {body_len} does not match the body's {n} bytes")
            body_len = n
            source = parts
        prefix = pack_meta(meta or {}, body_len)
        total = len(prefix) + body_len
        if total > MAX_PAYLOAD[t]:
            raise FrameError(f"{t.name} payload of {total} bytes exceeds the maximum {MAX_PAYLOAD[t]}")
        if total <= self.chunk_size:
            parts = [memoryview(prefix)]
            got = 0
            for p in source:
                p = memoryview(p).cast("B")
                got += len(p)
                if got > body_len:
                    break
                parts.append(p)
            if got != body_len:
                raise FrameError(f"{t.name} body yielded {got} bytes, announced {body_len}")
            self._send_frame(t, parts)
            return
        self._send_chunked(t, prefix, source, body_len, total)

    def _send_chunked(self, t: MsgType, prefix: bytes, source: Iterable, body_len: int, total: int) -> None:
        msg_id = next(self._ids)
        cs = self.chunk_size
        offset = 0  # payload offset of the current chunk
        pending: list = [memoryview(prefix)]
        pending_len = len(prefix)

        def flush(parts, n):
            nonlocal offset
            env = ENVELOPE.pack(msg_id, t, 0, total, offset)
            self._send_frame(MsgType.CHUNK, [env] + parts)
            offset += n

        sent_body = 0
        try:
            for p in source:
                p = memoryview(p).cast("B")
                sent_body += len(p)
                if sent_body > body_len:
                    raise FrameError(f"{t.name} body yielded more than the announced {body_len} bytes")
                while len(p):
                    take = min(len(p), cs - pending_len)
                    pending.append(p[:take])
                    pending_len += take
                    p = p[take:]
                    if pending_len == cs:
                        flush(pending, pending_len)
                        pending, pending_len = [], 0
            if sent_body != body_len:
                raise FrameError(f"{t.name} body yielded {sent_body} bytes, announced {body_len}")
            if pending_len:
                flush(pending, pending_len)
        except BaseException as e:
            # the peer holds a partial message we cannot complete: do not leave it half-sent silently
            if offset or isinstance(e, FrameError):
                self._break(f"{t.name} message {msg_id} aborted after {offset} of {total} bytes: {e!r}")
            raise

    def send_error(self, code: str, message: str) -> None:
        self.send(MsgType.ERROR, {"code": str(code), "message": str(message)[:4000]})

    # ---------------------------------------------------------------------------------------- recv
    def _recv_into(self, view: memoryview, first_wait: Optional[float] = None, on_data=None) -> None:
        """Fill ``view`` completely. ``first_wait``: timeout for the first byte (then the stall timeout).
        ``on_data``: called with each slice of ``view`` as it arrives (digests while the bytes are in the cache)."""
        got, n = 0, len(view)
        while got < n:
            first = got == 0 and first_wait is not None
            wait = first_wait if first else self.timeout
            if self._end is not None:  # a total bound: a peer sending a byte at a time cannot extend it
                left = self._end - time.monotonic()
                if left <= 0:
                    self._break("message not complete in time")
                    raise WireTimeout(f"message from {self.peer} not complete within {self._within}s")
                wait = min(wait, left)
            try:   # (with on_data, a piece at a time: digested while it is still in the cache)
                r = self.sock.recv_into(view[got:], n - got if on_data is None else min(n - got, PIECE))
            except (BlockingIOError, InterruptedError):
                if self._wait_io(select.POLLIN, wait):
                    continue
                if self._end is not None and time.monotonic() >= self._end:
                    continue  # reported above
                if first:
                    raise WireTimeout(f"no message from {self.peer} within {first_wait}s") from None
                self._break("receive timed out mid-frame")
                raise WireTimeout(f"receive from {self.peer} stalled for more than {self.timeout}s "
                                  f"({got} of {n} bytes)") from None
            except OSError as e:
                if self._broken:   # (a send on another thread broke it: report that, not the peer)
                    raise BrokenHere(self._broken) from e
                self._break(f"receive failed: {e}")
                raise ProtocolError(f"receive from {self.peer} failed: {e}") from e
            if r == 0:
                if self._broken:
                    raise BrokenHere(self._broken)
                self._break("peer closed the connection")
                what = "closed the connection" if first else \
                    f"closed the connection mid-frame ({got} of {n} bytes)"
                raise ProtocolError(f"{self.peer} {what}")
            if on_data is not None:
                on_data(view[got:got + r])
            got += r

    def recv(self, timeout: Optional[float] = None, *, within: Optional[float] = None
             ) -> tuple[MsgType, dict, memoryview]:
        """Receive the next complete message. ``timeout`` bounds the wait for it to start (default: the
        connection timeout); once a frame has started each read must progress within the connection timeout.
        ``within``: the whole message must have arrived within this many seconds (else WireTimeout, and the
        connection is unusable)."""
        with self._recv_lock:
            self._check_usable()
            wait = self.timeout if timeout is None else timeout
            self._end, self._within = (None, None) if within is None else (time.monotonic() + within, within)
            try:
                t, payload, sealed = self._recv(wait)
            except (FrameError, DigestError) as e:   # (FrameAuthError is a FrameError)
                self._break(str(e))
                raise
            finally:
                self._end = None
        try:
            return self._deliver(t, payload, sealed)
        except FrameError as e:
            # a bad meta in a complete frame whose digest matched: nothing more is read, but the stream is in
            # step, so an ERROR naming the cause may still go out before the close (docs/protocol.md)
            if not self._broken:
                self._broken = str(e)
                self._error_ok = True
                try:
                    self.sock.shutdown(socket.SHUT_RD)
                except OSError:
                    pass
            raise

    def _recv(self, wait: float) -> tuple[MsgType, memoryview, bool]:
        """(type, payload, whether its frames were protected) of the next complete message."""
        hdr = bytearray(HEADER_SIZE)
        deadline = time.monotonic() + wait
        while True:
            left = max(0.0, deadline - time.monotonic())
            self._recv_into(memoryview(hdr), first_wait=max(left, 1e-3))
            h = decode_header(hdr)
            sealed = self._check_sealed(h)
            if h.msg_type != MsgType.CHUNK:
                # an unchunked frame is never larger than a chunk (bigger messages must be chunked), so a
                # hostile length cannot make us allocate more than MAX_PAYLOAD[CHUNK] here
                limit = min(self.max_payload[h.msg_type], MAX_PAYLOAD[MsgType.CHUNK])
                if h.length > limit:
                    raise FrameError(f"unchunked {h.msg_type.name} frame announces {h.length} bytes, above this "
                                     f"receiver's maximum {limit} (larger messages travel as CHUNKs)")
                payload = np.empty(h.length, np.uint8)
                if sealed:
                    self._recv_sealed(hdr, None, memoryview(payload), h.msg_type.name)
                else:
                    d = xxhash.xxh3_64()
                    self._recv_into(memoryview(payload), on_data=d.update)
                    if d.intdigest() != h.digest:
                        raise DigestError(f"digest mismatch in {h.msg_type.name} message from {self.peer}")
                return h.msg_type, memoryview(payload), sealed
            if h.length < ENVELOPE_SIZE:
                raise FrameError(f"CHUNK frame of {h.length} bytes is shorter than its envelope")
            envb = bytearray(ENVELOPE_SIZE)
            self._recv_into(memoryview(envb))
            env = parse_envelope(envb)
            n = h.length - ENVELOPE_SIZE
            dst = self._reasm.reserve(env, n)  # validated against maxima before any allocation
            if sealed:
                try:
                    self._recv_sealed(hdr, memoryview(envb), dst,
                                      f"chunk of {_chunks._label(env)} (offset {env.offset})")
                except FrameAuthError:
                    self._reasm.drop(env.msg_id)
                    raise
            else:
                d = xxhash.xxh3_64(envb)
                self._recv_into(dst, on_data=d.update)
                if d.intdigest() != h.digest:
                    self._reasm.drop(env.msg_id)
                    raise DigestError(f"digest mismatch in chunk of {_chunks._label(env)} from {self.peer} "
                                      f"(offset {env.offset})")
            done = self._reasm.commit(env, n)
            if done is not None:   # (with protection on every chunk was sealed: only a lone ERROR may be clear)
                return done[0], memoryview(done[1]), sealed
            # a message is flowing: wait for its next frame as long as for any stalled read
            deadline = max(deadline, time.monotonic() + self.timeout)

    def _check_sealed(self, h) -> bool:
        """Whether this frame is protected; refuses an unprotected frame once protection is on (except the one
        clear ERROR allowed right after the switch) and a protected one before."""
        bits = h.flags & (FLAG_AUTH | FLAG_ENC)
        if self._rx is None:
            if bits:
                raise FrameError(f"{h.msg_type.name} frame from {self.peer} is protected (flags {bits}) but no keys "
                                 "were agreed")
            return False
        clear_ok, self._rx_clear_error = self._rx_clear_error, False
        if bits == self._rx.flags:
            return True
        if not bits and clear_ok and h.msg_type == MsgType.ERROR:
            return False
        want = "authenticated and encrypted" if self._rx.encrypt else "authenticated"
        raise FrameAuthError(f"frame {self._rx.seq} from {self.peer} ({h.msg_type.name}, flags {h.flags}) is not "
                             f"{want} as agreed in the handshake: injected or downgraded; closing the connection")

    def _recv_sealed(self, hdr, clear, body: memoryview, what: str) -> None:
        """Receive a protected frame's payload into ``body`` and its tag, verifying (in ``aead`` mode decrypting)
        each piece as it arrives; FrameAuthError if the tag does not verify (``body`` must then be discarded)."""
        seq = self._rx.seq
        st = self._rx.begin(hdr, clear)
        try:
            if not st.encrypt:
                self._recv_into(body, on_data=st.authenticate)   # each piece while it is in the cache
            else:
                with scratch.piece() as buf:   # the ciphertext lands in the scratch piece, the plaintext in place
                    for o in range(0, len(body), PIECE):
                        piece = body[o:o + PIECE]
                        s = buf[:len(piece)]
                        self._recv_into(s)
                        st.decrypt_into(s, piece)
            tag = bytearray(TAG_SIZE)
            self._recv_into(memoryview(tag))
            st.finish(tag)
        except InvalidTag:
            raise FrameAuthError(f"frame authentication failed: {what} from {self.peer} is not frame {seq} as "
                                 "sealed by the peer (altered, injected, replayed, reordered or dropped on the "
                                 "path); closing the connection") from None

    def _deliver(self, t: MsgType, payload: memoryview, sealed: bool) -> tuple[MsgType, dict, memoryview]:
        meta, body = unpack(payload)
        if t == MsgType.ERROR:
            raise PeerError(str(meta.get("code", "error")), str(meta.get("message", "")), sealed=sealed)
        return t, meta, body


def connect(address: str, timeout: float = 10.0, retries: int = 5, backoff: float = 0.5,
            max_backoff: float = 10.0, **conn_kwargs) -> Connection:
    """Connect to ``host:port``; up to ``retries`` further attempts after the first, sleeping
    ``backoff * 2**i`` (capped at ``max_backoff``, with +-20% jitter) between them. ``timeout`` bounds each
    attempt and is the connection's default operation timeout unless ``conn_kwargs`` sets ``timeout``."""
    host, port = parse_address(address)
    last: Optional[BaseException] = None
    for attempt in range(retries + 1):
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            last = e
            if attempt < retries:
                time.sleep(min(max_backoff, backoff * (2 ** attempt)) * _JITTER.uniform(0.8, 1.2))
            continue
        return Connection(sock, **{"timeout": timeout, **conn_kwargs})
    raise ConnectError(f"could not connect to {address} after {retries + 1} attempts: {last}")


def listen(address: str, backlog: int = 64) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port; see ``getsockname()``)."""
    host, port = parse_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _tune(s)
    s.bind((host, port))
    s.listen(backlog)
    return s

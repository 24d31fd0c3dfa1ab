"""Rounds per fragment: accepting pushes, folding them, deciding when to merge, merging.

This module holds no sockets: the server feeds it pushes and asks it which fragments are due.  Thread-safe:
one central lock (``self.lock`` / ``self.cond``) protects the bookkeeping; decoding and folding a push into
its round's accumulator happens outside that lock (under the round's own fold lock), and so does the merge
arithmetic (the fragment's round is marked closed while it merges, so nothing else touches it).

Semantics (see docs/protocol.md, "Syncer protocol"):

* A fragment's version counts its merges.  The open round of a fragment merges onto base ``version``.
* A push relative to base ``b`` has lag ``version - b`` (plus one while the round it belongs to is merging).
  Lag 0 answers the open round and is folded into its accumulator as it arrives (``exact`` mode holds the
  encoded pushes and folds them at merge time in island order).  A lag in ``1..max_base_lag`` is accepted and
  carried, in its encoded wire form, into the next merge of that fragment, with its weight scaled by
  ``late_factor ** lag``.  A larger lag is refused (the island must pull).  A second push for the same
  (island, fragment, base) is refused.  A non-finite push is refused before it touches anything.
* A round merges when every current member (alive by lease, not finished) answered and at least ``quorum``
  of the islands that have not finished did, once at least ``quorum`` islands have joined the run (so a late
  launch is not left behind and a crashed island is waited for), or when ``quorum``
  answered and ``grace_s`` passed since the quorum was reached, or when ``timeout_s`` passed since the first
  answer and at least ``quorum`` answered.  Otherwise it keeps waiting and says so in the log.
* Weights: ``equal`` (1 per push), ``steps`` or ``tokens`` (as reported by the push).  The outer gradient is
  ``sum(w_i * delta_i) / sum(w_i)`` in float32 (a round whose weights sum to zero merges ``g = 0``).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from ..wire import codecs
from ..wire.frames import CodecError
from .layout import fragment_numels, partition
from .limits import stateless_members
from .merge import ChunkRunner
from .outer import FragmentTensors, NonFiniteMerge, OuterOptimizer

__all__ = ["MergeSettings", "RoundSettings", "PushRefused", "Push", "Coordinator", "MergeRecord",
           "validate_encoded", "WEIGHTINGS", "RWLock"]

log = logging.getLogger("yeto.syncer")
WEIGHTINGS = ("equal", "steps", "tokens")


@dataclass(frozen=True)
class MergeSettings:
    """Everything that changes merge results (stored in checkpoints; a resume must match)."""
    outer: str = "nesterov"
    lr: Optional[float] = None
    momentum: Optional[float] = None
    delay: int = 1
    weights: str = "equal"
    max_base_lag: int = 1
    late_factor: float = 0.5
    exact: bool = False

    def optimizer(self) -> OuterOptimizer:
        return OuterOptimizer(self.outer, self.lr, self.momentum, self.delay)

    def resolved(self) -> dict:
        o = self.optimizer()
        return {**o.config(), "weights": self.weights, "max_base_lag": self.max_base_lag,
                "late_factor": self.late_factor, "exact": self.exact}


@dataclass(frozen=True)
class RoundSettings:
    islands: int = 1
    quorum: Optional[int] = None  # default: islands
    grace_s: float = 5.0
    timeout_s: float = 600.0
    lease_s: float = 60.0
    total_rounds: Optional[int] = None

    @property
    def k(self) -> int:
        return self.quorum if self.quorum is not None else self.islands


class PushRefused(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Push:
    island: str
    fragment: int
    base_version: int
    codec: str
    block: int
    body: object  # bytes-like, encoded
    local_step: int = 0
    steps: int = 0
    tokens: int = 0
    final: bool = False
    incarnation: str = ""
    nbytes: int = 0


@dataclass
class _Contrib:
    push: Push
    weight_raw: float
    folded: bool = False
    lag: int = 0
    held: bool = False  # body kept (exact mode / carried)

    @property
    def island(self):
        return self.push.island


@dataclass
class _Round:
    base_version: int
    contribs: dict = field(default_factory=dict)  # island -> _Contrib (fresh answers)
    acc: Optional[np.ndarray] = None
    inflight: int = 0
    closed: bool = False
    t_first: Optional[float] = None
    t_quorum: Optional[float] = None
    next_wait_log: float = 0.0
    fold_lock: threading.Lock = field(default_factory=threading.Lock)

    def answered(self) -> set:
        """Islands whose push is in the round: folded (or held, in exact mode). A push still being folded is
        not an answer yet: it may be refused, and must not make the round due meanwhile."""
        return {i for i, c in self.contribs.items() if c.folded}


class RWLock:
    """Many readers (broadcasts streaming a base) or one writer (a merge committing); writers preferred."""

    def __init__(self):
        self._c = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting_writers = 0

    def acquire_read(self):
        with self._c:
            while self._writer or self._waiting_writers:
                self._c.wait()
            self._readers += 1

    def release_read(self):
        with self._c:
            self._readers -= 1
            if not self._readers:
                self._c.notify_all()

    def try_acquire_write(self) -> bool:
        """Take the write lock only if nobody holds the lock now (never waits)."""
        with self._c:
            if self._writer or self._readers:
                return False
            self._writer = True
            return True

    def acquire_write(self):
        with self._c:
            self._waiting_writers += 1
            while self._writer or self._readers:
                self._c.wait()
            self._waiting_writers -= 1
            self._writer = True

    def release_write(self):
        with self._c:
            self._writer = False
            self._c.notify_all()


class _Fragment:
    def __init__(self, index: int, numel: int):
        self.index = index
        self.numel = numel
        self.t = FragmentTensors(base=None)  # type: ignore[arg-type]
        self.version = 0
        self.round = _Round(0)
        self.carry: list[_Contrib] = []
        self.rw = RWLock()
        self.closed = False  # total rounds reached / final cut done
        self.down: Optional[np.ndarray] = None   # encoded update shadow(version - 1) -> shadow(version)
        self.down_version = -1
        self.digests: Optional[tuple] = None     # ((version, id(array)), per-tensor xxh3 hex) for 'held' checks


@dataclass
class Member:
    island: str
    incarnation: str
    last_seen: float
    connected: int = 0
    finished: bool = False
    final_fragments: set = field(default_factory=set)
    last_step: int = 0
    pushes: int = 0
    steps: int = 0
    tokens: int = 0

    def alive(self, now: float, lease: float) -> bool:
        return now - self.last_seen <= lease


@dataclass
class MergeRecord:
    fragment: int
    version: int  # new version (or the unchanged one when ok is False)
    ok: bool
    responders: list
    total_weight: float
    bytes: int
    quorum_s: float
    merge_s: float
    grad_norm: float
    expected: list
    reason: str = ""
    t_wall: float = 0.0

    def tape(self) -> dict:
        return {"time": self.t_wall, "fragment": self.fragment, "version": self.version, "ok": self.ok,
                "responders": self.responders, "total_weight": self.total_weight, "bytes": self.bytes,
                "quorum_s": round(self.quorum_s, 6), "merge_s": round(self.merge_s, 6),
                "outer_grad_norm": self.grad_norm if np.isfinite(self.grad_norm) else None,
                "expected": self.expected,
                **({"reason": self.reason} if self.reason else {})}

    def line(self) -> str:
        who = " ".join(f"{r['island']}(lag {r['lag']}{', carried' if r['carried'] else ''}, w {r['weight']:g})"
                       for r in self.responders)
        if not self.ok:
            return f"merge of fragment {self.fragment} at v{self.version} REFUSED: {self.reason}; from {who}"
        return (f"merged fragment {self.fragment} -> v{self.version}: {len(self.responders)} push(es) [{who}], "
                f"{self.bytes / 1e6:.2f} MB in, waited {self.quorum_s:.2f}s, merged in {self.merge_s:.3f}s, "
                f"|g| {self.grad_norm:.4g}")


def validate_encoded(codec: str, body, numel: int, block: int) -> None:
    """Check an encoded push without decoding it (size, scales in range, finite values), exactly as the
    decoder will at merge time: a held push that passes here cannot be dropped later."""
    codecs.check_encoded(codec, memoryview(body).cast("B"), numel, block, threads=1)


class Coordinator:
    def __init__(self, merge: MergeSettings, rounds: RoundSettings, runner: Optional[ChunkRunner] = None,
                 clock: Callable[[], float] = time.monotonic):
        if merge.weights not in WEIGHTINGS:
            raise ValueError(f"unknown weighting {merge.weights!r} (known: {', '.join(WEIGHTINGS)})")
        if merge.max_base_lag < 0:
            raise ValueError("max_base_lag must be >= 0")
        if not 0.0 <= merge.late_factor <= 1.0:
            raise ValueError("late_factor must be in [0, 1]")
        self.ms = merge
        self.rs = rounds
        self.opt = merge.optimizer()
        self.runner = runner or ChunkRunner()
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.manifest: Optional[list] = None
        self.layout: Optional[list] = None
        self.frags: list[_Fragment] = []
        self.members: dict[str, Member] = {}
        self.seen: set = set()  # (island, fragment, base_version) accepted
        self.merges_total = 0
        self.initialized = False
        self.protect: Optional[Callable[[int], None]] = None  # called before a fragment's state changes
        self.guard = None  # a guard.NormGuard: refuses pushes far outside what the fragment has seen
        self._spare: Optional[np.ndarray] = None  # one released accumulator, reused (no fresh page faults)
        self._spare_lock = threading.Lock()
        # --base-wire int8/int4: merged bases go out as quantized updates of a shadow base (what every island
        # holds), with the quantization error left in base - shadow and so carried into the next update
        self.down_codec: Optional[str] = None
        self.down_block = codecs.DEFAULT_BLOCK

    def _take_acc(self, n: int) -> np.ndarray:
        with self._spare_lock:
            sp = self._spare
            if sp is not None and sp.size >= n:
                self._spare = None
                acc = sp[:n]
                self.runner.map(n, lambda a, b: acc[a:b].fill(0.0))
                return acc
        return np.zeros(n, np.float32)

    def _give_acc(self, acc: Optional[np.ndarray]) -> None:
        if acc is None:
            return
        full = acc.base if isinstance(acc.base, np.ndarray) else acc
        with self._spare_lock:
            if self._spare is None or full.size > self._spare.size:
                self._spare = full

    # ------------------------------------------------------------------------------------------ setup
    def set_manifest(self, manifest: list, fragments: int) -> None:
        with self.lock:
            layout = partition(manifest, fragments)
            self.manifest = manifest
            self.layout = layout
            self.frags = [_Fragment(i, n) for i, n in enumerate(fragment_numels(manifest, layout))]

    def missing_init(self) -> list[int]:
        with self.lock:
            return [f.index for f in self.frags if f.t.base is None]

    def init_fragment(self, index: int, values: np.ndarray) -> bool:
        """Install INIT values (float32, finite) for a fragment; True when every fragment has its base."""
        with self.lock:
            if self.initialized:
                raise PushRefused("already-initialized", "the run is already initialized; INIT ignored")
            if not 0 <= index < len(self.frags):
                raise PushRefused("bad-fragment", f"INIT for fragment {index}, the layout has {len(self.frags)}")
            f = self.frags[index]
            if values.dtype != np.float32 or values.size != f.numel:
                raise PushRefused("bad-init", f"INIT of fragment {index} must hold {f.numel} float32 values, "
                                              f"got {values.size} {values.dtype}")
        for a in range(0, values.size, 1 << 20):
            if not np.isfinite(values[a:a + (1 << 20)]).all():
                raise PushRefused("nonfinite", f"INIT of fragment {index} has a non-finite value near {a}")
        with self.lock:
            f.t.base = values if values.flags.writeable else values.copy()
            if self.down_codec is not None:
                f.t.shadow = f.t.base.copy()
            if all(fr.t.base is not None for fr in self.frags):
                for fr in self.frags:
                    self.opt.ensure_state(fr.t)
                self.initialized = True
                self._check_total_rounds()
                self.cond.notify_all()
                return True
            return False

    def versions(self) -> list[int]:
        with self.lock:
            return [f.version for f in self.frags]

    # ------------------------------------------------------------------------------------- membership
    def join(self, island: str, incarnation: str) -> Member:
        now = self.clock()
        with self.lock:
            self._prune()
            m = self.members.get(island)
            alive = [i for i, mm in self.members.items() if mm.alive(now, self.rs.lease_s) and i != island]
            if m is None and len(alive) >= self.rs.islands:
                raise PushRefused("too-many-islands", f"this run expects {self.rs.islands} island(s) and already has "
                                                      f"{sorted(alive)}; refusing island {island!r}")
            if m is None:
                m = self.members[island] = Member(island, incarnation, now)
            else:
                if m.incarnation != incarnation:
                    m.finished = False
                    m.final_fragments = set()
                m.incarnation = incarnation
                m.last_seen = now
            m.connected += 1
            self.cond.notify_all()
            return m

    def touch(self, island: str) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is not None:
                m.last_seen = self.clock()

    def disconnected(self, island: str, bye: bool) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is None:
                return
            m.connected = max(0, m.connected - 1)
            if bye and not m.connected:
                m.last_seen = -float("inf")  # leaves the expected set now
            self._prune()
            self.cond.notify_all()

    def prune(self) -> None:
        """Forget ledger entries that carry no state now (also done on every join and disconnect)."""
        with self.lock:
            self._prune()

    def _prune(self) -> None:
        """(lock held) Forget ledger entries that carry no state (churned ids must not grow the ledger and the
        checkpoint forever; see limits.stateless_members)."""
        busy = {k[0] for k in self.seen}
        for f in self.frags:
            busy.update(c.island for c in list(f.round.contribs.values()) + list(f.carry))
        for i in stateless_members(self.members, busy, self.clock(), self.rs.lease_s):
            del self.members[i]

    def finish(self, island: str, last_step: int) -> None:
        with self.lock:
            m = self.members.get(island)
            if m is not None:
                m.finished = True
                m.last_step = max(m.last_step, int(last_step))
                self.cond.notify_all()

    def alive_members(self, now: Optional[float] = None) -> list[str]:
        now = self.clock() if now is None else now
        with self.lock:
            return sorted(i for i, m in self.members.items() if m.alive(now, self.rs.lease_s))

    def all_finished(self) -> bool:
        now = self.clock()
        with self.lock:
            alive = [m for m in self.members.values() if m.alive(now, self.rs.lease_s)]
            # FINALs end the run only once the roster (the quorum of islands, as for rounds) has joined: an
            # island that finished before the others ever joined must not cut the run at v0 without them
            return bool(alive) and all(m.finished for m in alive) and self._joined_enough()

    def all_closed(self) -> bool:
        with self.lock:
            return self.initialized and all(f.closed for f in self.frags)

    def _check_total_rounds(self) -> None:
        tr = self.rs.total_rounds
        if tr is not None:
            for f in self.frags:
                if f.version >= tr:
                    f.closed = True

    # ------------------------------------------------------------------------------------------ pushes
    def _weight(self, p: Push) -> float:
        if self.ms.weights == "equal":
            return 1.0
        w = p.steps if self.ms.weights == "steps" else p.tokens
        if not isinstance(w, int) or isinstance(w, bool) or w < 0:
            raise PushRefused("bad-push", f"push reports {self.ms.weights} = {w!r}; need an integer >= 0")
        return float(w)

    def accept(self, p: Push) -> tuple[str, int]:
        """Accept a push (fold it if it answers the open round). Returns (status, lag); raises PushRefused."""
        with self.lock:
            if not self.initialized:
                raise PushRefused("not-initialized", "the run has no base yet (waiting for INIT); push refused")
            frag = p.fragment
            if isinstance(frag, bool) or not (isinstance(frag, int) and 0 <= frag < len(self.frags)):
                raise PushRefused("bad-fragment", f"push for fragment {p.fragment!r}; the layout has "
                                                  f"{len(self.frags)} fragments")
            f = self.frags[p.fragment]
            if f.closed:
                return "closed", 0
            if (isinstance(p.base_version, bool) or not isinstance(p.base_version, int) or p.base_version < 0
                    or p.base_version > f.version):
                raise PushRefused("bad-base", f"push of fragment {f.index} relative to base v{p.base_version}, but "
                                              f"the syncer's newest is v{f.version}")
            try:
                codecs.check_codec(p.codec, p.block)
            except CodecError as e:
                raise PushRefused("bad-codec", str(e)) from None
            w = self._weight(p)
            p.nbytes = memoryview(p.body).nbytes
            key = (p.island, f.index, p.base_version)
            r = f.round
            lag = f.version - p.base_version + (1 if r.closed else 0)
            if lag > self.ms.max_base_lag:
                raise PushRefused("stale", f"push of fragment {f.index} is relative to base v{p.base_version} but the "
                                           f"syncer is at v{f.version} (lag {lag} > max-base-lag "
                                           f"{self.ms.max_base_lag}); pull the current base and push again")
            if key in self.seen:
                raise PushRefused("duplicate", f"island {p.island!r} already pushed fragment {f.index} relative to "
                                               f"base v{p.base_version}; duplicate refused")
            held = lag != 0 or self.ms.exact
        guard = self.guard
        norm = guard.measure(p.codec, p.body, f.numel, p.block) if guard is not None else None
        base_norm = guard.base_norm(f.index, f.version, f.t.base) \
            if norm is not None and guard.needs_base_norm(f.index) else 0.0
        validated = False
        while True:
            if held and not validated:  # a held push is validated now: it is decoded only at merge time
                try:
                    validate_encoded(p.codec, p.body, f.numel, p.block)
                except CodecError as e:
                    log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, e)
                    raise PushRefused("nonfinite" if "finite" in str(e) or "scale" in str(e) else "bad-push",
                                      f"push of fragment {f.index} refused: {e}") from None
                validated = True
            with self.lock:
                # state may have moved meanwhile: re-check
                if key in self.seen:
                    raise PushRefused("duplicate", f"island {p.island!r} already pushed fragment {f.index} "
                                                   f"relative to base v{p.base_version}; duplicate refused")
                r = f.round
                lag = f.version - p.base_version + (1 if r.closed else 0)
                if f.closed:
                    return "closed", 0
                if lag > self.ms.max_base_lag:
                    raise PushRefused("stale", f"push of fragment {f.index} is relative to base v{p.base_version} "
                                               f"but the syncer is at v{f.version}; pull the current base and push "
                                               "again")
                held = lag != 0 or self.ms.exact
                if held and not validated:
                    continue  # the round merged while we looked: validate, then decide again
                why = guard.admit(f.index, norm, p.island, base_norm) if guard is not None else None
                if why is not None:
                    raise PushRefused("outlier", why)
                c = self._register(p, f, r, w, lag, held, key)
                if c is None:
                    return ("carried", lag) if lag else ("accepted", 0)
                break
        return self._fold(p, f, r, c, w, key)

    def _register(self, p: Push, f: _Fragment, r: _Round, w: float, lag: int, held: bool,
                  key) -> Optional[_Contrib]:
        """(lock held) Record an accepted push; returns the contribution when it still has to be folded."""
        c = _Contrib(p, w, lag=lag, held=held)
        self.seen.add(key)
        if lag != 0:
            self._credit(p, f)
            f.carry.append(c)
            self.cond.notify_all()
            return None
        if not self.ms.exact:
            r.inflight += 1
        r.contribs[p.island] = c
        if self.ms.exact:
            c.folded = True
            self._answer(r, p, f)
            self.cond.notify_all()
            return None
        return c

    def _answer(self, r: _Round, p: Push, f: _Fragment) -> None:
        """(lock held) A push became an answer of round ``r``: round timing and the island's bookkeeping."""
        now = self.clock()
        if r.t_first is None:
            r.t_first = now
        if r.t_quorum is None and len(r.answered()) >= self.rs.k:
            r.t_quorum = now
        self._credit(p, f)

    def _credit(self, p: Push, f: _Fragment) -> None:
        """(lock held) The island's bookkeeping for an accepted push; a push refused while it is being folded
        must leave none (its final flag would drop the island from the fragment's expected set)."""
        m = self.members.get(p.island)
        if m is not None:
            m.last_seen = self.clock()
            if p.final:
                m.final_fragments.add(f.index)
            m.last_step = max(m.last_step, int(p.local_step or 0))

    def _fold(self, p: Push, f: _Fragment, r: _Round, c: _Contrib, w: float, key) -> tuple[str, int]:
        """Streaming fold of an accepted push into its round's accumulator, outside the central lock."""
        err = None
        try:
            with r.fold_lock:
                if r.acc is None:
                    r.acc = self._take_acc(f.numel)
                codecs.decode_accumulate(p.codec, p.body, f.numel, w, r.acc, p.block,
                                         threads=self.runner.threads)
        except CodecError as e:
            err = e
        with self.lock:
            r.inflight -= 1
            c.push.body = None  # the decoded values live in the accumulator now
            if err is None:
                c.folded = True
                self._answer(r, p, f)
            else:  # it never was an answer: nothing to undo but its registration
                r.contribs.pop(p.island, None)
                self.seen.discard(key)
            self.cond.notify_all()
        if err is not None:
            log.warning("refused push of fragment %d from island %s: %s", f.index, p.island, err)
            raise PushRefused("nonfinite" if "finite" in str(err) or "scale" in str(err) else "bad-push",
                              f"push of fragment {f.index} refused: {err}")
        return "accepted", 0

    # --------------------------------------------------------------------------------------- scheduling
    def expected(self, f: _Fragment, now: float) -> set:
        return {i for i, m in self.members.items()
                if m.alive(now, self.rs.lease_s) and not m.finished and f.index not in m.final_fragments}

    def _joined_enough(self) -> bool:
        """(lock held) Whether at least ``quorum`` islands have joined this run so far.  Until then "every
        current member answered" does not close a round, so islands launched a little later than the first
        one are not left behind by rounds merged without them.  Islands that joined and then left (lease,
        BYE, final cut) still count: they leave the expected set as before."""
        return len(self.members) >= min(self.rs.k, self.rs.islands)

    def _floor(self, f: _Fragment) -> int:
        """(lock held) The fewest answers that may close a round of ``f`` by "every member answered": the
        quorum, or fewer once islands have finished (final push or last step).  An island that crashed, lost
        its link or said BYE before its end still counts, so with ``--quorum`` equal to ``--islands`` (a fixed
        roster) the others wait for it to come back instead of merging without it."""
        active = sum(1 for m in self.members.values() if not m.finished and f.index not in m.final_fragments)
        return max(1, min(self.rs.k, active))

    def due(self) -> list[int]:
        """Fragments whose open round should merge now (logs rounds that wait below quorum past the timeout)."""
        now = self.clock()
        out = []
        with self.lock:
            for f in self.frags:
                r = f.round
                answered = r.answered()
                if f.closed or r.closed or not answered:
                    continue
                exp = self.expected(f, now)
                if exp <= answered and self._joined_enough() and len(answered) >= self._floor(f):
                    out.append(f.index)
                elif len(answered) >= self.rs.k:
                    if r.t_quorum is None:
                        r.t_quorum = now
                    if now >= r.t_quorum + self.rs.grace_s or now >= r.t_first + self.rs.timeout_s:
                        out.append(f.index)
                elif now >= r.t_first + self.rs.timeout_s and now >= r.next_wait_log:
                    r.next_wait_log = now + max(self.rs.timeout_s, 1.0)
                    log.warning("fragment %d round on v%d waits: %d of quorum %d answered (%s); missing %s",
                                f.index, f.version, len(answered), self.rs.k, sorted(answered),
                                sorted(exp - answered))
        return out

    def next_deadline(self) -> Optional[float]:
        """Earliest clock time at which a round may become due by grace/timeout (None: only events matter)."""
        with self.lock:
            ts = []
            for f in self.frags:
                r = f.round
                if f.closed or r.closed or len(r.answered()) < self.rs.k:
                    continue  # below quorum only events (pushes, lease expiry) can make a round due
                if r.t_quorum is not None:
                    ts.append(r.t_quorum + self.rs.grace_s)
                ts.append(r.t_first + self.rs.timeout_s)
            return min(ts) if ts else None

    def pending(self, index: int) -> bool:
        with self.lock:
            f = self.frags[index]
            return bool(f.round.contribs or f.carry)

    # ------------------------------------------------------------------------------------------- merge
    def merge(self, index: int, force: bool = False, wait_streams: bool = True) -> Optional[MergeRecord]:
        """Merge the open round of fragment ``index``. ``force`` (final cut) merges carried pushes alone too.

        The fragment's base is written in place, so the merge holds its write lock: bases of this fragment being
        streamed to islands finish first.  With ``wait_streams=False`` a merge that would have to wait for such
        a stream returns None at once (the round stays open; the caller retries later and merges other
        fragments meanwhile)."""
        f = self.frags[index]
        if wait_streams:
            f.rw.acquire_write()
        elif not f.rw.try_acquire_write():
            return None
        try:
            return self._merge_locked(f, index, force)
        finally:
            f.rw.release_write()

    def _merge_locked(self, f: _Fragment, index: int, force: bool) -> Optional[MergeRecord]:
        with self.lock:
            r = f.round
            if r.closed or (f.closed and not force):
                return None
            r.closed = True
            while r.inflight:
                self.cond.wait()
            fresh = sorted(r.contribs.values(), key=lambda c: c.island)
            carried = sorted(f.carry, key=lambda c: (c.island, c.push.base_version))
            if not fresh and not (force and carried):
                r.closed = False
                return None
            f.carry = []
            version = f.version
            expected = sorted(self.expected(f, self.clock()))
            t_first = r.t_first if r.t_first is not None else self.clock()
        t0 = self.clock()
        t_wall = time.time()
        responders, weights = [], []
        try:
            acc = r.acc
            if acc is None:
                acc = r.acc = self._take_acc(f.numel)
            if self.ms.exact:
                for c in fresh:
                    codecs.decode_accumulate(c.push.codec, c.push.body, f.numel, c.weight_raw, acc, c.push.block,
                                             threads=self.runner.threads)
            for c in fresh:
                weights.append(c.weight_raw)
                responders.append(self._resp(c, 0, c.weight_raw, False))
            for c in carried:
                lag = version - c.push.base_version
                w = c.weight_raw * (self.ms.late_factor ** lag)
                try:
                    codecs.decode_accumulate(c.push.codec, c.push.body, f.numel, w, acc, c.push.block,
                                             threads=self.runner.threads)
                except CodecError as e:  # validated on arrival, so not expected; never poisons the round
                    log.error("fragment %d: carried push from island %s dropped: %s", index, c.island, e)
                    continue
                weights.append(w)
                responders.append(self._resp(c, lag, w, True))
            total = 0.0
            for w in weights:  # fixed order
                total += w
            if self.protect is not None:
                self.protect(index)
            norm = self.opt.step(f.t, acc, total, version + 1, self.runner)
            ok, reason = True, ""
        except (NonFiniteMerge, CodecError) as e:
            ok, reason, norm = False, str(e), float("nan")
        if ok and f.t.shadow is not None:
            self._base_update(f, acc, version + 1)
        nbytes = sum(r_["bytes"] for r_ in responders)
        with self.lock:
            for c in fresh + carried:
                c.push.body = None
            if ok:
                f.version = version + 1
                self.merges_total += 1
                for c in fresh + carried:
                    m = self.members.get(c.island)
                    if m is not None:
                        m.pushes += 1
                        m.steps += int(c.push.steps or 0)
                        m.tokens += int(c.push.tokens or 0)
                self._check_total_rounds()
                lo = f.version - self.ms.max_base_lag - 1
                self.seen = {k for k in self.seen if k[1] != index or k[2] >= lo}
            else:
                log.error("fragment %d: merge at v%d refused (%s); pushes from %s dropped, state unchanged",
                          index, version, reason, [x["island"] for x in responders])
                for c in fresh + carried:
                    self.seen.discard((c.island, index, c.push.base_version))
            f.round = _Round(f.version)
            self.cond.notify_all()
        self._give_acc(r.acc)
        r.acc = None
        t1 = self.clock()
        return MergeRecord(fragment=index, version=f.version, ok=ok, responders=responders, total_weight=total
                           if ok else 0.0, bytes=nbytes, quorum_s=max(0.0, t0 - t_first), merge_s=t1 - t0,
                           grad_norm=norm, expected=expected, reason=reason, t_wall=t_wall)

    def _base_update(self, f: _Fragment, scratch: np.ndarray, version: int) -> None:
        """shadow += decode(encode(base - shadow)); the encoded update goes to islands holding the previous
        shadow. (The merge holds the fragment's write lock; ``scratch`` is the spent accumulator.)"""
        try:
            np.subtract(f.t.base, f.t.shadow, out=scratch)
            body = codecs.encode(self.down_codec, scratch, self.down_block, name=f"fragment {f.index} base update",
                                 threads=self.runner.threads)
            codecs.decode(self.down_codec, body, f.numel, self.down_block, out=scratch, threads=self.runner.threads)
            np.add(f.t.shadow, scratch, out=f.t.shadow)
            f.down, f.down_version = body, version
        except CodecError as e:   # not expected (base and shadow are finite): islands get the full base instead
            log.error("fragment %d: base update to v%d not encodable (%s); sending the full base", f.index, version, e)
            np.copyto(f.t.shadow, f.t.base)
            f.down, f.down_version = None, -1

    @staticmethod
    def _resp(c: _Contrib, lag: int, w: float, carried: bool) -> dict:
        p = c.push
        return {"island": p.island, "lag": lag, "weight": w, "carried": carried, "base_version": p.base_version,
                "steps": p.steps, "tokens": p.tokens, "local_step": p.local_step, "codec": p.codec,
                "bytes": int(p.nbytes)}



# ------------------------------------------------------------------------------------ checkpoint state
def capture(coord: Coordinator, extra: Optional[dict] = None):
    """A consistent :class:`~.checkpoint.Snapshot` of the committed state (call between merges)."""
    from ..wire import auth
    from .checkpoint import FORMAT_VERSION, Snapshot
    from .layout import manifest_to_json

    with coord.lock:
        frags, arrays = [], []
        for f in coord.frags:
            frags.append({"index": f.index, "numel": f.numel, "version": f.version})
            d = {"base": f.t.base}
            if f.t.momentum is not None:
                d["momentum"] = f.t.momentum
            if f.t.delay_buf is not None:
                d["delay_buf"] = f.t.delay_buf
            if f.t.shadow is not None:
                d["shadow"] = f.t.shadow
            arrays.append(d)
        # pushes already merged (refused as duplicates after a resume); those of open rounds are not merged
        # and are lost with the process: their islands push them again
        unmerged = set()
        for f in coord.frags:
            for c in list(f.round.contribs.values()) + list(f.carry):
                unmerged.add((c.island, f.index, c.push.base_version))
        merged = sorted([i, fr, b] for i, fr, b in coord.seen if (i, fr, b) not in unmerged)
        ledger = {i: {"incarnation": m.incarnation, "pushes": m.pushes, "steps": m.steps, "tokens": m.tokens,
                      "last_step": m.last_step, "finished": m.finished,
                      "final_fragments": sorted(m.final_fragments)} for i, m in coord.members.items()}
        meta = {"format": "yeto-syncer-checkpoint", "format_version": FORMAT_VERSION, "created_unix": time.time(),
                "manifest": manifest_to_json(coord.manifest),
                "manifest_digest": auth.manifest_digest(coord.manifest).hex(),
                "layout": coord.layout, "merge_config": coord.ms.resolved(), "merges_total": coord.merges_total,
                "fragments": frags, "ledger": ledger, "merged_pushes": merged, **(extra or {})}
    return Snapshot(meta, arrays)


def restore(coord: Coordinator, meta: dict, arrays: list) -> None:
    """Install a loaded checkpoint into a fresh coordinator (refuses a different merge configuration)."""
    from ..wire import auth
    from .checkpoint import CheckpointError
    from .layout import normalize_manifest

    want = coord.ms.resolved()
    have = meta.get("merge_config", {})
    diff = [k for k in sorted(set(want) | set(have)) if want.get(k) != have.get(k)]
    if diff:
        raise CheckpointError("the checkpoint was written with a different merge configuration: " + ", ".join(
            f"{k}={have.get(k)!r} (now {want.get(k)!r})" for k in diff) + "; resume with the same settings")
    manifest = normalize_manifest(meta["manifest"])
    if auth.manifest_digest(manifest).hex() != meta.get("manifest_digest"):
        raise CheckpointError("checkpoint manifest digest does not match its manifest")
    layout = meta["layout"]
    with coord.lock:
        coord.set_manifest(manifest, len(layout))
        if coord.layout != layout:
            raise CheckpointError("checkpoint layout differs from the layout this syncer computes for its manifest")
        for f, fm, arr in zip(coord.frags, meta["fragments"], arrays):
            if fm["numel"] != f.numel or arr.get("base") is None or arr["base"].size != f.numel:
                raise CheckpointError(f"checkpoint fragment {f.index} has the wrong size")
            f.t.base = arr["base"]
            f.t.momentum = arr.get("momentum")
            f.t.delay_buf = arr.get("delay_buf")
            if coord.down_codec is not None:   # islands rejoin with the full shadow; without one: shadow = base
                sh = arr.get("shadow")
                f.t.shadow = sh if sh is not None and sh.size == f.numel else f.t.base.copy()
            coord.opt.ensure_state(f.t)
            f.version = int(fm["version"])
            f.round = _Round(f.version)
        coord.merges_total = int(meta.get("merges_total", 0))
        for island, e in meta.get("ledger", {}).items():
            # members of the resumed run are expected again for one lease (they reconnect with back-off)
            coord.members[island] = Member(island, e.get("incarnation", ""), last_seen=coord.clock(),
                                           finished=bool(e.get("finished", False)),
                                           final_fragments={int(x) for x in e.get("final_fragments", [])},
                                           last_step=int(e.get("last_step", 0)),
                                           pushes=int(e.get("pushes", 0)), steps=int(e.get("steps", 0)),
                                           tokens=int(e.get("tokens", 0)))
        coord.seen = {(str(i), int(fr), int(b)) for i, fr, b in meta.get("merged_pushes", [])}
        coord.initialized = True
        coord._check_total_rounds()

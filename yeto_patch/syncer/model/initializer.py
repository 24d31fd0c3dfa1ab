"""Which island's INIT becomes the run's initial base: the syncer's choice, never a race unless asked for.

The initial base decides where every island starts; with tau = 0 it decides the run bit for bit, and a fine-tune
that starts from another island's random weights silently loses its pretrained start (issue 27). The policy
(``--initializer``):

- ``lowest-id`` (the default): the lowest island id among the islands joined, chosen once all ``--islands``
  islands joined (islands that joined earlier wait for the others at their start: the first round would wait for
  them anyway with a fixed roster), or ``--init-wait`` seconds after the first island joined, whichever comes
  first (then the lowest id of those present, with a warning: the start depended on who came in time);
- ``first``: the first island to join (no waiting at all; which island's weights start the run depends on which
  island connects first);
- an island id: that island; the others wait for it (bounded by their YETO_DILOCO_TIMEOUT).

An island started with ``YETO_DILOCO_INITIALIZER=1`` declares that its weights are the run's start (the island that
loaded the pretrained weights of a fine-tune): under ``lowest-id`` and ``first`` it is taken as soon as it joins,
whoever else is there. A declaration the syncer cannot honour is refused at the join, naming why, rather than
losing a start silently: a syncer told ``--initializer X`` refuses another island's declaration; two islands that
declare different start digests (YETO_DILOCO_START_DIGEST, on by default) refuse the second; and an island that
declares while or after the run is initialized from another island with other weights is refused. Without any
declaration, islands that start from different weights (their digests differ: every pretraining from random
weights) take the chosen island's INIT; the syncer logs that it did and how to name an initializer.

An INIT message's body is read (``init_values``: float32, usable values) and installed as the fragment's initial
base (``take_init``: only from the island asked for it, before the run is initialized).

Choosing again (the initializer left or stalled before its INIT completed): under ``lowest-id`` the lowest id of
the fit islands present (the roster already met or the wait already ended); a named island only itself; a declared
island is replaced by another declared one, and if none comes within ``--init-wait`` of its leaving, by the policy's
choice among the islands present, with a warning saying whether their start digests match the declared start's
(issue 35: a key holder that declared and left kept the run from ever starting).
"""
from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, Optional

import numpy as np

from ...wire.frames import MsgType
from ...wire.text import printable
from ..rounds.pushes import PushRefused
from .limits import InitWatch

__all__ = ["POLICIES", "DEFAULT_INIT_WAIT_S", "InitChoice", "Initializing", "policy_arg", "init_values", "take_init"]

log = logging.getLogger("yeto.syncer")

POLICIES = ("lowest-id", "first")
DEFAULT_INIT_WAIT_S = 300.0


def policy_arg(value: str) -> str:
    """``--initializer``'s value: a policy or an island id (ValueError naming what is accepted)."""
    from ...wire.text import check_island_id
    v = str(value)
    if v in POLICIES:
        return v
    try:
        return check_island_id(v)
    except ValueError as e:
        raise ValueError(f"--initializer must be {' or '.join(POLICIES)} or an island id: {e}") from None


class InitChoice:
    """The initializer policy and what it has seen. Candidates are joined sessions: ``island`` (id), ``closed``,
    ``declares_init`` (YETO_DILOCO_INITIALIZER=1) and ``declared`` (start digests or None)."""

    def __init__(self, policy: str = "lowest-id", roster: int = 1, wait_s: float = DEFAULT_INIT_WAIT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy_arg(policy)
        self.roster = int(roster)
        self.wait_s = float(wait_s)
        self.clock = clock
        self.first_join: Optional[float] = None
        self.ready = False         # lowest-id: the roster was complete once, or the wait ended
        self.waited_out = False    # ... by the wait (the start then depended on who came in time)
        self.declared_only = False   # a declared island was chosen: only a declared one may replace it ...
        self.declared_left: Optional[float] = None   # ... until --init-wait after the declared start left
        self.declared_start = None   # the start digests of the declared island that left (for the warning)
        self.fell_back = False       # the run is initialized by the policy after a declared start left
        self.init_from = None      # (island id, its start digests) whose INIT initialized the run

    @property
    def named(self) -> Optional[str]:
        return None if self.policy in POLICIES else self.policy

    def joined(self) -> None:
        if self.first_join is None:
            self.first_join = self.clock()

    def deadline(self) -> Optional[float]:
        """When the wait for the roster (or for a declared start that left) ends (clock time), None when nothing
        waits on it."""
        if self.declared_only and self.declared_left is not None:
            return self.declared_left + self.wait_s
        if self.policy != "lowest-id" or self.ready or self.first_join is None:
            return None
        return self.first_join + self.wait_s

    def conflict(self, s, live: Iterable, initialized: bool, chosen=None) -> Optional[str]:
        """Why the join of session `s` must be refused (None: it may join): its declaration to initialize the run
        cannot be honoured. `chosen`: the session already asked to INIT the run (None: none yet)."""
        if not getattr(s, "declares_init", False):
            return None
        if self.named is not None and s.island != self.named:
            return (f"island {s.island!r} declares its weights the run's start (YETO_DILOCO_INITIALIZER=1), but "
                    f"this syncer takes the start from island {self.named!r} (--initializer); unset the variable "
                    f"on this island or start the syncer with --initializer {s.island}")
        for x in live:
            if x is not s and not x.closed and getattr(x, "declares_init", False) and x.island != s.island \
                    and not _same(x.declared, s.declared):
                return (f"islands {x.island!r} and {s.island!r} both declare their weights the run's start "
                        f"(YETO_DILOCO_INITIALIZER=1) and their start digests differ; set it on one island only")
        if not initialized and chosen is not None and not chosen.closed and chosen.island != s.island \
                and not _same(chosen.declared, s.declared):
            return (f"island {s.island!r} declares its weights the run's start (YETO_DILOCO_INITIALIZER=1), but "
                    f"the run is being initialized from island {chosen.island!r}'s weights, which differ; restart "
                    f"the syncer run with this island joining first, or name it with --initializer")
        if initialized and self.init_from is not None and self.init_from[0] != s.island \
                and not _same(self.init_from[1], s.declared):
            return (f"island {s.island!r} declares its weights the run's start (YETO_DILOCO_INITIALIZER=1), but "
                    f"the run was initialized from island {self.init_from[0]!r}'s weights, which differ; start a "
                    f"new syncer run with this island's start (or unset the variable to take the run's)")
        return None

    def choose(self, live: list, fit: list, joining=None):
        """The session whose INIT starts the run, or None (wait): `live` the joined open sessions, `fit` those
        not known to have stalled an INIT, `joining` the session joining now (if any)."""
        named = self.named
        if named is not None:
            return next((x for x in live if x.island == named), None)
        declared = [x for x in fit if getattr(x, "declares_init", False)]
        if declared:
            self.declared_only, self.declared_left = True, None
            chosen = min(declared, key=lambda x: x.island)
            self.declared_start = getattr(chosen, "declared", None)
            return chosen
        if self.declared_only:   # the declared start left or stalled: wait for it (or another declared one) ...
            if self.declared_left is None:
                self.declared_left = self.clock()
            if self.clock() - self.declared_left < self.wait_s:
                return None
            self.fell_back = self.ready = True   # ... for --init-wait, then the policy among the islands present
        if self.policy == "first":
            return joining if joining is not None and joining in fit else (fit[0] if fit else None)
        if not self.ready:
            if len(live) >= self.roster:
                self.ready = True
            elif self.first_join is not None and self.clock() - self.first_join >= self.wait_s:
                self.ready = self.waited_out = True
        return min(fit, key=lambda x: x.island) if self.ready and fit else None

    def why(self, chosen) -> str:
        """Why `chosen` initializes the run (for the log)."""
        if self.named is not None:
            return "named by --initializer"
        if self.fell_back and not getattr(chosen, "declares_init", False):
            same = _same(self.declared_start, getattr(chosen, "declared", None))
            return (f"the island that declared its weights the run's start left before its INIT and none came back "
                    f"within --init-wait {self.wait_s:g}s; " + ("its start digests match the declared start" if same
                                                               else "ITS WEIGHTS DIFFER FROM THE DECLARED START: a "
                                                                    "fine-tune would start from other weights"))
        if getattr(chosen, "declares_init", False):
            return "it declares its weights the run's start (YETO_DILOCO_INITIALIZER=1)"
        if self.policy == "first":
            return "the first to join (--initializer first)"
        if self.waited_out:
            return (f"the lowest id of the islands joined within --init-wait {self.wait_s:g}s; the roster of "
                    f"{self.roster} was not complete, so the start depended on who came in time")
        return "the lowest id of the complete roster"

    def initialized_from(self, s, others: Iterable) -> Optional[str]:
        """Record that the run was initialized from session `s`; a log line when other islands joined with other
        start weights (they take s's INIT), else None."""
        self.init_from = (s.island, getattr(s, "declared", None))
        differ = sorted(x.island for x in others if x is not s and not x.closed and x.declared is not None
                        and s.declared is not None and not _same(x.declared, s.declared))
        if not differ:
            return None
        return (f"islands {differ} started from other weights than island {s.island!r} and take its INIT "
                f"(pretraining from random weights: expected; for a fine-tune, start the island that loaded the "
                f"pretrained weights with YETO_DILOCO_INITIALIZER=1 or name it with --initializer)")


def _same(a, b) -> bool:
    """Two islands' start digests are the same weights (unknown digests count as the same: nothing to compare)."""
    return a is None or b is None or list(a) == list(b)


class Initializing:
    """The syncer's side of the run's start (server.py delegates): the chosen session, the INIT progress watch
    (``--init-timeout``) and the policy. Every method but ``check`` runs under the coordinator's lock."""

    def __init__(self, choice: InitChoice, watch: InitWatch):
        self.choice, self.watch = choice, watch
        self.session = None   # the joined session asked to INIT the run

    def expects(self, s) -> bool:
        return s is self.session

    def pick(self, sessions: dict, coord, joining=None, exclude=None) -> list:
        """Choose the island whose INIT becomes the run's initial base (before INIT is complete) by the policy.
        Returns the fragments `joining` must INIT (its WELCOME carries them); another chosen island gets an INIT
        request. `exclude`: a session whose claim was just dropped."""
        if self.session is not None and not self.session.closed:
            return []
        self.session = None
        live = [x for x in sessions.values() if not x.closed and x is not exclude]
        fit = [x for x in live if x.island not in self.watch.failed] or live   # (not one that stalled INIT)
        chosen = self.choice.choose(live, fit, joining)
        if chosen is None:
            return []
        self.session = chosen
        self.watch.assigned()
        (log.warning if self.choice.waited_out or self.choice.fell_back else log.info)(
            "island %s initializes the run (%s)", printable(chosen.island), self.choice.why(chosen))
        if chosen is joining:
            return coord.missing_init()
        chosen.post(MsgType.INIT, {"request": coord.missing_init()})
        return []

    def check(self, sessions: dict, coord) -> None:
        """(scheduler, the server's INIT lock held) The initializing island made no INIT progress within the INIT
        timeout: forget its claim and its partial INIT and choose again (its later INIT is refused); the
        --init-wait of lowest-id ended without the full roster: the lowest id present initializes the run."""
        with coord.lock:
            old = self.session
            if coord.initialized:
                return
            if old is not None and not old.closed and self.watch.expired():
                for f in coord.mine():
                    f.drop_init()
                self.watch.failed.add(old.island)
                self.watch.clear()
                self.session = None
                self.pick(sessions, coord, exclude=old)
                log.warning("initializing island %s completed no INIT within %.1fs (--init-timeout); its claim "
                            "is dropped%s", printable(old.island), self.watch.timeout_s,
                            f"; asking island {printable(self.session.island)}" if self.session
                            else "; waiting for an island the initializer policy takes")
                return
            dl = self.choice.deadline()
            if (old is None or old.closed) and dl is not None and self.choice.clock() >= dl:
                self.pick(sessions, coord)

    def left(self, s, sessions: dict, coord) -> None:
        """Session `s` closed: if it was initializing the run, its partial INIT is dropped and another island
        chosen."""
        if s is not self.session or coord.initialized:
            return
        coord.drop_partial_init()
        self.session = None
        self.pick(sessions, coord)
        log.warning("initializing island %s left before INIT completed; %s", printable(s.island),
                    f"asking island {printable(self.session.island)}" if self.session is not None
                    else "waiting for an island the initializer policy takes")

    def done(self, s, sessions: dict) -> None:
        """The run was initialized from session `s`'s INIT."""
        note = self.choice.initialized_from(s, list(sessions.values()))
        if note:
            log.info("%s", note)


# ---------------------------------------------------------------------------------- an INIT from the wire
def init_values(meta: dict, body) -> tuple:
    """(fragment, float32 values, body bytes) of an INIT message; PushRefused("bad-init") for a body that is not
    float32 (KeyError, ValueError, TypeError: malformed). Its values are checked where they are installed
    (``Coordinator.init_fragment``: finite and usable as a base, in one pass)."""
    idx = meta["fragment"]
    mv = memoryview(body).cast("B")
    if meta.get("dtype", "f32") != "f32" or mv.nbytes % 4:
        raise PushRefused("bad-init", "INIT bodies are float32")
    arr = np.frombuffer(mv, np.float32)
    if arr.ctypes.data % 4 or not arr.flags.writeable:
        arr = arr.copy()
    return idx, arr, mv.nbytes


def take_init(coord, init: Initializing, s, meta: dict, body) -> tuple[bool, int]:
    """Install session ``s``'s INIT of one fragment (``coord``: the rounds' Coordinator): (True when every fragment
    has its base now, body bytes).
    Raises PushRefused whose message the ERROR ``init`` that answers it carries: an INIT after the run was
    initialized, from an island not asked for it, refused by the coordinator or malformed."""
    if coord.initialized:   # (docs/protocol.md: a second INIT is an ERROR init)
        raise PushRefused("init", "INIT after the run was initialized; refused")
    if not init.expects(s):
        raise PushRefused("init", "INIT not expected from this island (another island initializes the run)")
    try:
        idx, arr, nbytes = init_values(meta, body)
        return coord.init_fragment(idx, arr), nbytes
    except (KeyError, ValueError, TypeError) as e:
        raise PushRefused("init", f"malformed INIT: {e}") from None

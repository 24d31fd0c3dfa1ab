"""The records that cross between an island's boundary (island/boundary/) and its link to the syncer
(island/link/): frozen values, the only thing either package imports of the other's concern (torch-free).

The boundary hands the link an ``OutgoingPush`` (the encoded body with the codec, block and blend it was made
with: nothing is re-read from settings on the way). The link keeps its own unanswered pushes and returns what
it received in one ``Inbox`` per poll: the bases (``ArrivedBase``: the wire base and which of this island's
pushes its merge took), the refusals of pushes (``Refusal``), the sends that ended (``Sent``) and what a
reconnect found (``Reconnected``). Only the fragment (boundary/fragment.py) writes the fragment's state from them.

``SyncerLinkLike`` is the contract the records travel over: what the boundary and the engine call on rank 0's
link, implemented by ``link.syncer.SyncerLink`` (one syncer) and ``link.sharded.ShardedLink`` (a sharded one);
``tests/island/link/test_protocol.py`` checks that both implement every member with the same signature.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Protocol, Tuple, runtime_checkable

__all__ = ["OutgoingPush", "ArrivedBase", "Refusal", "Carried", "Sent", "Reconnected", "Inbox", "EMPTY", "took_by",
           "SyncerLinkLike"]


@dataclass(frozen=True)
class OutgoingPush:
    """One fragment's push as it goes to the syncer: the boundary's step, the anchor version its delta is
    relative to, the steps and tokens since the previous push, and the encoded body with its codec and block;
    `blend`: the island blends merged bases in (the syncer's --outer-lr auto depends on it); `again`: a push
    made before a restart, sent again (the syncer may refuse it as a duplicate)."""
    fragment: int
    base_version: int
    step: int
    steps: int
    tokens: int
    final: bool
    codec: str
    block: int
    blend: bool
    body: object                 # numpy uint8 array (wire.codecs.encode of the fragment's flat delta)
    again: bool = False

    @property
    def key(self) -> Tuple[int, int]:
        return self.fragment, self.base_version

    @property
    def nbytes(self) -> int:
        return int(self.body.nbytes)


def took_by(base) -> Optional[int]:
    """The anchor version of this island's push that the merge which made `base` took (its ``merge`` figures: this
    island's lag in the merge, present only when it pushed: version - 1 - lag); -1 when the merge took none of its
    pushes; None when the base carries no figures (a syncer that restarted, or an older one: unknown)."""
    m = getattr(base, "merge", None)
    if not m:
        return None
    lag = m.get("lag")
    if lag is None:
        return -1
    return int(base.version) - 1 - int(lag)


@dataclass(frozen=True)
class ArrivedBase:
    """A base from the syncer (``wire.values.Base``), when it arrived (monotonic seconds) and which push of this
    island its merge took (``took_by``)."""
    base: object
    took: Optional[int]
    at: float

    @property
    def fragment(self) -> int:
        return int(self.base.fragment)

    @property
    def version(self) -> int:
        return int(self.base.version)


@dataclass(frozen=True)
class Refusal:
    """The syncer refused this island's push of `fragment` relative to `base_version` (``code``: stale,
    duplicate, ...; its reason is logged on both sides)."""
    fragment: int
    base_version: int
    code: str
    message: str = ""


@dataclass(frozen=True)
class Carried:
    """The syncer accepted this island's push of `fragment` relative to `base_version` after its round merged, and
    holds it for the next merge of the fragment (PUSH_REPLY ``carried``): the island need not wait for it."""
    fragment: int
    base_version: int


@dataclass(frozen=True)
class Sent:
    """The push of `fragment` relative to `base_version` went out to the syncer in `ms` milliseconds."""
    fragment: int
    base_version: int
    ms: float


@dataclass(frozen=True)
class Reconnected:
    """A lost link was replaced: the syncer's versions (fragment -> version, the fragments it owns), the pushes
    sent again ((fragment, base_version), in order) and the seconds the link was down."""
    versions: Dict[int, int]
    resent: Tuple[Tuple[int, int], ...]
    seconds: float


@dataclass(frozen=True)
class Inbox:
    """What one poll of the link received, in the order the fragments take it: reconnects, sends, bases,
    refusals."""
    reconnected: Tuple[Reconnected, ...] = ()
    sent: Tuple[Sent, ...] = ()
    bases: Tuple[ArrivedBase, ...] = ()
    refusals: Tuple[Refusal, ...] = ()
    carried: Tuple[Carried, ...] = ()

    def __add__(self, other: "Inbox") -> "Inbox":
        return Inbox(self.reconnected + other.reconnected, self.sent + other.sent, self.bases + other.bases,
                     self.refusals + other.refusals, self.carried + other.carried)


EMPTY = Inbox()


@runtime_checkable
class SyncerLinkLike(Protocol):
    resilient: bool   # after start: a lost link is replaced instead of failing the island

    def open(self):
        """Connect and say hello (start-up; waits for a syncer not up yet); returns the syncer's welcome."""

    def attach(self, fragments) -> None:
        """The island's fragment layout (anything with ``layout`` and ``numels``), once known: a reconnect must
        find the same."""

    def send_push(self, push: OutgoingPush) -> None:
        """Hold `push` (a records.OutgoingPush) until the syncer answers it (a merge that took it, or a refusal)
        and send it; after a lost link it is sent again."""

    def ask_again(self, fragment: int, base_version: int) -> bool:
        """The island is blocked for this push's answer and its round merged without it: send it again (bounded
        rate); True when sent."""

    def unanswered(self) -> list:
        """(fragment, base_version) of the pushes the link holds until the syncer answers them."""

    def send_init(self, f: int, arrays) -> None:
        """Stream fragment f's initial values (an iterator of float32 arrays) to the syncer."""

    def init_requested(self) -> list:
        """Fragments the syncer asked this island to initialize since the last call."""

    @property
    def final_cut(self) -> bool:
        """The syncer began the final cut."""

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` (at most 0.5 s) for the next message from the syncer."""

    def poll(self) -> Inbox:
        """What arrived since the last poll (records.Inbox: reconnects, sends, bases, refusals that answer a push);
        surface other refusals and failures (reconnecting a lost link)."""

    def final_model(self, last_step: int, deadline: float, slice_s: float, drain: bool) -> Optional[dict]:
        """One bounded try at the final model: {fragment: Base}, or None to try again."""

    # liveness and pace (island/link/patience.py, YETO_DILOCO_SYNC_EVERY=auto)
    def stepped(self, step: int) -> None:
        """The island finished optimizer step `step` (heartbeats carry it, with the compute rate)."""

    def resumed(self) -> None:
        """The island's work after its last step ended (the compute rate leaves that work out)."""

    def scheduled(self, sync_every: int, next_boundaries) -> None:
        """The island's H and each fragment's next boundary step (heartbeats carry them)."""

    def started_from(self, pretrained: bool) -> None:
        """Whether the island's run started from pretrained weights (every push says it)."""

    def reachable(self) -> bool:
        """The syncer is connected and was heard from recently (every shard of a sharded syncer)."""

    def waiting_on(self) -> str:
        """What the syncer's last heartbeat says this island's rounds wait for."""

    def pace(self) -> float:
        """The fleet's pace (steps/s) as the syncer's last heartbeat said (0: unknown)."""

    def rate(self) -> float:
        """This island's compute rate (steps/s of training, without the waits; 0: unknown)."""

    @property
    def run_ids(self) -> list:
        """The syncer's run id (each shard's, in shard order), kept in the island's sync state."""

    def close(self, graceful: bool = True) -> None:
        """BYE (after the queued pushes when `graceful`); idempotent."""

    def shutdown_quietly(self) -> None:
        """Close without raising (after a failure)."""

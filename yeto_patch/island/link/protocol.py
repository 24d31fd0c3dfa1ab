"""What island rank 0 needs of its link to the syncer: one contract for one syncer (``syncer.SyncerLink``) and a
sharded one (``sharded.ShardedLink``). ``tests/island/link/test_protocol.py`` checks that both implement every
member with the same signature, so a change to one that the other lacks fails there, not in a run."""
from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable


@runtime_checkable
class SyncerLinkLike(Protocol):
    resilient: bool   # after start: a lost link is replaced instead of failing the island

    def open(self):
        """Connect and say hello (start-up; waits for a syncer not up yet); returns the syncer's welcome."""

    def attach(self, fragments) -> None:
        """The island's fragments (boundary.fragment.Fragments), once the layout is known."""

    def send_push(self, frag) -> None:
        """Queue fragment `frag`'s push (its Push and rank 0's PushWire) for the syncer."""

    def send_init(self, f: int, arrays) -> None:
        """Stream fragment f's initial values (an iterator of float32 arrays) to the syncer."""

    def init_requested(self) -> list:
        """Fragments the syncer asked this island to initialize since the last call."""

    @property
    def final_cut(self) -> bool:
        """The syncer began the final cut."""

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` (at most 0.5 s) for the next message from the syncer."""

    def poll(self) -> None:
        """Move arrived bases into the fragments; surface refusals and failures (reconnecting a lost link)."""

    def final_model(self, last_step: int, deadline: float, slice_s: float, drain: bool) -> Optional[dict]:
        """One bounded try at the final model: {fragment: Base}, or None to try again."""

    # liveness and pace (island/link/patience.py, YETO_DILOCO_SYNC_EVERY=auto)
    def stepped(self, step: int) -> None:
        """The island finished optimizer step `step` (heartbeats carry it, with the compute rate)."""

    def reachable(self) -> bool:
        """The syncer is connected and was heard from recently (every shard of a sharded syncer)."""

    def waiting_on(self) -> str:
        """What the syncer's last heartbeat says this island's rounds wait for."""

    def pace(self) -> float:
        """The fleet's pace (steps/s) as the syncer's last heartbeat said (0: unknown)."""

    def rate(self) -> float:
        """This island's compute rate (steps/s of training, without the waits; 0: unknown)."""

    def catch_up(self, frag, h: int) -> int:
        """Steps to bring fragment `frag`'s next boundary forward by (a round merged without its push)."""

    @property
    def run_ids(self) -> list:
        """The syncer's run id (each shard's, in shard order), kept in the island's sync state."""

    def close(self, graceful: bool = True) -> None:
        """BYE (after the queued pushes when `graceful`); idempotent."""

    def shutdown_quietly(self) -> None:
        """Close without raising (after a failure)."""

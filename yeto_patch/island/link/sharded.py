"""Island rank 0's link to a sharded syncer: one ``SyncerLink`` per shard behind the interface of one
(torch-free).

The shards are listed in YETO_DILOCO_SYNCER in shard order, or shard 0 alone when the shards advertise each
other (``--shard-addresses``: its welcome names them). Each shard owns some fragments (its welcome says which;
together they must cover every fragment exactly once, with one layout): pushes and INITs of a fragment go to its
owner, the bases arrive from it; every shard gets the island's FINAL, and the final model is assembled from all of
them (each shard ends when every island reached its last step, so the cut is global). A lost shard is reconnected
on its own (``SyncerLink.reconnect``) while the others go on. With one shard this is one ``SyncerLink``.
"""
from __future__ import annotations

import logging
import threading
import types
from typing import Callable

from yeto_patch.island.errors import EngineError
from yeto_patch.island.link.syncer import SyncerLink
from yeto_patch.island.records import EMPTY, Inbox, OutgoingPush

log = logging.getLogger("yeto_patch")


class ShardedLink:
    """The link to every shard of the syncer; the same interface as ``SyncerLink``."""

    def __init__(self, settings, wire_manifest, *, start_digests=None, step: Callable[[], int] = lambda: 0, record=None,
                 runs=None):
        self.settings = settings
        self.runs = list(runs or [])   # shard i's run id saved with the sync state this island restarted from
        self._args = dict(start_digests=start_digests, step=step, record=record)
        self.manifest = wire_manifest
        self.arrival = threading.Event()
        self.links: list[SyncerLink] = []
        self.owner: dict[int, SyncerLink] = {}
        self._final: dict = {}     # shard index -> its final bases, once complete

    def _link(self, address) -> SyncerLink:
        i = len(self.links)   # (opened in shard order)
        return SyncerLink(self.settings, self.manifest, address=address, arrival=self.arrival,
                          run_id=self.runs[i] if i < len(self.runs) else None, **self._args)

    # ---------------------------------------------------------------------------------------------- connecting
    def open(self):
        """Connect to every shard (in shard order); returns one welcome for the whole syncer."""
        addresses = self.settings.syncer.split(",")
        try:
            welcomes = [self._open(addresses[0])]
            if len(addresses) == 1 and welcomes[0].shard[1] > 1:
                addresses = self._advertised(welcomes[0])
            for a in addresses[1:]:
                welcomes.append(self._open(a))
            return self._merged(addresses, welcomes)
        except BaseException:
            self.shutdown_quietly()
            raise

    def _open(self, address):
        link = self._link(address)
        self.links.append(link)
        return link.open()

    def _advertised(self, w) -> list:
        if not w.shard_addresses:
            raise EngineError(f"yeto-patch: the syncer at {self.settings.syncer} is shard 0 of {w.shard[1]} and "
                              f"does not know the other shards' addresses: list every shard in YETO_DILOCO_SYNCER "
                              f"(comma-separated, in shard order), or start the shards with --shard-addresses")
        log.info("yeto-patch: the syncer has %d shards: %s", w.shard[1], ", ".join(w.shard_addresses))
        return list(w.shard_addresses)

    def _merged(self, addresses, welcomes):
        """Check that the shards are one syncer (same layout, shard i at position i, fragments owned once each)
        and combine their welcomes."""
        first, n = welcomes[0], len(welcomes)
        owners = {}
        for i, (a, w) in enumerate(zip(addresses, welcomes)):
            if tuple(w.shard) != (i, n):
                raise EngineError(f"yeto-patch: YETO_DILOCO_SYNCER lists {n} syncer address(es) but {a} (position "
                                  f"{i}) is shard {w.shard[0]}/{w.shard[1]}: list every shard once, in shard order")
            if w.layout != first.layout or w.numels != first.numels:
                raise EngineError(f"yeto-patch: syncer shards {addresses[0]} and {a} have different fragment "
                                  f"layouts (start every shard with the same --fragments)")
            for f in w.owned:
                if f in owners:
                    raise EngineError(f"yeto-patch: fragment {f} is owned by two syncer shards ({owners[f]} and {a})")
                owners[f] = a
        missing = sorted(set(range(first.fragments)) - set(owners))
        if missing:
            raise EngineError(f"yeto-patch: no syncer shard owns fragments {missing}")
        self.owner = {f: link for link in self.links for f in link.owned}
        versions = None if any(w.versions is None for w in welcomes) else [
            welcomes[addresses.index(owners[f])].versions[f] for f in range(first.fragments)]
        if n > 1:
            log.info("yeto-patch: joined %d syncer shards: %s", n, "; ".join(
                f"{a} owns fragments {w.owned}" for a, w in zip(addresses, welcomes)))
        return types.SimpleNamespace(layout=first.layout, numels=first.numels, fragments=first.fragments, versions=versions,
                       needs_init=sorted(f for w in welcomes for f in w.needs_init),
                       final=any(w.final for w in welcomes),
                       fixed_roster=all(int(w.quorum) >= int(w.islands) for w in welcomes))

    @property
    def run_ids(self) -> list:
        """Each shard's run id, in shard order (kept in the island's sync state)."""
        return [link.run_id for link in self.links]

    def attach(self, fragments) -> None:
        for link in self.links:
            link.attach(fragments)

    @property
    def resilient(self) -> bool:
        return all(link.resilient for link in self.links)

    @resilient.setter
    def resilient(self, value: bool) -> None:
        for link in self.links:
            link.resilient = value

    # ---------------------------------------------------------------------------------------------- liveness
    def stepped(self, step: int) -> None:
        for link in self.links:
            link.stepped(step)

    def resumed(self) -> None:
        for link in self.links:
            link.resumed()

    def started_from(self, pretrained: bool) -> None:
        for link in self.links:
            link.started_from(pretrained)

    def scheduled(self, sync_every: int, next_boundaries) -> None:
        for link in self.links:
            link.scheduled(sync_every, next_boundaries)

    def reachable(self) -> bool:
        """Every shard is connected and heard from."""
        return all(link.reachable() for link in self.links)

    def waiting_on(self) -> str:
        if len(self.links) == 1:
            return self.links[0].waiting_on()
        return "; ".join(f"shard {i}: {link.waiting_on()}" for i, link in enumerate(self.links))

    def pace(self) -> float:
        return max((link.pace() for link in self.links), default=0.0)

    def rate(self) -> float:
        return self.links[0].rate()

    def aims(self) -> dict:
        """Each shard's fragments' last PUSH_REPLY rhythm (SyncerLink.aims), together."""
        out = {}
        for link in self.links:
            out.update(link.aims())
        return out

    def rhythm(self) -> dict:
        """Each shard's fragments' rhythm (SyncerLink.rhythm), together."""
        out = {}
        for link in self.links:
            out.update(link.rhythm())
        return out

    def opened(self) -> dict:
        """Each shard's open rounds that the rhythm island's push is in (SyncerLink.opened), together."""
        out = {}
        for link in self.links:
            out.update(link.opened())
        return out

    @property
    def clock(self):
        return self.links[0].clock

    # ---------------------------------------------------------------------------------------------- data
    def send_push(self, push: OutgoingPush) -> None:
        self.owner[push.fragment].send_push(push)

    def ask_again(self, fragment: int, base_version: int) -> bool:
        return self.owner[fragment].ask_again(fragment, base_version)

    def unanswered(self) -> list:
        return sorted(k for link in self.links for k in link.unanswered())

    def send_init(self, f: int, arrays) -> None:
        self.owner[f].send_init(f, arrays)

    def init_requested(self) -> list:
        return sorted(f for link in self.links for f in link.init_requested())

    @property
    def final_cut(self) -> bool:
        """A shard began the final cut (--total-rounds): the island ends; every shard gets its FINAL."""
        return any(link.final_cut for link in self.links)

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` (at most 0.5 s) for the next message from any shard."""
        if len(self.links) == 1:
            self.links[0].wait(timeout)
        else:
            self.arrival.wait(max(0.0, min(timeout, 0.5)))

    def poll(self) -> Inbox:
        self.arrival.clear()   # (before polling: whatever arrives after this wakes the next wait)
        out = EMPTY
        for link in self.links:
            out = out + link.poll()
        return out

    def final_model(self, last_step: int, deadline: float, slice_s: float, drain: bool):
        """The final model from every shard ({fragment: Base}), or None to try again; FINAL goes to every shard
        before any is waited for."""
        pending = [i for i in range(len(self.links)) if i not in self._final]
        for k, i in enumerate(pending):
            share = 0.1 if (len(pending) > 1 and k < len(pending) - 1) else slice_s
            got = self.links[i].final_model(last_step, deadline, max(0.1, min(share, slice_s)), drain)
            if got is not None:
                self._final[i] = got
        if len(self._final) < len(self.links):
            return None
        return {f: b for part in self._final.values() for f, b in part.items()}

    # ---------------------------------------------------------------------------------------------- closing
    def close(self, graceful: bool = True) -> None:
        for link in self.links:
            link.close(graceful)

    def shutdown_quietly(self) -> None:
        for link in self.links:
            link.shutdown_quietly()


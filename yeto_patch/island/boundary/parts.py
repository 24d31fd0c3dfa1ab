"""The island's parts, built once at start by the engine and handed to the boundary's components.

Each component (``installs.Installer``, ``driver.Boundaries``) reads the parts it needs through their public
interfaces; none keeps a reference to the engine or reaches into another component. Fields that only island
rank 0 has (the link to the syncer and the boundary log) are None on the other ranks, and code that uses them
runs inside ``channel.rank0`` (a call whose result rank 0 broadcasts) or under ``if parts.rank == 0``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

from yeto_patch.island.keepalive import waiting

if TYPE_CHECKING:   # (the modules below import torch; this one stays light)
    from yeto_patch.island.boundary.base_lane import BaseLane
    from yeto_patch.island.boundary.channel import IslandChannel
    from yeto_patch.island.boundary.fragment import Fragments
    from yeto_patch.island.boundary.fragment_io import FragmentIO
    from yeto_patch.island.boundary.log import BoundaryLog
    from yeto_patch.island.boundary.plan import InstallRule
    from yeto_patch.island.boundary.push_lane import PushLane
    from yeto_patch.island.records import SyncerLinkLike
    from yeto_patch.island.masters.collective import IslandComm
    from yeto_patch.island.masters.view import MasterView


@dataclass
class IslandParts:
    settings: object                    # config.Settings (after the island's auto settings)
    rule: "InstallRule"                 # how and when merged bases go into the masters
    rank: int
    comm: "IslandComm"                  # the training thread's island collectives
    channel: "IslandChannel"            # rank 0's decisions broadcast
    view: "MasterView"
    io: "FragmentIO"                    # fragment values between the masters and the link
    frags: "Fragments"
    pushes: "PushLane"                  # pushes off the training thread
    bases: "BaseLane"                   # merged bases staged off the training thread
    step: Callable[[], int]             # the island's optimizer step count
    total: int                          # the step of the final cut
    link: Optional["SyncerLinkLike"] = None   # rank 0
    log: Optional["BoundaryLog"] = None       # rank 0
    patience: Optional[Callable[[str], object]] = None   # rank 0: a wait's patience (link/patience.Patience) for `what`

    def slice_s(self) -> float:
        """Longest time rank 0 blocks before the island's other ranks hear from it again (they wait in a gloo
        collective whose own timeout is YETO_DILOCO_TIMEOUT + 60 s)."""
        return max(1.0, min(30.0, self.settings.timeout / 4))

    @waiting   # (one wait, however many slices: keep-alive calls while it lasts, island/keepalive.py)
    def await_ready(self, ready: Callable[[], bool], what: str, serve_init: Optional[Callable[[int], None]] = None):
        """Every rank: loop until rank 0's `ready()` is True; the wait fails once the syncer has been unreachable
        for YETO_DILOCO_TIMEOUT (rank 0's ``patience``, built by startup.py) and goes on while the syncer is alive,
        saying every minute what its rounds wait for. With `serve_init` the whole island answers the syncer's INIT
        requests meanwhile (rank 0 logs once what it waits for)."""
        s = self.settings
        source = f"the syncer at {s.syncer}"
        # (rank 0, no collective) the timeout counts only while the syncer is unreachable
        patience = self.patience(what) if self.patience is not None else None
        self.channel.await_ready(ready, what, timeout=s.timeout, slice_s=self.slice_s(),
                                 wait=lambda t: self.link.wait(t), source=source, step=self.step,
                                 requests=(lambda: self.link.init_requested()) if serve_init else None,
                                 serve=serve_init, patience=patience)

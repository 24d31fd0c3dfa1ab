"""An island joins its syncer (every rank, at the first training step): the island's parts, built once.

The ranks build the global manifest and the master view; rank 0 connects, authenticates and says hello with
the manifest (waiting for a syncer not up yet, link/syncer.py); a syncer whose run pads the vocabulary to other
row counts answers with a refusal that names them, and the island builds its manifest again with those rows
(said on every rank); every rank learns the syncer's fragment layout; then the background lanes start (each a
gloo group of its own, created collectively). The engine then sends the INITs the syncer asked for and installs
the initial bases. A syncer that already made its final cut (an island back after the end) is joined all the
same: the island installs the final model at its first step and stops there.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, List

from yeto_patch.island.errors import EngineError

log = logging.getLogger("yeto_patch")


@dataclass
class Joined:
    settings: object          # config.Settings after the island's auto settings
    parts: object             # boundary.parts.IslandParts
    installer: object         # boundary.installs.Installer
    boundaries: object        # boundary.driver.Boundaries
    needs_init: List[int]     # fragments the syncer asked this island to initialize
    fixed_roster: bool        # every round holds one push of every island (--quorum = --islands)


def join(settings, model, optimizer, vocab_size, step: Callable[[], int], total: int, runs=None) -> Joined:
    """Every rank: connect the island to its syncer and build its parts (see the module docstring). `runs`
    (rank 0): the syncer run ids saved with the sync state this island restarts from (a syncer of another run is
    refused)."""
    from yeto_patch.island.boundary.channel import IslandChannel
    from yeto_patch.island.boundary.driver import Boundaries
    from yeto_patch.island.boundary.fragment import Fragments
    from yeto_patch.island.boundary.fragment_io import model_chunks
    from yeto_patch.island.boundary.installs import Installer
    from yeto_patch.island.boundary.parts import IslandParts
    from yeto_patch.island.boundary.plan import InstallRule
    from yeto_patch.island.masters.collective import IslandComm
    chunks = model_chunks(model, optimizer)
    comm = IslandComm(timeout_s=settings.timeout + 60.0)
    channel = IslandChannel(comm)
    boundary_log = None
    if comm.rank == 0:
        from yeto_patch.island.boundary.log import BoundaryLog
        boundary_log = BoundaryLog(settings.metrics_path, settings.island_id)
    settings, view, io, link, welcome = _hello(settings, chunks, optimizer, vocab_size, comm, channel,
                                               boundary_log, step, runs)
    if welcome["final"] and comm.rank == 0:   # (an island back after the end: it takes the final model)
        log.warning("yeto-patch: the syncer at %s has already made its final cut; this island installs the final "
                    "model at its first step and stops there", settings.syncer)
    frags = Fragments(welcome["layout"], welcome["numels"], [e.numel for e in view.manifest.entries],
                      announced=welcome["fragments"], rank0=comm.rank == 0)
    if link is not None:
        link.attach(frags)
    if boundary_log is not None and settings.metrics_port is not None:
        _export(settings, link, boundary_log)
    parts = IslandParts(settings=settings, rule=InstallRule.of(settings), rank=comm.rank, comm=comm,
                        channel=channel, view=view, io=io, frags=frags,
                        pushes=_push_lane(settings, view, io, frags, comm.rank),
                        bases=_base_lane(settings, view, comm.rank), step=step, total=total, link=link,
                        log=boundary_log, patience=_patience(settings, link, step) if link is not None else None)
    installer = Installer(parts)
    return Joined(settings, parts, installer, Boundaries(parts, installer, bool(welcome["final"])),
                  list(welcome["needs_init"]), bool(welcome["fixed_roster"]))


def _export(settings, link, boundary_log) -> None:
    """Rank 0: serve the island's Prometheus metrics (YETO_DILOCO_METRICS_PORT; island/exporter.py), closed with
    the boundary log."""
    from yeto_patch.island.exporter import IslandExporter
    exporter = IslandExporter(settings.island_id, link.reachable if link is not None else None)
    try:
        port = exporter.serve(settings.metrics_port, settings.metrics_addr)
    except OSError as e:
        raise EngineError(f"yeto-patch: YETO_DILOCO_METRICS_PORT={settings.metrics_port}: cannot serve the island's "
                          f"metrics on {settings.metrics_addr}: {e}") from e
    boundary_log.add_sink(exporter.record, close=exporter.close)
    log.info("yeto-patch: island %s metrics on http://%s:%d/metrics", settings.island_id, settings.metrics_addr,
             port)


def _hello(settings, chunks, optimizer, vocab_size, comm, channel, boundary_log, step, runs):
    """Every rank: manifest, master view and fragment I/O; rank 0's link, connected. Returns (settings, view, io,
    link (rank 0), welcome as JSON)."""
    from yeto_patch.island import auto_settings
    from yeto_patch.island.boundary.fragment_io import FragmentIO
    from yeto_patch.island.masters.names import VOCAB_NAMES, build_manifest, vocab_rows_message
    from yeto_patch.island.masters.view import MasterView
    vocab_rows: dict = {}   # every padded row is merged unless the run's manifest has other vocabulary rows
    link = None
    for _ in range(len(VOCAB_NAMES) + 1):
        manifest = build_manifest(chunks, real_vocab_size=vocab_size, vocab_rows=vocab_rows, merge_padding=True,
                                  comm=comm)
        settings = auto_settings.resolve(settings, manifest.total_numel(), comm.rank)
        view = MasterView(chunks, optimizer, manifest, chunk_bytes=settings.chunk_bytes, comm=comm)
        io = FragmentIO(view, manifest, settings, comm.rank)
        declared = io.start_digests() if settings.start_digest else None
        holder: list = []

        def connect():
            link, welcome = _connect(settings, manifest, declared, boundary_log, step, runs)
            holder.append(link)
            return welcome
        welcome = channel.rank0(connect, f"connect to the syncer at {settings.syncer}")
        link = holder[0] if holder else None
        if "vocab_rows" not in welcome:
            return settings, view, io, link, welcome
        for name, rows in welcome["vocab_rows"].items():   # said on every rank
            log.warning("yeto-patch: %s", vocab_rows_message(manifest, name, int(rows)))
            vocab_rows[name] = int(rows)
    raise EngineError(f"the syncer at {settings.syncer} keeps refusing this island's vocabulary rows {vocab_rows}")


def _connect(settings, manifest, declared, boundary_log, step, runs):
    """Rank 0: the link to the syncer, connected (waiting for a syncer not up yet, see link/syncer.py); returns
    (link, welcome as JSON), or (None, {"vocab_rows": ...}) when the run pads the vocabulary otherwise."""
    from yeto_patch.island.link.sharded import ShardedLink
    from yeto_patch.island.masters.builds import explain_refusal
    from yeto_patch.island.masters.names import run_vocab_rows
    from yeto_patch.wire.frames import PeerError
    link = ShardedLink(settings, manifest.wire_manifest(), start_digests=declared, step=step,
                       record=boundary_log.write, runs=runs)
    try:
        w = link.open()
    except PeerError as e:   # the run pads the vocabulary otherwise: connect again with its rows
        rows = run_vocab_rows(e.message, manifest.wire_manifest()) if e.code == "manifest" else None
        if rows is None:   # another build or configuration: say which option aligns the islands
            if e.code == "manifest" and explain_refusal(e.message):
                raise PeerError(e.code, e.message + explain_refusal(e.message)) from e
            raise
        return None, {"vocab_rows": rows}
    return link, dict(layout=w.layout, numels=w.numels, fragments=w.fragments, versions=w.versions,
                      needs_init=list(w.needs_init), final=bool(w.final), fixed_roster=bool(w.fixed_roster))


def _patience(settings, link, step):
    """Rank 0: the patience of a wait for `what` (link/patience.py: the timeout counts only while the syncer is
    unreachable)."""
    from yeto_patch.island.link.patience import Patience
    source = f"the syncer at {settings.syncer}"
    return lambda what: Patience(settings.timeout, link, what, source, step=step)


def _push_lane(settings, view, io, frags, rank: int):
    """Every rank (collective: a gloo group of its own): pushes leave the training thread after a snapshot of the
    rank's own shard (boundary/push_lane.py), with its spare snapshot buffer touched now."""
    from yeto_patch.island.boundary.push_lane import PushLane
    from yeto_patch.island.masters.collective import IslandComm
    lane = PushLane(view, IslandComm(timeout_s=settings.timeout + 60.0), rank,
                    io.push_encoder if rank == 0 else None, settings.timeout)
    lane.reserve(max(view.own_numel(frag.entries) for frag in frags))
    return lane


def _base_lane(settings, view, rank: int):
    """Every rank (collective: a gloo group of its own and its holder groups): bases merged during training are
    staged in the background and installed locally (boundary/base_lane.py)."""
    from yeto_patch.island.boundary.base_lane import BaseLane
    from yeto_patch.island.masters.collective import IslandComm
    return BaseLane(view, IslandComm(timeout_s=settings.timeout + 60.0), rank, settings.timeout)

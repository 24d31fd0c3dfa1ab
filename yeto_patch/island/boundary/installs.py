"""The installs of merged bases into an island's FP32 masters: ONE route during training, one for the rest.

During training (every base merged while the island trains): rank 0's plan hands an arrived base to the
background base lane (``stage``: every rank with a FP32 master of it gets its part on a gloo group of its own,
base_lane.py). A later plan arms it (``arm``: at the push's step + tau for a base answering a push, see
plan.InstallRule), and inside that optimizer step each leaf optimizer's masters take it just before Megatron
casts them into the model params and gathers those to the replicas (``into_leaf``): the training thread's
install is one pass over the rank's own masters. What no such point installed is installed after the step,
params and replicas included (``finish``). A push's answer at the tau bound is staged if it is not already and
installed after the step the same way.

Otherwise (``now``: the start, the final cut, a restart's adoption, a base that is the island's own weights):
rank 0's base is written through the island by ``MasterView.write`` (fragment_io.FragmentIO.install).

Collective order: every method here runs on every rank, in the order rank 0's plan gives, and each runs the same
collectives on every rank whatever the rank holds: ``finish`` agrees once on every rank even when a rank has
nothing left to install, because a rank that skipped the agreement would leave the others waiting in it.
"""
from __future__ import annotations

import logging
import time

from yeto_patch.island.boundary.fragment import BasePhase, Fragment
from yeto_patch.island.boundary.parts import IslandParts
from yeto_patch.island.boundary.plan import BaseSpec

log = logging.getLogger("yeto_patch")


class Installer:
    """The island's installs (see the module docstring); one per engine, on every rank."""
    __slots__ = ("parts", "_copy_error")

    def __init__(self, parts: IslandParts):
        self.parts = parts
        self._copy_error = None   # a failure at an install point inside the step (raised after it)

    # ------------------------------------------------------------------------------------- synchronous
    def now(self, spec: BaseSpec, mode: str, why: str) -> None:
        """Every rank: write the base of `spec` that rank 0 received through the island (mode replace, blend or keep);
        it becomes the anchor; the push it answers (if any) is logged as answered."""
        p = self.parts
        frag = p.frags[spec.fragment]
        t0 = time.perf_counter()
        base = frag.take_arrived(spec.version, spec.updates, spec.own_weights) if p.rank == 0 else None
        p.io.install(frag, base, p.rule.alpha_for(mode), spec.updates, spec.own_weights)
        self._installed(frag, spec.version, mode, why, (time.perf_counter() - t0) * 1000, spec.updates,
                        spec.answers, {})

    def _installed(self, frag: Fragment, version: int, mode: str, why: str, ms: float, updates: int,
                   answers: bool, extra: dict) -> None:
        """Every rank: fragment `frag`'s anchor is base `version` now; rank 0 logs the push it answers (none for a
        newer base that does not answer it: the push waits on). A base blended in (or kept) leaves the local
        progress since the previous push in place: its steps and tokens are still counted for the next push; one
        that replaces the masters starts counting again."""
        wire = frag.side.wire if self.parts.rank == 0 and answers else None
        push = frag.installed(version, keep_counts=mode in ("blend", "keep"), answers=answers)
        if self.parts.rank == 0:
            self.parts.log.installed(self.parts.step(), frag.index, version, mode, why if answers else "newer",
                                     ms, updates, push, wire, **extra)

    # ------------------------------------------------------------------------------------- staged
    def stage(self, spec: BaseSpec) -> None:
        """Every rank: hand fragment `spec.fragment`'s arrived base (rank 0 received it) to the background lane."""
        p = self.parts
        frag = p.frags[spec.fragment]
        sources = alpha = None
        if p.rank == 0:
            base = frag.take_arrived(spec.version, spec.updates, spec.own_weights)
            sources = p.io.base_sources(frag, base, spec.updates)
            alpha = p.rule.alpha_or_none
        frag.stage(spec.version, spec.updates, spec.answers)
        p.bases.submit(frag, spec.version, spec.updates, sources, alpha)

    def arm(self, f: int, why: str) -> None:
        """Every rank: take fragment f's staged base (waiting for this rank's part, normally long ended) for
        installing in this optimizer step."""
        frag = self.parts.frags[f]
        t0 = time.perf_counter()
        job = self.parts.bases.take(f, f"the staged base v{frag.staging.version} of fragment {f}")
        frag.arm(job, why, time.perf_counter() - t0)

    def armed(self) -> list:
        return [frag for frag in self.parts.frags if frag.base_phase is BasePhase.ARMED]

    def into_leaf(self, optimizer) -> None:
        """Inside the optimizer step, before `optimizer` (a leaf) casts its FP32 masters into the model params:
        the armed bases go into its masters (Megatron's cast and parameter gather carry them to the params).
        Never raises inside Megatron's step: a failure is raised on every rank after it (``finish``)."""
        armed = self.armed()
        if not armed:
            return
        t0 = time.perf_counter()
        try:
            for frag in armed:
                self.parts.view.install_masters(frag.staging.job.result, leaf=id(optimizer), params=False)
        except BaseException as e:  # noqa: BLE001 - agreed island-wide after the step
            self._copy_error = self._copy_error or e
        dt = time.perf_counter() - t0
        for frag in armed:
            frag.in_step(dt / len(armed))

    def finish(self) -> None:
        """Every rank, after the optimizer step: install what the step's install points did not (a skipped
        update, an optimizer that never casts, no step hook, or bases armed after the step), with params; one
        agreement (any rank's failure fails every rank with its message); the replicas of what was installed
        after Megatron's parameter gather get the owners' params; then the bookkeeping."""
        armed = self.armed()
        if not armed:
            return
        err, self._copy_error = self._copy_error, None
        view = self.parts.view
        t0 = time.perf_counter()
        late = set()
        try:
            if err is None:
                for frag in armed:
                    if frag.staging.job.result.uninstalled:
                        view.install_masters(frag.staging.job.result, params=True)
                        late.add(frag.index)
        except Exception as e:  # noqa: BLE001 - agreed below
            err = err or e
        order = [frag.index for frag in armed]
        late_any = self.parts.comm.agree_flags(err, [f in late for f in order],
                                               f"install the staged bases of fragments {order}")
        after = [f for f, x in zip(order, late_any) if x]
        if after and view.needs_refresh():
            for frag in armed:
                if frag.index in after:
                    view.refresh_holders(frag.staging.job.result.entries)
        share = (time.perf_counter() - t0) / len(armed)
        for frag in armed:
            self._bookkeep(frag, share, frag.index in after)

    def _bookkeep(self, frag: Fragment, finish_s: float, after_step: bool) -> None:
        st, job = frag.staging, frag.staging.job
        ms = (st.wait_s + st.in_step_s + finish_s) * 1000
        self._installed(frag, st.version, self.parts.rule.mode, st.why, ms, st.updates, st.answers,
                        dict(stage_ms=round((job.work_s or 0.0) * 1000, 2),
                             stage_cpu_ms=round((job.cpu_s or 0.0) * 1000, 2),
                             staged_wait_ms=round(st.wait_s * 1000, 2), staged_bytes=job.nbytes,
                             in_step_ms=round(st.in_step_s * 1000, 2), after_step=after_step))

    def drop_staged(self, what: str) -> None:
        """Every rank (the final cut): bases staged and not installed are dropped; the final model replaces them."""
        self.parts.bases.drop_all(what)
        for frag in self.parts.frags:
            frag.drop_staging()

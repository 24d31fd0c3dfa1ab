"""The engine's installs of merged bases (part of ``engine.Engine``, which coordinates them).

Two ways in. Synchronous (``_install``: the start, the final cut, a restart's adoption, a base that is this
island's own weights): rank 0's base is written through the island by ``MasterView.write``. Staged (every other
base merged during training): rank 0's plan hands an arrived base to the background stage (``_stage``; every
holder gets its part on a gloo group of its own, island/base_stager.py) and a later plan installs it locally on
every rank (``_install_staged``). A push's answer at the tau bound (or at tau = 0) is staged if it is not
already, and installed as soon as every rank's part is there (``_await_answers``).
"""
from __future__ import annotations

import logging
import time

from yeto_patch.island.errors import EngineError

log = logging.getLogger("yeto_patch")


class Installs:
    """Mixed into ``engine.Engine``: uses its settings, fragments, channel, data path, stager and link."""

    def _install_specs(self, frags, what):
        """Every rank: rank 0's {fragment: [version, updates, held]} for installing the bases it holds."""
        from yeto_patch.island.plan import install_spec
        return self.channel.rank0(lambda: {str(f): install_spec(self.frags[f])[1:] for f in frags}, what)

    def _install(self, f, version, mode, why, updates=0, held=False):
        """Every rank: install the base of fragment f held by rank 0 (version `version`); it becomes the
        anchor; the push it answers (if any) is logged as answered."""
        st = self.frags[f]
        t0 = time.perf_counter()
        base = None
        if self.rank == 0:
            base, st.arrived = st.arrived, None
            if base.version != version or (len(base.deltas) if base.relative else 0) != updates \
                    or base.held != held:
                raise EngineError(f"internal: fragment {f} base v{base.version} is not the planned v{version}")
        self.data.install(st, base, mode, updates, held)
        self._installed(st, version, mode, why, (time.perf_counter() - t0) * 1000, updates)

    def _installed(self, st, version, mode, why, ms, updates, **extra):
        """Every rank: fragment st's anchor is base `version` now; the push it answers (if any) is logged."""
        st.installed(version)
        rec, st.pending = st.pending, None
        if self.rank == 0:
            self.log.installed(self.step, st.index, version, mode, why, ms, updates, rec, **extra)

    def _stage(self, f, version, updates):
        """Every rank: hand fragment f's arrived base (held by rank 0, version `version`) to the background stage;
        it is installed at a later plan (``_install_staged``)."""
        st = self.frags[f]
        sources = None
        if self.rank == 0:
            base, st.arrived = st.arrived, None
            if base.version != version or (len(base.deltas) if base.relative else 0) != updates:
                raise EngineError(f"internal: fragment {f} base v{base.version} is not the planned v{version}")
            sources = self.data.base_sources(st, base, updates)
        st.staging = [int(version), int(updates)]
        self.stager.submit(st, version, updates, sources)

    def _install_staged(self, f, mode, why):
        """Every rank: install fragment f's staged base, locally (each rank waits for its own part of the
        staging first, normally long ended); one agreement, so a local failure fails every rank."""
        st = self.frags[f]
        version, updates = st.staging
        t0 = time.perf_counter()
        job = self.stager.take(f, f"the staged base v{version} of fragment {f}")
        t1 = time.perf_counter()
        with self.comm.guard(f"install the staged base v{version} of fragment {f}"):
            self.data.install_staged(job.done, mode)
        st.staging = None
        self._installed(st, version, mode, why, (time.perf_counter() - t0) * 1000, updates,
                        stage_ms=round((job.work_s or 0.0) * 1000, 2), staged_wait_ms=round((t1 - t0) * 1000, 2),
                        staged_bytes=job.nbytes)

    def _await_answers(self, frags, what):
        """Every rank: wait until rank 0 holds a base newer than each pending push's base, then install it."""
        s = self.settings
        mode = "blend" if s.overlap_steps > 0 else "replace"
        need = {f: (self.frags[f].pending["step"] if self.frags[f].pending is not None else self.step)
                for f in frags}
        if self.rank == 0:
            want = {f: self.frags[f].pending["base_version"] for f in frags}
            desc = what or ", ".join(f"the base of fragment {f} newer than v{want[f]} (pushed at step {need[f]})"
                                     for f in frags) + f" [tau={s.overlap_steps}]"
        else:
            want, desc = {}, what or "bases"
        t0 = time.perf_counter()
        if self.rank == 0 and self.pipeline is not None:
            for f in frags:
                if self.pipeline.in_flight(f):
                    log.warning("yeto-patch: step %d: waiting at the tau bound (tau=%d) for fragment %d's push of "
                                "step %d, still in %s", self.step, s.overlap_steps, f, need[f],
                                self.pipeline.behind(f))

        def ready():   # (a push still in the background is sent first: a base may not overtake it)
            self._handover()
            self.stager.check()
            self.link.poll()
            return all(self.frags[f].answered(want[f]) and not (self.pipeline and self.pipeline.in_flight(f))
                       for f in frags)
        self._await(ready, desc)
        waited = (time.perf_counter() - t0) * 1000
        routes = self.channel.rank0(lambda: {str(f): self._answer_route(self.frags[f]) for f in frags},
                                    "answered versions")
        for f in frags:
            if self.rank == 0 and self.frags[f].pending is not None:
                self.frags[f].pending["wait_ms"] = round(waited, 2)
            route, spec = routes[str(f)]
            if route == "install":
                self._install(f, int(spec[0]), mode, why="answer", updates=int(spec[1]), held=bool(spec[2]))
                continue
            if route == "stage":
                self._stage(f, int(spec[0]), int(spec[1]))
            self._install_staged(f, mode, why="answer")

    def _answer_route(self, st):
        """Rank 0: how fragment st's answer is installed: ["staged", []] (already staged), ["stage", [version,
        updates]] (staged now, then installed) or ["install", [version, updates, held]] (synchronously: an
        adoption after a restart, or a base that is this island's own weights)."""
        from yeto_patch.island.plan import install_spec, stageable
        if st.staging is not None:
            return ["staged", []]
        spec = install_spec(st)[1:]
        return ["stage", spec[:2]] if stageable(st) else ["install", spec]

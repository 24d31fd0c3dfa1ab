"""The engine's installs of merged bases (part of ``engine.Engine``, which coordinates them).

Two ways in. Synchronous (``_install``: the start, the final cut, a restart's adoption, a base that is this
island's own weights): rank 0's base is written through the island by ``MasterView.write``. Staged (every other
base merged during training): rank 0's plan hands an arrived base to the background stage (``_stage``; every
rank with a FP32 master of it gets its part on a gloo group of its own, island/boundary/base_lane.py). A later plan,
made before an optimizer step, arms it (``_arm``), and inside that step each leaf optimizer's masters take it
just before Megatron casts them into the model params and gathers those to the replicas
(``before_param_copy``): the training thread's install is one pass over the rank's own masters. What no such
point installed is installed after the step, params and replicas included (``_finish_installs``). A push's
answer at the tau bound (or at tau = 0) is staged if it is not already, and installed after the step as soon as
every rank's part is there (``_await_answers``).
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
        from yeto_patch.island.boundary.plan import install_spec
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
        st.installed(version, keep_counts=mode in ("blend", "keep"))
        rec, st.pending = st.pending, None
        if self.rank == 0:
            self.log.installed(self.step, st.index, version, mode, why, ms, updates, rec, **extra)

    def _stage(self, f, version, updates):
        """Every rank: hand fragment f's arrived base (held by rank 0, version `version`) to the background stage;
        it is installed at a later plan (``_arm`` then the optimizer step's install point)."""
        st = self.frags[f]
        sources = alpha = None
        if self.rank == 0:
            base, st.arrived = st.arrived, None
            if base.version != version or (len(base.deltas) if base.relative else 0) != updates:
                raise EngineError(f"internal: fragment {f} base v{base.version} is not the planned v{version}")
            sources = self.data.base_sources(st, base, updates)
            alpha = self.settings.merge_alpha if self.settings.overlap_steps > 0 else None
        st.staging = [int(version), int(updates)]
        self.stager.submit(st, version, updates, sources, alpha)

    def _arm(self, f, why):
        """Every rank: take fragment f's staged base (waiting for this rank's part of the staging, normally long
        ended) for installing in this optimizer step: inside the step at the leaf optimizers' install points
        (``before_param_copy``), what is left after it (``_finish_installs``)."""
        version = self.frags[f].staging[0]
        t0 = time.perf_counter()
        job = self.stager.take(f, f"the staged base v{version} of fragment {f}")
        self._armed[f] = {"job": job, "why": why, "wait_s": time.perf_counter() - t0, "copy_s": 0.0}

    def before_param_copy(self, optimizer):
        """Inside the optimizer step, before `optimizer` (a leaf) casts its FP32 masters into the model params:
        the armed bases go into its masters (Megatron's cast and parameter gather then carry them to the params).
        Never raises inside Megatron's step: a failure is raised on every rank after it (``_finish_installs``)."""
        if not self._armed or self.failed is not None:
            return
        t0 = time.perf_counter()
        try:
            for a in self._armed.values():
                self.view.install_masters(a["job"].done, leaf=id(optimizer), params=False)
        except BaseException as e:  # noqa: BLE001 - agreed island-wide after the step
            self._copy_error = self._copy_error or e
        dt = time.perf_counter() - t0
        for a in self._armed.values():
            a["copy_s"] += dt / len(self._armed)

    def _finish_installs(self):
        """Every rank, after the optimizer step: install what the step's install points did not (a skipped
        update, an optimizer that never casts, no step hook, or bases armed after the step), with params; one
        agreement (any rank's failure fails every rank with its message); the replicas of what was installed after
        Megatron's parameter gather get the owners' params; then the bookkeeping."""
        if not self._armed:
            return
        armed, self._armed = self._armed, {}
        err, self._copy_error = self._copy_error, None
        t0 = time.perf_counter()
        late = []
        try:
            if err is None:
                for f, a in armed.items():
                    if a["job"].done.pending:
                        self.view.install_masters(a["job"].done, params=True)
                        late.append(f)
        except Exception as e:  # noqa: BLE001 - agreed below
            err = err or e
        order = sorted(armed)
        late_any = self.comm.agree_flags(err, [f in late for f in order],
                                         f"install the staged bases of fragments {order}")
        after = [f for f, x in zip(order, late_any) if x]
        if after and self.view.needs_refresh():
            for f in after:
                self.view.refresh_holders(armed[f]["job"].done.entries)
        finish_s = time.perf_counter() - t0
        mode = "blend" if self.settings.overlap_steps > 0 else "replace"
        for f, a in armed.items():
            st, job = self.frags[f], a["job"]
            version, updates = st.staging
            st.staging = None
            ms = (a["wait_s"] + a["copy_s"] + finish_s / len(armed)) * 1000
            self._installed(st, version, mode, a["why"], ms, updates,
                            stage_ms=round((job.work_s or 0.0) * 1000, 2),
                            stage_cpu_ms=round((job.cpu_s or 0.0) * 1000, 2),
                            staged_wait_ms=round(a["wait_s"] * 1000, 2), staged_bytes=job.nbytes,
                            in_step_ms=round(a["copy_s"] * 1000, 2), after_step=f in after)

    def _install_staged(self, f, why):
        """Every rank, after the optimizer step: install fragment f's staged base at once (masters, params,
        replicas; blended or replacing as it was staged)."""
        self._arm(f, why)
        self._finish_installs()

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
            self._install_staged(f, why="answer")

    def _answer_route(self, st):
        """Rank 0: how fragment st's answer is installed: ["staged", []] (already staged), ["stage", [version,
        updates]] (staged now, then installed) or ["install", [version, updates, held]] (synchronously: an
        adoption after a restart, or a base that is this island's own weights)."""
        from yeto_patch.island.boundary.plan import install_spec, stageable
        if st.staging is not None:
            return ["staged", []]
        spec = install_spec(st)[1:]
        return ["stage", spec[:2]] if stageable(st) else ["install", spec]

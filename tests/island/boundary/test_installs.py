"""Installer on one rank with stand-ins for the view, the base lane, the island's agreement and the log: a staged
base goes in inside the step (only the leaf's masters, params left to Megatron's cast), what the step did not take
goes in after it (params, replicas refreshed), a failure inside the step is raised after it through the agreement,
the boundary record is completed from the push it answered, and a synchronous install checks rank 0's base
against the plan."""
import types

import numpy as np
import pytest

from yeto_patch.island.boundary.fragment import BasePhase, Fragments, PushWire
from yeto_patch.island.boundary.installs import Installer
from yeto_patch.island.boundary.parts import IslandParts
from yeto_patch.island.boundary.plan import BaseSpec, InstallRule
from yeto_patch.island.errors import EngineError
from yeto_patch.wire.values import Base


class Staged:
    def __init__(self, entries, leaves):
        self.entries, self.leaves, self.uninstalled = entries, set(leaves), True


class View:
    def __init__(self, fail_in_step=None):
        self.calls, self.fail_in_step = [], fail_in_step

    def install_masters(self, staged, leaf=None, params=True):
        self.calls.append(("install", tuple(staged.entries), leaf, params))
        if leaf is not None and self.fail_in_step:
            raise RuntimeError(self.fail_in_step)
        if leaf is None or leaf in staged.leaves:
            staged.leaves.discard(leaf)
            staged.uninstalled = bool(staged.leaves) and leaf is not None
        return 1

    def needs_refresh(self):
        return True

    def refresh_holders(self, entries):
        self.calls.append(("refresh", tuple(entries)))


class Lane:
    def __init__(self, leaves):
        self.leaves, self.submitted, self.jobs = leaves, [], {}

    def submit(self, frag, version, updates, sources, alpha):
        self.submitted.append((frag.index, version, updates, len(sources), alpha))
        self.jobs[frag.index] = types.SimpleNamespace(result=Staged(list(frag.entries), self.leaves), work_s=0.01,
                                                      cpu_s=0.005, nbytes=64)

    def take(self, f, what):
        return self.jobs.pop(f)

    def drop_all(self, what):
        self.jobs.clear()


class Comm:
    def agree_flags(self, error, flags, what):
        if error is not None:
            raise EngineError(f"{what}: {error}")
        return list(flags)


class IO:
    def __init__(self):
        self.installs = []

    @staticmethod
    def base_sources(frag, base, updates):
        return [lambda e, off, n: base.values[off:off + n]]

    def install(self, frag, base, alpha, updates, own_weights):
        self.installs.append((frag.index, base.version if base is not None else None, alpha, updates, own_weights))


class Log:
    def __init__(self):
        self.records = []

    def installed(self, step, fragment, version, mode, why, ms, updates, push=None, wire=None, **extra):
        self.records.append(dict(step=step, fragment=fragment, version=version, mode=mode, why=why,
                                 push=push, wire=wire, **extra))


def installer(tau=2, leaves=(11,), fail_in_step=None):
    s = types.SimpleNamespace(overlap_steps=tau, merge_alpha=0.25)
    frags = Fragments([[0], [1]], [4, 4], [4, 4])
    for frag in frags:
        frag.installed(1)
    parts = IslandParts(settings=s, rule=InstallRule.of(s), rank=0, comm=Comm(), channel=None,
                        view=View(fail_in_step), io=IO(), frags=frags, pushes=None, bases=Lane(leaves),
                        step=lambda: 9, total=100, link=None, log=Log())
    return Installer(parts), parts


def arrive(parts, f, version):
    parts.frags[f].side.take_base(Base(f, version, "f32", np.zeros(4, np.float32)))


@pytest.mark.parametrize("tau,alpha", [(2, 0.25), (0, None)])
def test_a_staged_answer_goes_in_inside_the_step_and_completes_its_boundary(tau, alpha):
    inst, parts = installer(tau)
    frag = parts.frags[0]
    frag.begin_push(5)
    frag.push_handed(PushWire(np.zeros(2, np.uint8), "int4", {"bytes": 2}))
    arrive(parts, 0, 2)
    inst.stage(BaseSpec(0, 2))
    assert parts.bases.submitted == [(0, 2, 0, 1, alpha)] and frag.side.arrived is None
    inst.arm(0, "answer")
    assert frag.base_phase is BasePhase.ARMED
    inst.into_leaf(types.SimpleNamespace())     # another leaf optimizer: nothing of ours
    inst.finish()
    assert parts.view.calls[-1] == ("refresh", (0,))   # it went in after the step: replicas refreshed
    (rec,) = parts.log.records
    assert (rec["fragment"], rec["version"], rec["mode"], rec["why"]) == (0, 2, "blend" if tau else "replace",
                                                                         "answer")
    assert rec["push"].step == 5 and rec["wire"].codec == "int4" and rec["after_step"] is True
    assert frag.push is None and frag.staging is None and frag.anchor_version == 2 and frag.side.wire is None


def test_inside_the_step_only_the_leafs_masters_and_no_refresh_when_the_step_took_it_all():
    inst, parts = installer(leaves=(11,))
    arrive(parts, 1, 3)
    inst.stage(BaseSpec(1, 3))
    inst.arm(1, "arrived")
    leaf = types.SimpleNamespace()
    parts.bases.leaves = {id(leaf)}
    parts.frags[1].staging.job.result.leaves = {id(leaf)}
    inst.into_leaf(leaf)
    inst.finish()
    assert parts.view.calls == [("install", (1,), id(leaf), False)]   # Megatron's cast and gather do the rest
    assert parts.log.records[0]["after_step"] is False and parts.log.records[0]["push"] is None


def test_a_failure_inside_the_step_is_raised_after_it_through_the_agreement():
    inst, parts = installer(fail_in_step="device lost")
    arrive(parts, 0, 2)
    inst.stage(BaseSpec(0, 2))
    inst.arm(0, "arrived")
    inst.into_leaf(types.SimpleNamespace())   # never raises inside Megatron's step
    with pytest.raises(EngineError, match="install the staged bases of fragments \\[0\\]: device lost"):
        inst.finish()


def test_a_synchronous_install_checks_rank_0s_base_against_the_plan():
    inst, parts = installer()
    arrive(parts, 0, 4)
    with pytest.raises(EngineError, match="not the planned v5"):
        inst.now(BaseSpec(0, 5), "replace", "start")
    arrive(parts, 1, 4)
    inst.now(BaseSpec(1, 4), "keep", "resume")
    assert parts.io.installs == [(1, 4, 1.0, 0, False)] and parts.frags[1].anchor_version == 4


def test_the_final_cut_drops_what_is_staged():
    inst, parts = installer()
    arrive(parts, 0, 2)
    inst.stage(BaseSpec(0, 2))
    inst.drop_staged("the final cut")
    assert parts.frags[0].staging is None and parts.bases.jobs == {}

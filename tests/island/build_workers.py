"""Functions run on every rank of a pool by tests/island/test_build_names.py: a real local-spec megatron-core model
and its Transformer Engine-named twin (tests/island/te_twin.py) give the same manifest and layouts."""
from __future__ import annotations

import json
import os

import numpy as np
import torch.distributed as dist

from tests.island import te_twin
from tests.island.workers import _wire
from tests.mcore import harness
from yeto_patch.island import IslandComm, MasterView, build_manifest, collect_arrays


def _layouts(man) -> dict:
    return {lp.name: [lp.partition_dim, lp.stride, lp.nshards, lp.shard, list(lp.full_shape)] for lp in man.local}


def twin_manifests(cfg_kwargs, release):
    """The manifest and this rank's layouts of a local-spec model, then of the same model renamed as the TE spec
    of `release` names it."""
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    comm = IslandComm(timeout_s=60)
    local = build_manifest(ctx["model"], comm=comm)
    before = _layouts(local)
    moved = te_twin.make_twin(ctx["model"], release)
    twin = build_manifest(ctx["model"], comm=comm)
    names = sorted(n for c in ctx["model"] for n, _ in harness.unwrap(c).named_parameters())
    return dict(local=_wire(local), twin=_wire(twin), layouts_local=before, layouts_twin=_layouts(twin),
                moved=moved, param_names=names, mapped=[[a, b, n] for (a, b), n in sorted(twin.mapped.items())])


def save_twin(cfg_kwargs, path, release, steps=3):
    """Train a few steps, rename the model as the TE spec of `release` would, and save its full model by global
    names (read through yeto-patch's master view) with the loss it evaluates to; `differ`: the tensors whose full
    value read from the twin is not the one read from the model before renaming."""
    ctx = harness.build(harness.RunCfg(**cfg_kwargs))
    harness.train_steps(ctx, steps)
    comm = IslandComm(timeout_s=60)
    local = collect_arrays(MasterView(ctx["model"], ctx["optimizer"], build_manifest(ctx["model"], comm=comm),
                                      chunk_bytes=1 << 14, comm=comm))
    te_twin.make_twin(ctx["model"], release)
    man = build_manifest(ctx["model"], comm=comm)
    view = MasterView(ctx["model"], ctx["optimizer"], man, chunk_bytes=1 << 14, comm=comm)
    full = collect_arrays(view)
    ev = harness.eval_loss(ctx)
    differ = None
    if dist.get_rank() == 0:   # the twin's full tensors are the local spec's, element for element
        differ = [man.entries[e].name for e in full if not np.array_equal(full[e], local[e])]
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        for e, a in full.items():
            np.save(os.path.join(path, f"{e}.npy"), a, allow_pickle=False)
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(_wire(man), f)
    return dict(eval=ev, differ=differ)

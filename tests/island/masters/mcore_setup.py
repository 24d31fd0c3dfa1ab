"""Shared set-up of the masters tests' workers: a real megatron-core island on every rank of a pool, with its
manifest and master view (test-only)."""
from __future__ import annotations

from tests.mcore import harness
from yeto_patch.island import IslandComm, MasterView, build_manifest


def _setup(cfg_kwargs, steps=2, real_vocab=None, chunk_bytes=1 << 16):
    cfg = harness.RunCfg(**cfg_kwargs)
    ctx = harness.build(cfg)
    if steps:
        ctx["losses"] = harness.train_steps(ctx, steps)
    comm = IslandComm(timeout_s=60)
    man = build_manifest(ctx["model"], real_vocab_size=real_vocab, comm=comm)
    view = MasterView(ctx["model"], ctx["optimizer"], man, chunk_bytes=chunk_bytes, comm=comm)
    return ctx, man, view


def _wire(man):
    return [[n, list(s), d] for n, s, d in man.wire_manifest()]

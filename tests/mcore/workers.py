"""Functions run on every rank of a pool by tests/mcore/test_harness.py."""
import torch
import torch.distributed as dist

from tests.mcore import harness


def train_then_hook_then_train(cfg_kwargs: dict, steps_before: int, steps_after: int) -> dict:
    cfg = harness.RunCfg(**cfg_kwargs)
    ctx = harness.build(cfg)
    before = harness.train_steps(ctx, steps_before)
    opt = ctx["optimizer"]
    inner = [type(o).__name__ for o in harness.dist_optimizers(opt)]
    # hook: what a boundary would see between steps
    n_local = sum(p.numel() for c in ctx["model"] for p in c.parameters())
    after = harness.train_steps(ctx, steps_after)
    return dict(losses=before + after, optimizer=type(opt).__name__, inner=inner, n_local=n_local,
                info=harness.rank_info(), dtype=str(next(ctx["model"][0].parameters()).dtype))


def fail_on_rank(rank: int, message: str):
    if dist.get_rank() == rank:
        raise ValueError(message)
    return dist.get_rank()


def hang_on_rank(rank: int):
    if dist.get_rank() != rank:
        t = torch.zeros(1)
        dist.all_reduce(t)  # the other rank never joins
    return dist.get_rank()

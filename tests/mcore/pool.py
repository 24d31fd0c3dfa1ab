"""A pool of N spawned gloo worker processes that stays up for a whole test module (test-only).

Start-up of a megatron-core rank costs ~5-15 s (imports, process group), so a module starts one pool and runs
every configuration inside it:

    pool = WorkerPool(4)
    per_rank = pool.run("tests.island.masters.test_view_mcore:read_vs_reference", cfg, timeout=120)

`run` calls the named function ``module:function`` with the same arguments on every rank (after
``torch.distributed`` is initialised over gloo and the CPU patches are applied), returns the per-rank results
(index = global rank) and raises `TaskError` carrying the first failing rank's traceback. Every task has a
timeout: a task that does not finish on every rank in time (a hang in a collective, a dead process) kills the
pool's processes and raises `TaskTimeout`; the next `run` starts a fresh pool, so a hang never stalls the test
run. Between tasks each rank calls megatron's ``destroy_model_parallel()`` and clears megatron's global MoE
trackers. Arguments and results travel over multiprocessing pipes (test-only; the product never pickles).
"""
from __future__ import annotations

import dataclasses
import os
import sys
import time
import traceback
from multiprocessing.connection import wait as mp_wait
from typing import Any, List, Optional

from tests.ports import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TaskError(RuntimeError):
    """A task raised on at least one rank. `errors` maps rank -> formatted traceback."""

    def __init__(self, spec, errors: dict, results: list):
        self.spec, self.errors, self.results = spec, errors, results
        rank = min(errors)
        super().__init__(f"{spec} failed on rank(s) {sorted(errors)}; rank {rank}:\n{errors[rank]}")


class TaskTimeout(TimeoutError):
    pass


@dataclasses.dataclass
class RankError:
    """Returned in place of a result by ``run(..., return_errors=True)`` for a rank that raised."""
    rank: int
    type_name: str
    message: str
    traceback: str


def _resolve(spec: str):
    import importlib
    mod, _, fn = spec.partition(":")
    if not fn:
        raise ValueError(f"task spec must be 'module:function', got {spec!r}")
    obj = importlib.import_module(mod)
    for part in fn.split("."):
        obj = getattr(obj, part)
    return obj


def _cleanup_megatron():
    try:
        from megatron.core import parallel_state as ps
        ps.destroy_model_parallel()
    except Exception:
        pass
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        get_moe_layer_wise_logging_tracker().clear()
    except Exception:
        pass
    try:  # global microbatch calculator (set by some megatron.training paths)
        from megatron.core import num_microbatches_calculator as nmc
        nmc.destroy_num_microbatches_calculator()
    except Exception:
        pass
    _destroy_side_groups()
    import gc
    gc.collect()


def _destroy_side_groups():
    """Destroy every process group but the default one: megatron's destroy_model_parallel() and a task's own
    IslandComm only drop their references, so without this each task's gloo groups (threads, sockets) stay alive
    in torch's registry and a long-lived worker gathers thousands of them. Every rank does this between tasks, so
    no peer still uses a group being closed."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        if not dist.is_initialized():
            return
        for pg in list(c10d._world.pg_map):
            if pg is not c10d.GroupMember.WORLD:
                dist.destroy_process_group(pg)
    except Exception as e:  # never fail a task's clean-up; the next task starts with the groups it makes
        print(f"pool: could not destroy process groups: {type(e).__name__}: {e}", file=sys.stderr)


def _worker_main(rank: int, world: int, port: int, conn, pg_timeout_s: float, env: dict):
    # spawned child: make the repository importable whatever pytest's import mode is
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import datetime
    import warnings
    warnings.filterwarnings("ignore")
    try:
        import torch
        torch.set_num_threads(1)
        from tests.mcore import cpu_patches
        cpu_patches.apply()
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        conn.send(("ready", None))
    except BaseException:
        conn.send(("fatal", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            # leave at once: tearing down gloo waits for peers, and the process is going away anyway
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        task_id, spec, args, kwargs = msg
        try:
            out = ("ok", _resolve(spec)(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - reported to the test process
            out = ("err", (type(e).__name__, str(e), traceback.format_exc()))
        finally:
            _cleanup_megatron()
        try:
            conn.send((task_id,) + out)
        except Exception:  # unpicklable result
            conn.send((task_id, "err", ("PicklingError", "result not picklable", traceback.format_exc())))


class WorkerPool:
    """N spawned ranks joined by one gloo process group; see the module docstring."""

    def __init__(self, world: int = 4, *, start_timeout: float = 600.0, task_timeout: float = 300.0,
                 pg_timeout_s: float = 120.0, env: Optional[dict] = None):
        self.world = world
        self.start_timeout = start_timeout
        self.task_timeout = task_timeout
        self.pg_timeout_s = pg_timeout_s
        self.env = dict(env or {})
        self._procs: list = []
        self._conns: list = []
        self._task = 0
        self.starts = 0

    # -- lifecycle ---------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self):
        import multiprocessing as mp
        self.close()
        ctx = mp.get_context("spawn")
        port = free_port()
        self._procs, self._conns = [], []
        for r in range(self.world):
            parent, child = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_worker_main, args=(r, self.world, port, child, self.pg_timeout_s, self.env),
                            name=f"mcore-pool-rank{r}", daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self.starts += 1
        replies = self._collect(None, self.start_timeout, "pool start-up")
        bad = {r: v for r, v in enumerate(replies) if v[0] != "ready"}
        if bad:
            self.kill()
            raise RuntimeError("pool start-up failed:\n" + "\n".join(f"rank {r}: {v[1]}" for r, v in bad.items()))

    def kill(self):
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def close(self):
        if not self._procs:
            return
        for c, p in zip(self._conns, self._procs):
            if p.is_alive():
                try:
                    c.send(None)
                except Exception:
                    pass
        deadline = time.time() + 5
        for p in self._procs:
            p.join(timeout=max(0.1, deadline - time.time()))
        self.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- tasks ---------------------------------------------------------------------------------------------
    def _collect(self, task_id, timeout: float, what: str, grace: float = 20.0) -> list:
        """Wait for one message per rank. After the first error, the other ranks get `grace` seconds."""
        out: List[Any] = [None] * self.world
        pending = set(range(self.world))
        deadline = time.time() + timeout
        first_err_at = None
        while pending:
            now = time.time()
            limit = deadline if first_err_at is None else min(deadline, first_err_at + grace)
            if now >= limit:
                break
            conns = {self._conns[r]: r for r in pending}
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = mp_wait(list(conns) + list(sentinels), timeout=limit - now)
            for obj in ready:
                if obj in conns:
                    r = conns[obj]
                    try:
                        msg = obj.recv()
                    except EOFError:
                        continue  # the sentinel reports the death
                    if task_id is not None:
                        if msg[0] != task_id:
                            continue  # stale reply of an earlier task
                        msg = msg[1:]
                    out[r] = msg
                    pending.discard(r)
                    if msg[0] not in ("ok", "ready") and first_err_at is None:
                        first_err_at = time.time()
                elif obj in sentinels:
                    r = sentinels[obj]
                    if r in pending and not self._conns[r].poll():
                        out[r] = ("dead", f"rank {r} process exited with code {self._procs[r].exitcode}")
                        pending.discard(r)
                        if first_err_at is None:
                            first_err_at = time.time()
        if pending:
            errs = {r: out[r] for r in range(self.world) if out[r] is not None and out[r][0] != "ok"}
            self.kill()
            detail = "".join(f"\n--- rank {r} ---\n{_fmt(v)}" for r, v in sorted(errs.items()))
            raise TaskTimeout(f"{what}: rank(s) {sorted(pending)} did not finish within "
                              f"{timeout if first_err_at is None else grace:.0f} s; pool killed{detail}")
        return out

    def run(self, spec: str, *args, timeout: Optional[float] = None, return_errors: bool = False, **kwargs):
        """Run ``spec`` ("module:function") with args on every rank; returns [result of rank 0, ...]."""
        if not self.alive:
            self.start()
        self._task += 1
        tid = self._task
        for c in self._conns:
            c.send((tid, spec, args, kwargs))
        replies = self._collect(tid, timeout or self.task_timeout, spec)
        results, errors = [], {}
        for r, (status, payload) in enumerate(replies):
            if status == "ok":
                results.append(payload)
            elif status == "err":
                t, m, tb = payload
                errors[r] = tb
                results.append(RankError(r, t, m, tb))
            else:  # dead process
                errors[r] = payload
                results.append(RankError(r, "ProcessDied", payload, payload))
        if any(s == "dead" for s, _ in replies):
            self.kill()
        if errors and not return_errors:
            raise TaskError(spec, errors, results)
        return results


def _fmt(v):
    status, payload = v
    if status == "err":
        return payload[2]
    return str(payload)

"""Host (gloo) collectives for an island: every call has a timeout, every rank learns every error.

An island may train with NCCL; the sync never touches it. `IslandComm` builds a gloo mirror of the island's
ranks (and, on request, of sub-groups such as Megatron's data-parallel groups) so that everything the sync
sends lives in host memory.

Error rule: operations that all ranks run together end with `agree(error)`: if any rank failed, every rank
raises `IslandError` carrying the first failing rank's original message. Between two agreement points a failing
rank keeps taking part in the planned transfers (sending zeros), so no peer is left waiting in a collective.
A peer that dies or hangs is caught by the gloo timeout (`timeout_s`), raised as `IslandError` naming the call.

Plans travel as JSON (never pickle): `broadcast_plan(obj)` from rank 0.
"""
from __future__ import annotations

import contextlib
import datetime
import json
from typing import Iterable, Optional, Sequence

import torch
import torch.distributed as dist

# the engine passes YETO_DILOCO_TIMEOUT (+60 s); this default serves tests and benchmarks that build one directly
DEFAULT_TIMEOUT_S = 300.0
_MAX_PLAN_BYTES = 64 << 20


class IslandError(RuntimeError):
    """An island-wide failure, raised on every rank with the original rank's message."""

    def __init__(self, message: str, rank: Optional[int] = None):
        self.origin_rank = rank
        super().__init__(message)


class IslandComm:
    """Gloo mirrors of an island's process groups, with timeouts and island-wide error agreement."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, group=None):
        if not dist.is_initialized():
            raise IslandError("torch.distributed is not initialised: the island sync needs the training's "
                              "process group (start the job with torchrun or Megatron's launcher)")
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        # the island's own gloo mirror of the default group (training may use NCCL); `group`: reuse a gloo group
        # spanning every rank (e.g. one IslandComm's group for a second view)
        self.group = group if group is not None else dist.new_group(backend="gloo", timeout=self._timeout)
        self._subgroups: dict = {}

    # -- groups ------------------------------------------------------------------------------------------
    def subgroups(self, rank_sets: Iterable[Sequence[int]]) -> None:
        """Create gloo groups for `rank_sets` (collective: every rank passes the same sets in the same order)."""
        for ranks in sorted({tuple(sorted(s)) for s in rank_sets}):
            if len(ranks) > 1 and ranks not in self._subgroups:
                self._subgroups[ranks] = dist.new_group(ranks=list(ranks), backend="gloo", timeout=self._timeout)

    def subgroup(self, ranks: Sequence[int]):
        ranks = tuple(sorted(ranks))
        if len(ranks) == 1:
            return None
        if ranks not in self._subgroups:
            raise IslandError(f"internal: gloo group for ranks {list(ranks)} was not created at set-up")
        return self._subgroups[ranks]

    # -- small collectives ------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _named(self, what: str):
        try:
            yield
        except IslandError:
            raise
        except Exception as e:  # gloo timeouts and closed connections
            raise IslandError(f"island collective '{what}' failed on rank {self.rank} "
                              f"(timeout {self.timeout_s:.0f} s): {type(e).__name__}: {e}", self.rank) from e

    def barrier(self, what: str = "barrier"):
        with self._named(what):
            t = torch.zeros(1)
            dist.all_reduce(t, group=self.group)

    def broadcast_bytes(self, data: Optional[bytes], src: int = 0, what: str = "broadcast") -> bytes:
        with self._named(what):
            n = torch.zeros(1, dtype=torch.int64)
            if self.rank == src:
                n[0] = len(data)
            dist.broadcast(n, src=src, group=self.group)
            size = int(n[0])
            if size > _MAX_PLAN_BYTES:
                raise IslandError(f"{what}: {size} bytes exceed the plan limit")
            buf = torch.empty(size, dtype=torch.uint8)
            if self.rank == src:
                buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            if size:
                dist.broadcast(buf, src=src, group=self.group)
            return bytes(buf.numpy().tobytes())

    def broadcast_plan(self, obj=None, src: int = 0, what: str = "plan"):
        """Rank `src` sends a JSON-serialisable object; every rank returns it (decoded from JSON)."""
        data = json.dumps(obj, separators=(",", ":"), sort_keys=True).encode() if self.rank == src else None
        return json.loads(self.broadcast_bytes(data, src, what).decode())

    def all_gather_bytes(self, data: bytes, what: str = "all_gather") -> list:
        with self._named(what):
            n = torch.tensor([len(data)], dtype=torch.int64)
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
            dist.all_gather(sizes, n, group=self.group)
            sizes = [int(s[0]) for s in sizes]
            m = max(sizes)
            buf = torch.zeros(m, dtype=torch.uint8)
            if data:
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            outs = [torch.empty(m, dtype=torch.uint8) for _ in range(self.world)]
            dist.all_gather(outs, buf, group=self.group)
            return [bytes(o[:s].numpy().tobytes()) for o, s in zip(outs, sizes)]

    def all_gather_json(self, obj, what: str = "all_gather_json") -> list:
        return [json.loads(b.decode()) for b in
                self.all_gather_bytes(json.dumps(obj, separators=(",", ":")).encode(), what)]

    def agree(self, error=None, what: str = "agreement") -> None:
        """Every rank calls this at the same point. If any rank passes an error (exception or message), every
        rank raises IslandError with the message of the lowest failing rank."""
        with self._named(what):
            flag = torch.tensor([self.rank if error is not None else self.world], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
            src = int(flag[0])
        if src == self.world:
            return
        msg = None
        if self.rank == src:
            msg = _message(error)
        msg = self.broadcast_bytes(msg.encode() if msg is not None else None, src, what + " (error)").decode()
        if "[island rank " not in msg:
            msg = f"{msg} [island rank {src}]"
        raise IslandError(msg, src) from (error if isinstance(error, BaseException) else None)

    def agree_flags(self, error, flags, what: str = "agreement") -> list:
        """``agree`` and an island-wide OR of small non-negative integers in one all-reduce: every rank passes the
        same number of `flags`; returns their maxima over the ranks, or raises IslandError on every rank with
        the message of the lowest rank that passed an error."""
        with self._named(what):
            t = torch.tensor([self.world - self.rank if error is not None else 0] + [int(x) for x in flags],
                             dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if int(t[0]) == 0:
            return [int(x) for x in t[1:]]
        src = self.world - int(t[0])
        msg = self.broadcast_bytes(_message(error).encode() if self.rank == src else None, src,
                                   what + " (error)").decode()
        if "[island rank " not in msg:
            msg = f"{msg} [island rank {src}]"
        raise IslandError(msg, src) from (error if isinstance(error, BaseException) else None)

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run the body on this rank; then agree: any rank's exception is raised on every rank."""
        err = None
        try:
            yield
        except IslandError:
            raise
        except Exception as e:  # noqa: BLE001 - re-raised island-wide below
            err = e
        self.agree(err, what)

    # -- point to point / group transfers (host tensors) ---------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int):
        return dist.isend(t, dst=dst, group=self.group)

    def irecv(self, t: torch.Tensor, src: int):
        return dist.irecv(t, src=src, group=self.group)

    def wait_all(self, works, what: str):
        with self._named(what):
            for w in works:
                w.wait(self._timeout)

    def broadcast(self, t: torch.Tensor, src: int, ranks: Sequence[int], async_op: bool = False):
        g = self.subgroup(ranks)
        if g is None:
            return None
        return dist.broadcast(t, src=src, group=g, async_op=async_op)


def _message(error) -> str:
    if isinstance(error, IslandError):
        return str(error)
    if isinstance(error, BaseException):
        text = str(error)
        return f"{type(error).__name__}: {text}" if text else type(error).__name__
    return str(error)

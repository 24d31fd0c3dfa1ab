"""Starting the shards of a sharded syncer: as one torchrun job (``--shard torchrun``) or as plain processes
(``--shard I/N``).

Under torchrun each process is one shard: RANK and WORLD_SIZE give its index and the shard count; with several
shards per host each listens on the ``--listen`` port plus its LOCAL_RANK (and serves metrics on
``--metrics-port`` plus LOCAL_RANK). The shards agree on the run through the launcher's rendezvous store: each
publishes the address islands reach it at (``--advertise-host``, default this host's name when listening on a
wildcard address) and reads everyone's, so shard 0 tells islands the others in its welcome
(``--shard-addresses`` does the same for plain processes); the run id is torchrun's (``--rdzv-id``) unless
``--run-id`` says otherwise. ``{shard}`` in ``--checkpoint``, ``--tape`` and ``--log`` is replaced by the shard
index in both modes, so every shard can be started with the same flags.
"""
from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Mapping, Optional

from .spec import MAX_SHARDS, ShardSpec

__all__ = ["TORCHRUN", "torchrun_shard", "with_port_offset", "shard_path", "advertised_host", "exchange_addresses"]

TORCHRUN = "torchrun"


def _env_int(env: Mapping, name: str) -> int:
    raw = env.get(name)
    try:
        return int(str(raw))
    except ValueError:
        raise ValueError(f"--shard torchrun needs torchrun's {name} (got {raw!r}): start the shards with "
                         f"`torchrun --nnodes N --nproc-per-node K -m yeto_patch.syncer --shard torchrun ...`, "
                         f"or start plain processes with --shard I/N") from None


def torchrun_shard(env: Mapping = os.environ) -> tuple[ShardSpec, int]:
    """(this process's shard, its LOCAL_RANK) from torchrun's environment."""
    rank, world = _env_int(env, "RANK"), _env_int(env, "WORLD_SIZE")
    local = _env_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
    if not 1 <= world <= MAX_SHARDS or not 0 <= rank < world or not 0 <= local <= rank:
        raise ValueError(f"torchrun's RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} do not describe a shard")
    return ShardSpec(rank, world), local


def with_port_offset(address: str, offset: int) -> str:
    """'host:port' -> 'host:(port + offset)'; a port of 0 cannot be offset (the shards must be findable)."""
    host, _, port = address.rpartition(":")
    p = int(port)
    if offset and p == 0:
        raise ValueError("--shard torchrun needs a fixed --listen port (each shard listens on it plus its "
                         "LOCAL_RANK), not 0")
    if not 1 <= p + offset <= 65535 and p:
        raise ValueError(f"--listen port {p} + LOCAL_RANK {offset} is out of range")
    return f"{host}:{p + offset}"


def shard_path(path: Optional[str], spec: ShardSpec) -> Optional[str]:
    return None if path is None else path.replace("{shard}", str(spec.index))


def advertised_host(listen: str, advertise: Optional[str]) -> str:
    """The host islands reach this shard at: --advertise-host, else the --listen host unless it is a wildcard,
    else this machine's fully qualified name."""
    if advertise:
        return advertise
    host = listen.rpartition(":")[0].strip("[]")
    return socket.getfqdn() if host in ("", "0.0.0.0", "::") else host


def exchange_addresses(spec: ShardSpec, mine: str, env: Mapping = os.environ, timeout_s: float = 300.0,
                       store=None) -> tuple:
    """Publish this shard's address in torchrun's rendezvous store and read every shard's (shard order).
    `store`: a torch.distributed Store (default: a client of torchrun's at MASTER_ADDR:MASTER_PORT)."""
    if store is None:
        from torch.distributed import TCPStore
        store = TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), _env_int(env, "MASTER_PORT"), is_master=False,
                         timeout=timedelta(seconds=timeout_s), use_libuv=True)
    prefix = f"yeto-syncer/{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    store.set(f"{prefix}/address/{spec.index}", mine.encode())
    keys = [f"{prefix}/address/{i}" for i in range(spec.count)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - the store says little; this names what is missing
        raise RuntimeError(f"shard {spec}: the other shards did not publish their addresses within "
                           f"{timeout_s:.0f}s ({type(e).__name__}: {e})") from e
    return tuple(store.get(k).decode() for k in keys)

"""The syncer server's configuration (built by :mod:`.cli` from its flags)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .rounds.settings import MergeSettings, RoundSettings
from .shards.spec import ShardSpec

__all__ = ["ServerConfig"]


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:7640"
    islands: int = 1
    fragments: int = 1
    key: Optional[bytes] = None
    insecure: bool = False
    encrypt: bool = False   # frames after the handshake encrypted too (AES-256-GCM), not only authenticated
    island_keys: Optional[dict] = None   # island id -> its own key (--island-keys); others use the shared key
    merge: MergeSettings = field(default_factory=MergeSettings)
    rounds: RoundSettings = field(default_factory=RoundSettings)
    base_wire: str = "f32"
    checkpoint: Optional[str] = None
    checkpoint_every: int = 0
    background_checkpoint: bool = False
    resume: bool = False
    metrics_port: Optional[int] = None
    metrics_addr: str = "127.0.0.1"   # --metrics-addr: loopback unless told otherwise
    tape: Optional[str] = None
    merge_threads: Optional[int] = None
    heartbeat_s: Optional[float] = None  # default lease / 4
    io_timeout_s: float = 120.0
    handshake_timeout_s: float = 30.0
    final_ack_timeout_s: float = 60.0
    max_handshakes: int = 64   # connections not yet authenticated held at once (more are closed at once) ...
    max_handshakes_per_host: int = 16   # ... and from one address
    max_model_bytes: int = 0   # float32 size of the largest model a first manifest may fix (0: limits.py default)
    island_buffer_bytes: int = 0   # unfinished chunked messages one island may hold (0: one push + 2 MiB)
    init_timeout_s: Optional[float] = None   # INIT progress bound of the initializing island (None: lease + io)
    initializer: str = "lowest-id"   # --initializer: lowest-id, first or an island id (syncer/model/initializer.py)
    init_wait_s: float = 300.0   # --init-wait: lowest-id waits this long after the first join for the roster
    max_push_norm_ratio: float = 10.0   # refuse pushes above this x the other islands' recent pushes (0: off)
    first_push_growth: float = 2.0   # before any other island pushed: applied alone, at most this x the base norm
    shard: ShardSpec = ShardSpec()   # --shard I/N: this process holds shard I of N of the fragments
    shard_addresses: tuple = ()   # --shard-addresses: every shard's host:port in shard order (told to islands)
    run_id: Optional[str] = None   # --run-id: ties the shards' checkpoints together

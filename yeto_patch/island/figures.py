"""The island's boundary figures in the launcher's own TensorBoard and W&B, beside the loss.

The figures are the boundary log's records (``boundary/log.py``), written by island rank 0; the writers are the
ones the launcher opened (Megatron-LM, Megatron-Bridge and ms-swift all open theirs on the LAST rank of the job;
the hooks find them, ``yeto_patch.hooks``). Nothing is opened, installed or imported here: no writer, no
figures. ``YETO_DILOCO_FIGURES=0`` turns them off.

- ``scalars(record)``: (iteration, {"yeto/<figure>": value}) of one record: the push's bytes, the delta's norm,
  the base version it was pushed against, the pull lag (steps from push to install), the waits of the training
  thread, and, from the syncer's merge that made a base (sent with the base): the island's staleness (versions
  its push was behind), its merge weight, the outer learning rate and the outer gradient's norm.
- ``Writers``: the launcher's writers: a TensorBoard ``SummaryWriter`` (``add_scalar(tag, value, step)``) or the
  ``wandb`` module / a W&B run (``log``; the figures are plotted against ``yeto/iteration`` through
  ``define_metric``, so they never move W&B's own step, which the launcher owns).
- ``Relay`` (one per process, owned by the hooks' runtime): the rank with a writer registers as the consumer in
  the job's key-value store (the launcher's rendezvous store, as ``start_agreement`` uses it) before the island
  starts; rank 0 then publishes each record there (or hands it over directly when it holds the writer itself),
  and the consumer writes what arrived at its next training step, and everything up to the final cut before the
  loop saves and stops. One store read per training step on the consumer; two small writes per record on
  rank 0. A writer that fails is dropped with one warning; training never fails because of a figure.
"""
from __future__ import annotations

import datetime
import json
import logging
import math
import threading
from typing import Callable, Dict, Iterable, List, Optional, Tuple

log = logging.getLogger("yeto_patch")

PREFIX = "yeto/"
# event -> (record field, figure name); the iteration is the record's "step" (a boundary record's: its push)
FIGURES: Dict[str, Tuple[Tuple[str, str], ...]] = {
    "boundary": (("bytes", "push_bytes"), ("delta_norm", "delta_norm"), ("base_version", "base_version"),
                 ("version", "version"), ("pull_lag", "pull_lag_steps"), ("wait_ms", "wait_ms"),
                 ("staged_wait_ms", "staged_wait_ms"), ("snapshot_wait_ms", "snapshot_wait_ms"),
                 ("install_ms", "install_ms"), ("send_ms", "send_ms"), ("fragment", "fragment")),
    "merge": (("lag", "staleness"), ("weight", "merge_weight"), ("outer_lr", "outer_lr"),
              ("outer_grad_norm", "outer_grad_norm"), ("islands", "merge_islands"), ("version", "merged_version")),
    "install": (("version", "version"), ("install_ms", "install_ms"), ("staged_wait_ms", "staged_wait_ms")),
    "reconnect": (("seconds", "reconnect_seconds"),),
    "start": (("seconds", "start_seconds"),),
    "final": (("seconds", "final_cut_seconds"),),
}
MAX_BACKLOG = 4096      # records published and not yet written before rank 0 stops publishing


def scalars(rec: dict) -> Optional[Tuple[int, Dict[str, float]]]:
    """(iteration, {tag: value}) of one boundary-log record; None when it carries no figure."""
    spec = FIGURES.get(rec.get("event"))
    step = rec.get("step")
    if not spec or not isinstance(step, int) or isinstance(step, bool):
        return None
    out = {}
    for field, name in spec:
        v = rec.get(field)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            continue
        out[PREFIX + name] = float(v)
    return (step, out) if out else None


# ---------------------------------------------------------------------------------------------------- writers
class Writers:
    """The launcher's writers of this rank (TensorBoard-like: ``add_scalar``; W&B-like: ``log``)."""

    def __init__(self, writers: Iterable):
        self.items = [w for w in writers if w is not None]
        self._wandb_ready = set()
        self._failed = set()

    def __bool__(self) -> bool:
        return bool(self.items)

    @staticmethod
    def kind(w) -> Optional[str]:
        if callable(getattr(w, "add_scalar", None)):
            return "tensorboard"
        if callable(getattr(w, "log", None)):
            return "wandb"
        return None

    def describe(self) -> List[str]:
        return [f"{self.kind(w) or 'unknown'} ({type(w).__name__})" for w in self.items]

    def write(self, step: int, values: Dict[str, float]) -> None:
        for w in self.items:
            if id(w) in self._failed:
                continue
            try:
                kind = self.kind(w)
                if kind == "tensorboard":
                    for tag, v in values.items():
                        w.add_scalar(tag, v, step)
                elif kind == "wandb":
                    self._wandb(w, step, values)
            except Exception as e:  # noqa: BLE001 - a figure never stops training
                self._failed.add(id(w))
                log.warning("yeto-patch: writing the boundary figures to %s failed (%s: %s); no more figures go "
                            "there", type(w).__name__, type(e).__name__, e)

    def _wandb(self, w, step, values) -> None:
        if id(w) not in self._wandb_ready:
            define = getattr(w, "define_metric", None)
            if callable(define):   # the figures' own x axis: W&B's step belongs to the launcher
                define(PREFIX + "iteration")
                define(PREFIX + "*", step_metric=PREFIX + "iteration")
            self._wandb_ready.add(id(w))
        w.log({**values, PREFIX + "iteration": step}, commit=False)

    def flush(self) -> None:
        for w in self.items:
            fl = getattr(w, "flush", None)
            if callable(fl) and id(w) not in self._failed:
                try:
                    fl()
                except Exception:  # noqa: BLE001
                    pass


# ---------------------------------------------------------------------------------------------------- relay
def _store():
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None, 0, 1
        return dist.distributed_c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - no store: figures only where rank 0 holds the writer
        return None, 0, 1


class Relay:
    """Rank 0's figures to the rank that holds the launcher's writers (see the module docstring)."""

    def __init__(self, generation: int = 0):
        self.keys = f"yeto_patch/figures/{generation}/"
        self.enabled = True
        self.writers: Optional[Writers] = None     # this rank's, once looked up
        self.consumer: Optional[int] = None         # rank 0: the rank that writes (None: nobody)
        self.rank: Optional[int] = None
        self._store = None
        self._registered = False
        self._attached = None      # rank 0: the boundary log it publishes from
        self.is_consumer = False
        self._published = 0        # rank 0: records published
        self._read_seen = 0        # rank 0: records the consumer had written when last asked
        self._dropped = 0          # rank 0: records not published (the consumer is MAX_BACKLOG behind)
        self._read = 0             # consumer: records written
        self._closed = False
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------ every rank, every train step
    def see_writers(self, provider: Optional[Callable[[], Iterable]]) -> None:
        """Before the island starts (then every step): this rank's writers; the first rank with one registers
        as the consumer. `provider()` returns the launcher's writers (None entries for those not opened)."""
        if not self.enabled or provider is None:
            return
        try:
            found = Writers(provider())
        except Exception as e:  # noqa: BLE001
            log.debug("yeto-patch: looking up the launcher's writers failed: %s", e)
            return
        if self.writers is None or (found and not self.writers):
            self.writers = found
        if self.writers and not self._registered:
            self._registered = True
            self._store, self.rank, _ = _store()
            try:
                if self._store is not None:
                    key = self.keys + "consumer"
                    self._store.compare_set(key, "", str(self.rank))
                    self.is_consumer = self._store.get(key).decode() == str(self.rank)
                else:
                    self.is_consumer = self.rank == 0
            except Exception as e:  # noqa: BLE001 - a figure never stops training
                self._give_up("registering this rank as the one that writes them", e)
                return
            if not self.is_consumer:
                return
            log.info("yeto-patch: the boundary figures go to this rank's %s under %s*",
                     ", ".join(self.writers.describe()), PREFIX)

    # ------------------------------------------------------------------------ rank 0
    def attach(self, boundary_log) -> None:
        """Rank 0, once the island started: publish the boundary log's records to the consumer (if any)."""
        if not self.enabled or boundary_log is None or self._attached is boundary_log:
            return
        self._attached = boundary_log
        if self.is_consumer and self.rank in (None, 0):
            self.consumer = 0
        else:
            store, _, _ = _store()
            key = self.keys + "consumer"
            try:
                if store is None or not store.check([key]):
                    return   # no rank holds a writer: nothing to do
                self._store, self.consumer = store, int(store.get(key).decode())
            except Exception as e:  # noqa: BLE001
                self._give_up("finding the rank that writes them", e)
                return
        boundary_log.add_sink(self.publish)

    def _give_up(self, what: str, err: BaseException) -> None:
        self.enabled = False
        log.warning("yeto-patch: no boundary figures in the launcher's writers: %s failed (%s: %s)", what,
                    type(err).__name__, err)

    def publish(self, rec: dict) -> None:
        """Rank 0, a boundary-log sink: the record's figures to the consumer."""
        fig = scalars(rec)
        if fig is not None and self.consumer == 0:
            self.writers.write(*fig)
        elif fig is not None and self._room():
            self._published += 1
            self._store.set(f"{self.keys}{self._published}", json.dumps(fig, separators=(",", ":")))
            self._store.add(self.keys + "n", 1)
        if rec.get("event") == "final":
            if self.consumer == 0:
                self.writers.flush()
            else:
                self._store.set(self.keys + "closed", "1")

    def _room(self) -> bool:
        """Whether the consumer is less than MAX_BACKLOG records behind (asked only when it might not be)."""
        if self._published - self._read_seen < MAX_BACKLOG:
            return True
        self._read_seen = int(self._store.add(self.keys + "read", 0))
        if self._published - self._read_seen < MAX_BACKLOG:
            return True
        self._dropped += 1
        if self._dropped == 1:
            log.warning("yeto-patch: the rank writing the boundary figures is %d records behind; figures are "
                        "dropped until it catches up", MAX_BACKLOG)
        return False

    # ------------------------------------------------------------------------ the consumer
    def drain(self, final: bool = False, wait_s: float = 30.0) -> int:
        """The consumer (not rank 0): write what rank 0 published; at the final cut first wait (at most
        `wait_s`) for rank 0's last record. Returns how many records were written."""
        if not (self.enabled and self.is_consumer and self._store is not None) or self.rank in (None, 0) \
                or self._closed:
            return 0
        with self._lock:
            store = self._store
            try:
                if final:
                    try:
                        store.wait([self.keys + "closed"], datetime.timedelta(seconds=wait_s))
                    except Exception:  # noqa: BLE001 - rank 0 never got there: write what there is
                        log.warning("yeto-patch: the final boundary figures did not arrive within %.0fs", wait_s)
                n = int(store.add(self.keys + "n", 0))
                done = 0
                while self._read < n:
                    self._read += 1
                    key = f"{self.keys}{self._read}"
                    step, values = json.loads(store.get(key).decode())
                    store.delete_key(key)
                    self.writers.write(int(step), {str(k): float(v) for k, v in values.items()})
                    done += 1
                if done:
                    store.add(self.keys + "read", done)
                if final:
                    self.writers.flush()
                    self._closed = True
                return done
            except Exception as e:  # noqa: BLE001 - a figure never stops training
                self._give_up("reading them from the job's store", e)
                return 0

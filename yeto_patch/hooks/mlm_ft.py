"""Hook for ``megatron.training.ft_integration`` (Megatron-LM's ``--enable-ft-package``: NVIDIA's fault-tolerance
package, nvidia-resiliency-ext, under ``ft_launcher``): the island's waits keep the rank alive for it.

Megatron-LM opens the FT ``step`` section around each ``train_step`` (after ``--ft-num-warmup-iters``), ``setup``
from ``ft_integration.setup()`` to the first step and ``checkpointing`` around saves; ``ft_launcher``'s rank
monitor kills the rank (and restarts the workers) when a section stays open longer than its timeout. An island
waits inside those sections (a base at the tau bound, the syncer in an outage), bounded by YETO_DILOCO_TIMEOUT,
not by the section's timeout. What the package offers for a long piece of work inside a section is the section
itself: ``RankMonitorClient.end_section`` / ``start_section`` (heartbeats are a separate mechanism that
Megatron-LM does not use: sending them would arm the heartbeat timeouts for the rest of the run). So after
``setup()`` made the client, ``SectionPulse`` goes to the island's keep-alive (``island/keepalive.py``): while the
island waits, every ``PULSE_EVERY_S`` seconds, each section open on this rank is closed and opened again, so
that the monitor measures the wait in pieces. Outside the island's waits nothing changes, and a hang anywhere else
(or inside a wait, beyond YETO_DILOCO_TIMEOUT, which fails the island) is still the monitor's to catch.
``shutdown()`` takes it away. Without ``--enable-ft-package`` (no client) nothing is registered.
"""
from __future__ import annotations

import logging
import sys

from yeto_patch.island.keepalive import KEEPALIVE

from . import _wrap
from ._targets import Target

log = logging.getLogger("yeto_patch")

TARGET = "megatron.training.ft_integration"
LAUNCHER = "Megatron-LM"
DISTRIBUTION = "megatron-core"     # megatron.training ships in its wheels >= 0.17
TARGETS = (Target(TARGET, None, "setup"),      # after it: the rank monitor client exists (with --enable-ft-package)
           Target(TARGET, None, "shutdown"))   # before it: the client goes away
# nvidia-resiliency-ext: the RankMonitorClient of 0.4 to 0.7 (end_section / start_section, timeouts_calc's
# open_sections); megatron-core 0.19's ft_integration itself needs >= 0.5 (init_workload_monitoring's warm-up)
SUPPORTED_VERSIONS = {"megatron-core": ">=0.17", "nvidia-resiliency-ext": ">=0.5"}
KEEPALIVE_NAME = "nvidia-ft-sections"
# two small messages on the rank monitor's Unix socket per pulse, only while the island waits; well inside any
# section timeout the monitor can enforce (it looks every --ft-workload-check-interval, 5 s by default)
PULSE_EVERY_S = 1.0


class SectionPulse:
    """The keep-alive of one RankMonitorClient: its open sections (those the monitor times) close and open again."""
    __slots__ = ("client", "pulses")

    def __init__(self, client):
        self.client = client
        self.pulses = 0

    def open_sections(self) -> list:
        """The sections this rank has open, as the client recorded them (only sections that have a timeout are
        sent to the monitor, and only those are recorded)."""
        calc = getattr(self.client, "timeouts_calc", None)
        sections = getattr(calc, "open_sections", None)
        if sections is None:
            raise RuntimeError("this nvidia-resiliency-ext's RankMonitorClient does not show its open sections "
                               "(timeouts_calc.open_sections)")
        return list(sections)

    def __call__(self) -> None:
        if not getattr(self.client, "is_initialized", False):
            return
        for section in self.open_sections():
            self.client.end_section(section)
            self.client.start_section(section)
        self.pulses += 1


def setup_wrapper(wrapped, instance, args, kwargs):
    """After Megatron-LM made its FT client (with --enable-ft-package), the island's waits keep it alive."""
    result = wrapped(*args, **kwargs)
    try:
        module = sys.modules.get(TARGET)
        client = module.get_rank_monitor_client() if module is not None else None
        if client is not None:
            KEEPALIVE.register(KEEPALIVE_NAME, SectionPulse(client), PULSE_EVERY_S)
            log.info("yeto-patch: NVIDIA FT is on: while the island waits, its open sections restart every %gs",
                     PULSE_EVERY_S)
    except Exception as e:  # noqa: BLE001 - never break Megatron's start because of us
        log.warning("yeto-patch: could not attach to Megatron-LM's FT client (%s: %s); the rank monitor may take "
                    "the island's long waits for hangs", type(e).__name__, e)
    return result


def shutdown_wrapper(wrapped, instance, args, kwargs):
    """Before Megatron-LM closes its FT client: no more keep-alive calls to it."""
    KEEPALIVE.unregister(KEEPALIVE_NAME)
    return wrapped(*args, **kwargs)


patch, unpatch, patched = _wrap.hook(TARGET, [
    (None, "setup", setup_wrapper),
    (None, "shutdown", shutdown_wrapper)], __name__)

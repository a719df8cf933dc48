"""The durable store's disk quota: overfull and underfull. No I/O.

The rule, as the Qpid Java broker manual states it ("Disk quota-based flow
control", /work/shared/reference/qpid-java-broker-producer-flow-control.md):

    Two limits can be configured: overfull limit - the maximum space on disk
    (in bytes) which can be used by store. underfull limit - when the space on
    disk drops below this limit, producers are allowed to resume publishing.

and its log lines, "Store overfull, flow control will be enforced" and "Store
overfull condition cleared". qflowd's options are ``--store-overfull-size``
and ``--store-underfull-size``; without the latter, underfull = overfull, as
the Java broker's ``flowResumeCapacity`` equals its ``capacity`` when unset.

So: the store is *overfull* once its size on disk is above ``overfull``, and
stays so until the size is below ``underfull``. While it is, the store
(qflow.store.message_store) keeps holding the completion of every persistent
transfer it has synced, the same mechanism as a stopped queue, so each
producer stops after its capacity; leaving overfull releases them in order.
Like the Java broker's quota this is best effort: the transfers already in
flight when the size crosses the limit are still written, so the store may
exceed ``overfull`` by up to one commit plus every producer's capacity.

The size must fall as consumers consume, whatever the quota is against the
journal's segment size: while overfull the store asks the journal to compact
once what is live fits under ``underfull`` (Journal.compact_to_fit). So any
underfull limit above the smallest journal can be reached, and
:meth:`QuotaLimits.check_reachable` refuses the rest at start.

This module only decides; :class:`StoreQuota` is fed the size after each
commit and says whether the state changed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("qflow.store")


class QuotaError(ValueError):
    """Quota limits that make no sense; the text names the option at fault."""


@dataclass(frozen=True)
class QuotaLimits:
    """``overfull``: above this many bytes on disk the store is overfull (0: no
    quota). ``underfull``: below this many it is not any more (None: = overfull)."""

    overfull: int = 0
    underfull: int | None = None

    def __post_init__(self) -> None:
        if self.overfull < 0:
            raise QuotaError(f"--store-overfull-size must be 0 (no quota) or a positive number of bytes, not {self.overfull}")
        if self.underfull is None:
            return
        if self.overfull == 0:
            raise QuotaError("--store-underfull-size needs --store-overfull-size: there is no quota without it")
        if self.underfull < 0:
            raise QuotaError(f"--store-underfull-size must be 0 or a positive number of bytes, not {self.underfull}")
        if self.underfull > self.overfull:
            raise QuotaError(f"--store-underfull-size {self.underfull} must not be above --store-overfull-size "
                             f"{self.overfull}")

    def check_reachable(self, smallest: int) -> None:
        """Refuse a quota the store could never fall under: its size cannot go
        below ``smallest`` bytes (an empty journal), so an underfull limit at or
        below that would hold every producer for ever once overfull.

        Raises:
          QuotaError: naming both options and the floor.
        """
        if self.enabled and self.resume <= smallest:
            which = "--store-underfull-size" if self.underfull is not None else "--store-overfull-size"
            raise QuotaError(f"{which} {self.resume} can never be cleared: an empty store takes {smallest} bytes, "
                             f"so --store-underfull-size (default: --store-overfull-size) must be above it")

    @property
    def enabled(self) -> bool:
        return self.overfull > 0

    @property
    def resume(self) -> int:
        """The effective underfull limit."""
        return self.overfull if self.underfull is None else self.underfull


class StoreQuota:
    """The overfull state of a store whose size is reported by :meth:`update`."""

    def __init__(self, limits: QuotaLimits) -> None:
        self.limits = limits
        self.size = 0
        self.overfull = False
        self.overfull_count = 0  # times the store became overfull

    def update(self, size: int) -> bool:
        """The store is ``size`` bytes now; True if that changed its overfull state
        (the change is logged)."""
        self.size = size
        limits = self.limits
        if not limits.enabled:
            return False
        if not self.overfull and size > limits.overfull:
            self.overfull = True
            self.overfull_count += 1
            log.warning("store overfull: %d bytes > %d, flow control enforced", size, limits.overfull)
            return True
        if self.overfull and size < limits.resume:
            self.overfull = False
            log.warning("store overfull condition cleared: %d bytes < %d", size, limits.resume)
            return True
        return False

    def stats(self) -> dict[str, int | bool]:
        """What the management API shows (storeSize, storeOverfull, storeOverfullCount)."""
        return {"storeSize": self.size, "storeOverfull": self.overfull, "storeOverfullCount": self.overfull_count}

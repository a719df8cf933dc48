"""Queue limits and flow-control thresholds: the one place that validates them.

The rules are the Qpid C++ broker's ("Producer Flow Control"):

* "Flow Stop Threshold: the level of queue resource utilization above which
  flow control will be enabled"; "Flow Resume Threshold: the level ... below
  which flow control will be disabled"; stop must be >= resume.
* "By default, the C++ broker assigns a queue's flow stop and flow resume
  thresholds when the queue is created", as percentages of the queue's maximum
  (``--default-flow-stop-threshold`` 80, ``--default-flow-resume-threshold``
  70); "the value 0 for both ... disable[s] default queue flow control".
* "queues that have been configured with a Limit Policy of type RING or
  RING-STRICT do NOT have queue flow thresholds".
* "The user may disable flow control on a per queue basis by setting the
  flow-stop-size and flow-stop-count to zero for the queue."

Decisions where the manual is silent: any of the four ``qpid.flow_*`` keys
makes the thresholds explicit (defaults then apply to neither unit); a resume
threshold of 0 or absent equals its stop threshold; on a ring queue the flow
keys are ignored, as qpidd does. Applying the thresholds to depths is the
accounting's job (``qflow.broker.accounting``); this module only decides them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qflow.broker.accounting import COUNT_MAX, SIZE_MAX

MAX_COUNT = "qpid.max_count"
MAX_SIZE = "qpid.max_size"
POLICY = "qpid.policy_type"
STOP_COUNT = "qpid.flow_stop_count"
RESUME_COUNT = "qpid.flow_resume_count"
STOP_SIZE = "qpid.flow_stop_size"
RESUME_SIZE = "qpid.flow_resume_size"
FLOW_KEYS = (STOP_COUNT, RESUME_COUNT, STOP_SIZE, RESUME_SIZE)
POLICIES = ("reject", "ring", "ring-strict", "none")


class SettingsError(ValueError):
    """A queue's arguments or the broker's defaults are invalid; the text says which."""


@dataclass(frozen=True)
class FlowDefaults:
    stop_pct: int = 80
    resume_pct: int = 70
    queue_limit: int = 104857600  # bytes; 0 = no default size limit

    def __post_init__(self) -> None:
        for name, pct in (("--default-flow-stop-threshold", self.stop_pct),
                          ("--default-flow-resume-threshold", self.resume_pct)):
            if type(pct) is not int or not 0 <= pct <= 100:
                raise SettingsError(f"{name} must be a percentage from 0 to 100, not {pct!r}")
        if self.resume_pct > self.stop_pct:
            raise SettingsError(
                f"--default-flow-resume-threshold ({self.resume_pct}) must not exceed "
                f"--default-flow-stop-threshold ({self.stop_pct})"
            )
        if type(self.queue_limit) is not int or not 0 <= self.queue_limit <= SIZE_MAX:
            raise SettingsError(f"--default-queue-limit must be a byte count >= 0, not {self.queue_limit!r}")


@dataclass(frozen=True)
class QueueSettings:
    """What a queue's arguments mean, once validated."""

    max_count: int  # 0 = no limit
    max_size: int  # 0 = no limit
    policy: str
    stop_count: int
    resume_count: int
    stop_size: int
    resume_size: int

    @property
    def flow_enabled(self) -> bool:
        return self.stop_count > 0 or self.stop_size > 0

    @property
    def is_ring(self) -> bool:
        return self.policy in ("ring", "ring-strict")


def _uint(arguments: dict[str, Any], key: str, limit: int) -> int | None:
    if key not in arguments:
        return None
    value = arguments[key]
    if type(value) is not int:
        raise SettingsError(f"{key} must be a non-negative integer, not {value!r}")
    if value < 0 or value > limit:
        raise SettingsError(f"{key} must be between 0 and {limit}, not {value}")
    return value


def stop_of(maximum: int, pct: int) -> int:
    """floor(max x pct% + 0.5), in integers."""
    return (maximum * pct * 2 + 100) // 200


def resume_of(maximum: int, pct: int) -> int:
    """floor(max x pct%), in integers."""
    return maximum * pct // 100


def resolve(arguments: dict[str, Any], defaults: FlowDefaults) -> QueueSettings:
    """Validate a queue's arguments and decide its limits and flow thresholds."""
    max_count = _uint(arguments, MAX_COUNT, COUNT_MAX)
    max_size = _uint(arguments, MAX_SIZE, SIZE_MAX)
    policy = arguments.get(POLICY, "reject")
    if policy not in POLICIES:
        raise SettingsError(f"{POLICY} must be one of {', '.join(POLICIES)}, not {policy!r}")
    size_limit_key = MAX_SIZE
    if max_size is None:
        max_size = defaults.queue_limit
        size_limit_key = "--default-queue-limit"
    max_count = max_count or 0
    if policy in ("ring", "ring-strict"):
        if not max_count and not max_size:
            raise SettingsError(f"{POLICY}={policy} needs {MAX_COUNT} or {MAX_SIZE}")
        for key in FLOW_KEYS:  # validated for type, then ignored: ring queues never get flow control
            _uint(arguments, key, SIZE_MAX)
        return QueueSettings(max_count, max_size, policy, 0, 0, 0, 0)

    explicit = any(key in arguments for key in FLOW_KEYS)
    if explicit:
        stop_count = _uint(arguments, STOP_COUNT, COUNT_MAX) or 0
        resume_count = _uint(arguments, RESUME_COUNT, COUNT_MAX) or stop_count
        stop_size = _uint(arguments, STOP_SIZE, SIZE_MAX) or 0
        resume_size = _uint(arguments, RESUME_SIZE, SIZE_MAX) or stop_size
    elif defaults.stop_pct == 0 and defaults.resume_pct == 0:
        stop_count = resume_count = stop_size = resume_size = 0
    else:
        stop_count = stop_of(max_count, defaults.stop_pct) if max_count else 0
        resume_count = resume_of(max_count, defaults.resume_pct) if max_count else 0
        stop_size = stop_of(max_size, defaults.stop_pct) if max_size else 0
        resume_size = resume_of(max_size, defaults.resume_pct) if max_size else 0
        # As for explicit thresholds, a resume threshold of 0 equals its stop threshold
        # (a literal 0 could never be undercut: the queue would stay stopped for good).
        resume_count = resume_count or stop_count
        resume_size = resume_size or stop_size

    if resume_count > stop_count:
        raise SettingsError(f"{RESUME_COUNT} ({resume_count}) must not exceed {STOP_COUNT} ({stop_count})")
    if resume_size > stop_size:
        raise SettingsError(f"{RESUME_SIZE} ({resume_size}) must not exceed {STOP_SIZE} ({stop_size})")
    if max_count and stop_count > max_count:
        raise SettingsError(f"{STOP_COUNT} ({stop_count}) must not exceed {MAX_COUNT} ({max_count})")
    if max_size and stop_size > max_size:
        raise SettingsError(f"{STOP_SIZE} ({stop_size}) must not exceed {size_limit_key} ({max_size})")
    return QueueSettings(max_count, max_size, policy, stop_count, resume_count, stop_size, resume_size)


def describe_transition(name: str, s: QueueSettings, flow_on: bool, count: int, nbytes: int) -> str:
    """The log line for a flow transition: which threshold was crossed, and the depth."""
    if flow_on:
        if s.stop_count and count > s.stop_count:
            why = f"count {count} > {s.stop_count}"
        elif s.stop_size and nbytes > s.stop_size:
            why = f"bytes {nbytes} > {s.stop_size}"
        else:
            why = f"count {count}, bytes {nbytes}"
        return f'queue "{name}": flow stopped ({why})'
    parts = []
    if s.stop_count:
        parts.append(f"count {count} < {s.resume_count}")
    if s.stop_size:
        parts.append(f"bytes {nbytes} < {s.resume_size}")
    return f'queue "{name}": flow resumed ({", ".join(parts) or "flow control disabled"})'

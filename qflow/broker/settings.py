"""Queue limits and flow-control thresholds: the one place that resolves them.

A queue's four thresholds are worked out exactly as the Qpid C++ broker works
them out (``QueueFlowLimit::createLimit`` and ``validateFlowConfig``), so a
queue declaration copied from qpidd gets the same flow control here:

1. Ring queues (``ring``, ``ring-strict``) get no flow limit: "queues that have
   been configured with a Limit Policy of type RING or RING-STRICT do NOT have
   queue flow thresholds". Their ``qpid.flow_*`` keys are type-checked, then
   ignored.
2. The maximum by count is ``qpid.max_count`` (0 if absent); by size,
   ``qpid.max_size``, or else ``--default-queue-limit``.
3. All four thresholds are pre-filled from the broker's percentages, each only
   when that percentage is non-zero: stop = maximum x (stop% / 100.0) + 0.5,
   resume = maximum x (resume% / 100.0), computed in IEEE double and truncated
   (so 90 messages at 70 % resume at 62, not 63). A size beyond 2**64 - 1 after
   the arithmetic saturates at it (qpidd's conversion is undefined there).
4. Each ``qpid.flow_*`` key the user gave replaces only its own value; the
   other three keep their pre-filled values.
5. If either stop value is non-zero the queue has a flow limit, and each unit
   is checked: where its stop is non-zero, resume > stop is refused, a resume of
   0 becomes equal to the stop, and a stop above a non-zero maximum is refused.
   A unit whose stop is 0 keeps its resume value unchecked. If both stops are
   0, the queue has no flow limit and all four thresholds are 0.
6. A resume key given without any stop key is accepted; the broker logs a
   warning about it (``resume_without_stop``), as qpidd does.

At run time (``qflow.broker.accounting``, qpidd's ``QueueFlowLimit``) a unit
takes part in stopping when its *stop* is non-zero and in resuming when its
*resume* is non-zero: so a unit resolved to stop 0 with a pre-filled resume
still has to drain below that resume before flow turns off, as in qpidd.
This module only decides the values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qflow.broker.ops import COUNT_MAX, SIZE_MAX

MAX_COUNT = "qpid.max_count"
MAX_SIZE = "qpid.max_size"
POLICY = "qpid.policy_type"
STOP_COUNT = "qpid.flow_stop_count"
RESUME_COUNT = "qpid.flow_resume_count"
STOP_SIZE = "qpid.flow_stop_size"
RESUME_SIZE = "qpid.flow_resume_size"
FLOW_KEYS = (STOP_COUNT, RESUME_COUNT, STOP_SIZE, RESUME_SIZE)
MESSAGE_TTL = "x-message-ttl"  # RabbitMQ's; qpidd has no queue default for a message's ttl
PRIORITIES = ("qpid.priorities", "x-qpid-priorities")
MAX_PRIORITY_KEY = "x-max-priority"
ALTERNATE = ("alternate-exchange", "x-dead-letter-exchange")
DEAD_LETTER_KEY = "x-dead-letter-routing-key"
TTL_MAX = (1 << 63) - 1
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
    ttl: int = 0  # ms a message without its own ttl lives here; 0 = for ever
    # The priority level (0 lowest) of a message of priority 0..9, and of one without a priority;
    # () = not a priority queue.
    levels: tuple[int, ...] = ()
    default_level: int = 0
    alternate: str | None = None  # where this queue's dead letters go; None = nowhere
    dead_letter_key: str | None = None  # their routing key; None = each message's own

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
    """qpidd's pre-filled stop threshold: maximum x (pct / 100.0) + 0.5 in IEEE double, truncated.

    Python's float is the same IEEE double as qpidd's C++ (int to double rounds to
    nearest, then one rounded multiply and one rounded add), so the results agree
    bit for bit, including where exact arithmetic would round the other way."""
    return min(int(maximum * (pct / 100.0) + 0.5), SIZE_MAX)


def resume_of(maximum: int, pct: int) -> int:
    """qpidd's pre-filled resume threshold: maximum x (pct / 100.0) in IEEE double, truncated."""
    return min(int(maximum * (pct / 100.0)), SIZE_MAX)


def resume_without_stop(arguments: dict[str, Any]) -> str | None:
    """The warning qpidd logs for a resume key given without any stop key (rule 6), or None.

    Such a queue is accepted: the resume value applies, with the pre-filled stop
    thresholds (none if the broker's percentages are 0)."""
    if arguments.get(POLICY) in ("ring", "ring-strict"):
        return None  # qpidd decides "no flow limit" for a ring queue before it looks at flow keys
    if STOP_COUNT in arguments or STOP_SIZE in arguments:
        return None
    given = [key for key in (RESUME_COUNT, RESUME_SIZE) if key in arguments]
    if not given:
        return None
    return (f"{' and '.join(given)} given without {STOP_COUNT} or {STOP_SIZE}: "
            "the stop thresholds are the broker's defaults")


@dataclass(frozen=True)
class _Unit:
    """One unit of measure (count or size) while a queue's thresholds are resolved."""

    stop_key: str
    resume_key: str
    maximum: int  # the queue's maximum in this unit, 0 = none
    max_label: str  # where the maximum came from, for error texts


def _shown(unit: _Unit, key: str, value: int, arguments: dict[str, Any], pct: int) -> str:
    """``key=value`` as qpidd's texts spell it, saying so when the value is a pre-filled default
    (the user may not have written that key at all)."""
    if key in arguments:
        return f"{key}={value}"
    return f"{key}={value} (the default: {pct} % of {unit.max_label})"


def _validate(unit: _Unit, stop: int, resume: int, arguments: dict[str, Any], defaults: FlowDefaults) -> int:
    """qpidd's validateFlowConfig for one unit; returns the resume threshold in force."""
    if not stop:
        return resume  # a unit with stop 0 is not checked, and keeps its resume (rule 5)
    if resume > stop:
        raise SettingsError(
            f"{_shown(unit, unit.resume_key, resume, arguments, defaults.resume_pct)} must be less than or "
            f"equal to {_shown(unit, unit.stop_key, stop, arguments, defaults.stop_pct)}")
    if resume == 0:
        # A literal 0 could never be undercut: the queue would stay stopped for good.
        resume = stop
    if unit.maximum and stop > unit.maximum:
        raise SettingsError(
            f"{_shown(unit, unit.stop_key, stop, arguments, defaults.stop_pct)} must be less than or "
            f"equal to {unit.max_label}")
    return resume


def priority_levels(levels: int) -> tuple[int, ...]:
    """qpidd's mapping of a message's priority (0..9) to one of a queue's
    ``levels`` (``qpid.priorities``), lowest 0: AMQP 0-10's rule
    priority-level-implementation. The levels are centred on priority 5:
    with ``first = 5 - min(5, ceil(levels / 2))``, priorities up to ``first``
    share level 0, and each above it takes the next level, up to the last
    (``levels=10`` is one level per priority; ``levels=2``: 0-4 low, 5-9 high)."""
    first = 5 - min(5, -(-levels // 2))
    return tuple(0 if p <= first else min(p - first, levels - 1) for p in range(10))


def _options(arguments: dict[str, Any]) -> dict[str, Any]:
    """The message-handling options: default ttl, priority levels, where dead letters go."""
    ttl = _uint(arguments, MESSAGE_TTL, TTL_MAX) or 0
    if MESSAGE_TTL in arguments and not ttl:
        raise SettingsError(f"{MESSAGE_TTL}=0 (RabbitMQ: expire unless delivered at once) is not supported; "
                            "give a time of 1 ms or more, or no key for no expiry")
    given = [(key, _uint(arguments, key, 10)) for key in PRIORITIES if key in arguments]
    options: dict[str, Any] = {"ttl": ttl}
    if len({n for _, n in given}) > 1:
        raise SettingsError(f"{' and '.join(k for k, _ in given)} differ: give one")
    n = given[0][1] if given else 0
    rabbit = _uint(arguments, MAX_PRIORITY_KEY, 255)  # RabbitMQ's limit; a message's priority is 0-9 here
    if n and rabbit:
        raise SettingsError(f"{given[0][0]} and {MAX_PRIORITY_KEY} are two ways to the same thing: give one")
    if n:
        # qpidd: a message without a priority has AMQP 0-10's default, 4.
        options["levels"] = levels = priority_levels(n)
        options["default_level"] = levels[4]
    elif rabbit:
        # RabbitMQ: priority p is level min(p, max); a message without one has priority 0.
        options["levels"] = tuple(min(p, rabbit) for p in range(10))
    alternates = [(key, arguments[key]) for key in ALTERNATE if key in arguments]
    for key, value in alternates:
        # RabbitMQ's "" is the default exchange (with x-dead-letter-routing-key naming a queue);
        # qpidd's alternate-exchange has no such meaning, so it is refused there.
        if type(value) is not str or (not value and key == ALTERNATE[0]):
            raise SettingsError(f"{key} must be an exchange's name, not {value!r}")
    if len({v for _, v in alternates}) > 1:
        raise SettingsError(f"{' and '.join(k for k, _ in alternates)} name different exchanges: give one")
    if alternates:
        options["alternate"] = alternates[0][1]
    if DEAD_LETTER_KEY in arguments:
        key = arguments[DEAD_LETTER_KEY]
        if type(key) is not str:
            raise SettingsError(f"{DEAD_LETTER_KEY} must be a string, not {key!r}")
        if not alternates:
            raise SettingsError(f"{DEAD_LETTER_KEY} needs {ALTERNATE[1]} (or {ALTERNATE[0]})")
        options["dead_letter_key"] = key
    return options


def resolve(arguments: dict[str, Any], defaults: FlowDefaults) -> QueueSettings:
    """Validate a queue's arguments and decide its limits and flow thresholds, as qpidd does,
    and its message-handling options (a default ttl, priority levels, an alternate exchange)."""
    options = _options(arguments)
    max_count = _uint(arguments, MAX_COUNT, COUNT_MAX)
    max_size = _uint(arguments, MAX_SIZE, SIZE_MAX)
    policy = arguments.get(POLICY, "reject")
    if policy not in POLICIES:
        raise SettingsError(f"{POLICY} must be one of {', '.join(POLICIES)}, not {policy!r}")
    given = {key: _uint(arguments, key, COUNT_MAX if key in (STOP_COUNT, RESUME_COUNT) else SIZE_MAX)
             for key in FLOW_KEYS}
    # Rule 2: the maxima the percentages apply to.
    max_count = max_count or 0
    size_label = f"{MAX_SIZE}={max_size}"
    if max_size is None:
        max_size = defaults.queue_limit
        size_label = f"{MAX_SIZE}={max_size} from --default-queue-limit"
    if policy in ("ring", "ring-strict"):  # rule 1: the flow keys were type-checked above, and are ignored
        if not max_count and not max_size:
            raise SettingsError(f"{POLICY}={policy} needs {MAX_COUNT} or {MAX_SIZE}")
        return QueueSettings(max_count, max_size, policy, 0, 0, 0, 0, **options)

    # Rule 3: pre-fill from the broker's percentages, each only when it is non-zero.
    stop_count = resume_count = stop_size = resume_size = 0
    if defaults.stop_pct:
        stop_count = stop_of(max_count, defaults.stop_pct)
        stop_size = stop_of(max_size, defaults.stop_pct)
    if defaults.resume_pct:
        resume_count = resume_of(max_count, defaults.resume_pct)
        resume_size = resume_of(max_size, defaults.resume_pct)
    # Rule 4: each key given replaces its own value only.
    if given[STOP_COUNT] is not None:
        stop_count = given[STOP_COUNT]
    if given[RESUME_COUNT] is not None:
        resume_count = given[RESUME_COUNT]
    if given[STOP_SIZE] is not None:
        stop_size = given[STOP_SIZE]
    if given[RESUME_SIZE] is not None:
        resume_size = given[RESUME_SIZE]
    # Rule 5: both stops 0 is no flow limit at all; otherwise each unit is checked, count first.
    if not stop_count and not stop_size:
        return QueueSettings(max_count, max_size, policy, 0, 0, 0, 0, **options)
    count = _Unit(STOP_COUNT, RESUME_COUNT, max_count, f"{MAX_COUNT}={max_count}")
    size = _Unit(STOP_SIZE, RESUME_SIZE, max_size, size_label)
    resume_count = _validate(count, stop_count, resume_count, arguments, defaults)
    resume_size = _validate(size, stop_size, resume_size, arguments, defaults)
    return QueueSettings(max_count, max_size, policy, stop_count, resume_count, stop_size, resume_size, **options)


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
    parts = []  # the units that took part in resuming: those with a resume threshold, as in qpidd
    if s.resume_count:
        parts.append(f"count {count} < {s.resume_count}")
    if s.resume_size:
        parts.append(f"bytes {nbytes} < {s.resume_size}")
    return f'queue "{name}": flow resumed ({", ".join(parts) or "flow control disabled"})'

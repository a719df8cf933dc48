"""Queue and exchange arguments that other brokers give a meaning and qflow does not implement.

A queue or exchange argument is a free-form map: a key qflow does not know is
kept and shown, and changes nothing. That is right for a label such as
``x-team``, and a trap for a key another broker acts on: a RabbitMQ user who
declares ``x-message-ttl`` takes the queue's success as expiry they can rely
on. So every key that Qpid (qpidd), RabbitMQ or ActiveMQ Artemis gives a meaning,
and that qflow does not implement, is refused with an error naming the key and
the broker whose meaning it has (:func:`refuse_unsupported`). Keys nobody gives
a meaning keep being accepted as labels.

Where a key asks for qflow's behaviour anyway (``x-queue-type=classic``,
``x-single-active-consumer=false``, ``qpid.priorities=0``...) the value is
accepted: it changes nothing, and nothing is ignored.

The arguments qflow implements are :data:`QUEUE_IMPLEMENTED` (qflow.broker.settings
resolves them) and :data:`EXCHANGE_IMPLEMENTED` (qflow.broker.exchange).

Every path that creates or changes a queue or an exchange calls
:func:`refuse_unsupported` before anything else looks at the arguments: the
protocol's declare and modify, the management API (and so qflow-config), and
any future protocol's node creation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qflow.protocol import CommandError
from qflow.protocol.spec import INVALID_ARGUMENT

QPID = "Qpid"
RABBITMQ = "RabbitMQ"
ARTEMIS = "Artemis"


@dataclass(frozen=True)
class Unsupported:
    """A key that another broker acts on and qflow does not.

    Attributes:
      broker: whose meaning the key has ("Qpid", "RabbitMQ" or "Artemis").
      meaning: what that broker does with it, in a few words.
      instead: what qflow offers for the same need, if anything ("" if nothing).
      harmless: values that ask for what qflow does anyway; they are accepted.
    """

    broker: str
    meaning: str
    instead: str = ""
    harmless: tuple[Any, ...] = ()


def _u(broker: str, meaning: str, instead: str = "", harmless: tuple[Any, ...] = ()) -> Unsupported:
    return Unsupported(broker, meaning, instead, harmless)


# The queue arguments qflow implements (qflow.broker.settings).
QUEUE_IMPLEMENTED = ("qpid.max_count", "qpid.max_size", "qpid.policy_type", "qpid.flow_stop_count",
                     "qpid.flow_resume_count", "qpid.flow_stop_size", "qpid.flow_resume_size",
                     "x-message-ttl", "alternate-exchange", "x-dead-letter-exchange", "x-dead-letter-routing-key",
                     "qpid.priorities", "x-qpid-priorities", "x-max-priority")
# The exchange arguments qflow implements (qflow.broker.exchange).
EXCHANGE_IMPLEMENTED = ("alternate-exchange",)

_MAX_COUNT = "qpid.max_count limits a queue by count"
_MAX_SIZE = "qpid.max_size limits a queue by bytes"
_POLICY = "qpid.policy_type (reject, ring, ring-strict) says what a full queue does"
_LATER = "not yet (planned)"
_FLAGS = "the declare's own flag"

QUEUE_ARGUMENTS: Mapping[str, Unsupported] = {
    # Qpid C++ broker (qpidd): QueueSettings and its aliases.
    "qpid.fairshare": _u(QPID, "fair-share delivery across priority levels", "", (0,)),
    "qpid.last_value_queue_key": _u(QPID, "a last-value queue"),
    "qpid.last_value_queue": _u(QPID, "a last-value queue"),
    "qpid.LVQ_key": _u(QPID, "a last-value queue"),
    "qpid.last_value_queue_no_browse": _u(QPID, "a last-value queue"),
    "qpid.auto_delete_timeout": _u(QPID, "auto-delete after a delay", "", (0,)),
    "qpid.lifetime-policy": _u(QPID, "when the queue is deleted"),
    "qpid.browse-only": _u(QPID, "consumers only browse", "", (False, 0)),
    "no-local": _u(QPID, "a session does not receive its own messages", "", (False, 0)),
    "qpid.trace.id": _u(QPID, "message tracing across federated brokers"),
    "qpid.trace.exclude": _u(QPID, "message tracing across federated brokers"),
    "qpid.alert_count": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_size": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_count_up": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_size_up": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_count_down": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_size_down": _u(QPID, "a management event at a depth", "the /metrics depth gauges and the console"),
    "qpid.alert_repeat_gap": _u(QPID, "the gap between depth alerts"),
    "x-qpid-maximum-message-count": _u(QPID, "a management event at a depth",
                                       "the /metrics depth gauges and the console"),
    "x-qpid-maximum-message-size": _u(QPID, "a management event at a depth",
                                      "the /metrics depth gauges and the console"),
    "x-qpid-minimum-alert-repeat-gap": _u(QPID, "the gap between depth alerts"),
    "qpid.group_header_key": _u(QPID, "message groups"),
    "qpid.shared_msg_group": _u(QPID, "message groups"),
    "qpid.group_timestamp": _u(QPID, "message groups"),
    "qpid.paging": _u(QPID, "paging messages out of memory", "", (False, 0)),
    "qpid.max_pages_loaded": _u(QPID, "paging messages out of memory"),
    "qpid.page_factor": _u(QPID, "paging messages out of memory"),
    "qpid.queue_msg_sequence": _u(QPID, "a sequence number header on each message"),
    "qpid.filter": _u(QPID, "a selector on what the queue accepts"),
    "qpid.file_count": _u(QPID, "the legacy store's journal files", "the broker's --data-dir journal"),
    "qpid.file_size": _u(QPID, "the legacy store's journal files", "the broker's --data-dir journal"),
    # RabbitMQ: its queue arguments.
    "x-expires": _u(RABBITMQ, "deleting an unused queue after a time"),
    "x-max-length": _u(RABBITMQ, "a limit by count", _MAX_COUNT),
    "x-max-length-bytes": _u(RABBITMQ, "a limit by bytes", _MAX_SIZE),
    "x-overflow": _u(RABBITMQ, "what a full queue does", _POLICY),
    "x-dead-letter-strategy": _u(RABBITMQ, "at-least-once dead-lettering", "", ("at-most-once",)),
    "x-queue-type": _u(RABBITMQ, "a quorum or stream queue", "", ("classic",)),
    "x-queue-mode": _u(RABBITMQ, "a lazy queue", "", ("default",)),
    "x-queue-version": _u(RABBITMQ, "the classic queue's storage format"),
    "x-single-active-consumer": _u(RABBITMQ, "one consumer at a time", "", (False,)),
    "x-queue-master-locator": _u(RABBITMQ, "which cluster node holds the queue"),
    "x-queue-leader-locator": _u(RABBITMQ, "which cluster node holds the queue"),
    "x-quorum-initial-group-size": _u(RABBITMQ, "a quorum queue's replicas"),
    "x-quorum-target-group-size": _u(RABBITMQ, "a quorum queue's replicas"),
    "x-initial-cluster-size": _u(RABBITMQ, "a stream's replicas"),
    "x-delivery-limit": _u(RABBITMQ, "dropping a message redelivered too often"),
    "x-max-in-memory-length": _u(RABBITMQ, "a quorum queue's memory limit"),
    "x-max-in-memory-bytes": _u(RABBITMQ, "a quorum queue's memory limit"),
    "x-max-age": _u(RABBITMQ, "a stream's retention"),
    "x-stream-max-segment-size-bytes": _u(RABBITMQ, "a stream's segment files"),
    "x-stream-filter-size-bytes": _u(RABBITMQ, "a stream's filters"),
    "x-consumer-timeout": _u(RABBITMQ, "closing a consumer that does not acknowledge in time"),
    # ActiveMQ Artemis: its queue attributes and address parameters.
    "last-value": _u(ARTEMIS, "a last-value queue", "", (False,)),
    "last-value-key": _u(ARTEMIS, "a last-value queue"),
    "non-destructive": _u(ARTEMIS, "consumers only browse", "", (False,)),
    "exclusive": _u(ARTEMIS, "one consumer at a time", "", (False,)),
    "max-consumers": _u(ARTEMIS, "a limit on consumers", "", (-1,)),
    "purge-on-no-consumers": _u(ARTEMIS, "purging when the last consumer goes", "", (False,)),
    "consumers-before-dispatch": _u(ARTEMIS, "holding delivery until enough consumers", "", (0,)),
    "delay-before-dispatch": _u(ARTEMIS, "holding delivery for a time", "", (-1,)),
    "group-rebalance": _u(ARTEMIS, "message groups"),
    "group-buckets": _u(ARTEMIS, "message groups"),
    "group-first-key": _u(ARTEMIS, "message groups"),
    "ring-size": _u(ARTEMIS, "a ring queue", "qpid.policy_type=ring with qpid.max_count", (-1,)),
    "auto-delete": _u(ARTEMIS, "deleting the queue when unused", _FLAGS),
    "auto-delete-delay": _u(ARTEMIS, "deleting the queue when unused"),
    "auto-delete-message-count": _u(ARTEMIS, "deleting the queue when unused"),
    "filter-string": _u(ARTEMIS, "a selector on what the queue accepts"),
    "routing-type": _u(ARTEMIS, "anycast or multicast delivery", "exchanges and bindings"),
}

# Keys that begin so: qpidd reads "qpid.fairshare-N" as the fair share of priority N.
QUEUE_PREFIXES: Mapping[str, Unsupported] = {
    "qpid.fairshare": QUEUE_ARGUMENTS["qpid.fairshare"],
    "x-qpid-fairshare": QUEUE_ARGUMENTS["qpid.fairshare"],
}

EXCHANGE_ARGUMENTS: Mapping[str, Unsupported] = {
    "qpid.msg_sequence": _u(QPID, "a sequence number header on each message"),
    "qpid.ive": _u(QPID, "an initial-value exchange (replays the last message to new bindings)"),
    "qpid.sequence_counter": _u(QPID, "a sequence number header on each message"),
    "x-delayed-type": _u(RABBITMQ, "delayed delivery (the delayed-message exchange)"),
    "hash-header": _u(RABBITMQ, "a consistent-hash exchange"),
    "hash-property": _u(RABBITMQ, "a consistent-hash exchange"),
}


def _lookup(kind: str, key: str) -> Unsupported | None:
    if kind == "exchange":
        return EXCHANGE_ARGUMENTS.get(key)
    found = QUEUE_ARGUMENTS.get(key)
    if found is None:
        for prefix, entry in QUEUE_PREFIXES.items():
            if key.startswith(prefix):
                return entry
    return found


def _harmless(value: Any, harmless: tuple[Any, ...]) -> bool:
    # type() too, so that True is not taken for the harmless 1 nor 0 for False
    return any(type(value) is type(ok) and value == ok for ok in harmless)


def unsupported(kind: str, arguments: Mapping[str, Any]) -> list[str]:
    """Why each of ``arguments`` that qflow does not support is refused, in the map's order.

    Args:
      kind: ``"queue"`` or ``"exchange"``.
      arguments: the arguments as given (keys not strings are left to the caller's checks).

    Returns:
      One sentence per refused key, naming it; empty if nothing is refused.
    """
    reasons = []
    for key, value in arguments.items():
        if type(key) is not str:
            continue
        entry = _lookup(kind, key)
        if entry is None or _harmless(value, entry.harmless):
            continue
        text = f"{kind} argument {key!r} ({entry.broker}: {entry.meaning}) is not supported by qflow"
        if entry.instead == _LATER:
            text += "; it is planned, not yet implemented"
        elif entry.instead:
            text += f"; instead, {entry.instead}"
        reasons.append(text)
    return reasons


def refuse_unsupported(command: str, kind: str, arguments: Mapping[str, Any]) -> None:
    """Refuse ``arguments`` if any of them is one qflow does not support.

    Args:
      command: what is being done, for the error text (``"queue.declare 'q'"``).
      kind: ``"queue"`` or ``"exchange"``.
      arguments: the arguments as given (for a change, only the change).

    Raises:
      CommandError: INVALID_ARGUMENT, naming every refused key and saying qflow
        does not support it.
    """
    reasons = unsupported(kind, arguments)
    if reasons:
        raise CommandError(INVALID_ARGUMENT, f"{command}: {'; '.join(reasons)}")

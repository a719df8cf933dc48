"""``GET /metrics``, hand-written: the Prometheus text format 0.0.4, or OpenMetrics 1.0 when asked.

It renders the same views the JSON API serves (``views.broker_view`` and
``views.queue_view``): each metric names the view field it shows, so
``/metrics`` and ``/api/queues`` cannot disagree about a number.

Two formats, chosen by the request's Accept header (:func:`wants_openmetrics`),
as Prometheus's own client libraries choose: one text cannot be valid in both.
OpenMetrics names a counter's family without its ``_total`` (``# TYPE
qflow_queue_flow_stops counter``) and ends with ``# EOF``; the 0.0.4 format
names the family as its samples are named, and a 0.0.4 reader takes a family
without samples of its own name as another metric. A scraper that asks for
nothing in particular (curl) gets 0.0.4.

No gauge shares a family name with a counter once the counter's ``_total`` is
taken off (OpenMetrics forbids it, and parsers of either format that take it
off, such as prometheus_client's, see two families with one name): the counts
of times a state began are ``..._events_total`` beside the state's gauge.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS_TYPE = "application/openmetrics-text; version=1.0.0; charset=utf-8"

# (metric, type, help, field of the queue view). Counter names end in _total.
QUEUE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("qflow_queue_depth_messages", "gauge", "Messages on the queue, delivered-unacknowledged included (msgDepth).",
     "msgDepth"),
    ("qflow_queue_depth_bytes", "gauge", "Bytes of the messages on the queue, headers and bodies (byteDepth).", "byteDepth"),
    ("qflow_queue_flow_stopped", "gauge", "1 while the queue's producer flow control is active (flowStopped).",
     "flowStopped"),
    ("qflow_queue_flow_stops_total", "counter", "Times flow control became active (flowStoppedCount).",
     "flowStoppedCount"),
    ("qflow_queue_held_transfers", "gauge", "Transfers whose completion the queue holds (heldTransfers).",
     "heldTransfers"),
    ("qflow_queue_held_sessions", "gauge", "Sessions currently held by the queue's flow control.",
     "heldSessionCount"),
    ("qflow_queue_flow_stop_count", "gauge", "Flow stop threshold in messages, 0 = none (flowStopCount).",
     "flowStopCount"),
    ("qflow_queue_flow_resume_count", "gauge", "Flow resume threshold in messages (flowResumeCount).",
     "flowResumeCount"),
    ("qflow_queue_flow_stop_size", "gauge", "Flow stop threshold in bytes, 0 = none (flowStopSize).",
     "flowStopSize"),
    ("qflow_queue_flow_resume_size", "gauge", "Flow resume threshold in bytes (flowResumeSize).", "flowResumeSize"),
    ("qflow_queue_messages_enqueued_total", "counter", "Messages enqueued (msgTotalEnqueues).", "msgTotalEnqueues"),
    ("qflow_queue_messages_dequeued_total", "counter", "Messages dequeued (msgTotalDequeues).", "msgTotalDequeues"),
    ("qflow_queue_bytes_enqueued_total", "counter", "Bytes enqueued (byteTotalEnqueues).", "byteTotalEnqueues"),
    ("qflow_queue_bytes_dequeued_total", "counter", "Bytes dequeued (byteTotalDequeues).", "byteTotalDequeues"),
    ("qflow_queue_consumers", "gauge", "Subscriptions on the queue (consumerCount).", "consumerCount"),
    ("qflow_queue_discards_ring_total", "counter", "Messages a ring policy discarded (discardsRing).",
     "discardsRing"),
    ("qflow_queue_discards_overflow_total", "counter", "Transfers refused because the queue was full "
     "(discardsOverflow).", "discardsOverflow"),
)

# (metric, help, field of the broker view's totals): broker-wide gauges without labels.
BROKER_METRICS: tuple[tuple[str, str, str], ...] = (
    ("qflow_connections", "Open protocol connections.", "connections"),
    ("qflow_sessions", "Attached sessions.", "sessions"),
    ("qflow_queues", "Declared queues.", "queues"),
)


# (metric, type, help, field of the exchange view), labelled exchange (the default one is "").
EXCHANGE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("qflow_exchange_messages_received_total", "counter", "Messages sent to the exchange (msgReceives).",
     "msgReceives"),
    ("qflow_exchange_messages_routed_total", "counter", "Messages routed to queues, one per queue (msgRoutes).",
     "msgRoutes"),
    ("qflow_exchange_messages_dropped_total", "counter", "Messages that matched no binding and were discarded "
     "(msgDrops).", "msgDrops"),
    ("qflow_exchange_bytes_received_total", "counter", "Bytes sent to the exchange (byteReceives).", "byteReceives"),
    ("qflow_exchange_bytes_routed_total", "counter", "Bytes routed to queues, once per queue (byteRoutes).",
     "byteRoutes"),
    ("qflow_exchange_bytes_dropped_total", "counter", "Bytes of the messages discarded unroutable (byteDrops).",
     "byteDrops"),
)

# (metric, type, help, field of the broker view): the durable store's quota (qflow.store.quota), then the memory alarm.
RESOURCE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("qflow_store_size_bytes", "gauge", "Bytes of the message journal on disk (storeSize).", "storeSize"),
    ("qflow_store_overfull", "gauge", "1 while the store is overfull: persistent producers are held "
     "(storeOverfull).", "storeOverfull"),
    ("qflow_store_overfull_events_total", "counter", "Times the store became overfull (storeOverfullCount).",
     "storeOverfullCount"),
    # the memory alarm (qflow.broker.memory_alarm)
    ("qflow_memory_used_bytes", "gauge", "Resident memory of qflowd when last measured (memoryUsed).", "memoryUsed"),
    ("qflow_memory_high_watermark_bytes", "gauge", "Above this the memory alarm is set, 0 = off "
     "(memoryHighWatermark).", "memoryHighWatermark"),
    ("qflow_memory_alarm", "gauge", "1 while the memory alarm is set: every producer is held (memoryAlarm).",
     "memoryAlarm"),
    ("qflow_memory_alarm_events_total", "counter", "Times the memory alarm was set (memoryAlarmCount).",
     "memoryAlarmCount"),
)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def wants_openmetrics(accept: str) -> bool:
    """Whether a request's Accept header asks for OpenMetrics at least as much as for the 0.0.4 text.

    Args:
      accept: the header's value ("" if there was none).
    """
    best = {"openmetrics": 0.0, "text": 0.0}
    for item in accept.split(","):
        media, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        media = media.lower()
        if media == "application/openmetrics-text":
            best["openmetrics"] = max(best["openmetrics"], q)
        elif media in ("text/plain", "text/*", "*/*"):
            best["text"] = max(best["text"], q)
    return best["openmetrics"] > 0 and best["openmetrics"] >= best["text"]


def render_metrics(broker: dict[str, Any], queues: list[dict[str, Any]],
                   exchanges: Sequence[dict[str, Any]] = (), *, openmetrics: bool = False) -> str:
    """Every metric family: the broker-wide ones from ``broker`` (a broker view),
    then one sample per queue view in ``queues``, labelled ``queue``, and one
    per exchange view in ``exchanges``, labelled ``exchange``; in the
    Prometheus text format 0.0.4, or in OpenMetrics 1.0 if ``openmetrics``."""
    out: list[str] = []

    def family(name: str, type_: str, help_: str, samples: Iterable[tuple[str, Any]]) -> None:
        # OpenMetrics names a counter's family without the _total its samples carry.
        family_name = name[:-len("_total")] if openmetrics and type_ == "counter" else name
        out.append(f"# HELP {family_name} {help_}")
        out.append(f"# TYPE {family_name} {type_}")
        for labels, value in samples:
            out.append(f"{name}{labels} {int(value) if type(value) is bool else value}")

    family("qflow_uptime_seconds", "gauge", "Seconds since the broker started.", [("", broker["uptimeSeconds"])])
    for metric, help_, key in BROKER_METRICS:
        family(metric, "gauge", help_, [("", broker["totals"][key])])
    family("qflow_protocol_connections", "gauge", "Open protocol connections by protocol (qflow, amqp1.0).",
           [(f'{{protocol="{_label(name)}"}}', n) for name, n in sorted(broker["totals"]["connectionsByProtocol"].items())])
    family("qflow_unroutable_messages_total", "counter", "Messages routed to no queue and discarded, "
           "broker-wide (discardsNoRoute).", [("", broker["totals"]["discardsNoRoute"])])
    for metric, type_, help_, key in RESOURCE_METRICS:
        family(metric, type_, help_, [("", broker[key])])
    labelled = [(f'{{queue="{_label(view["name"])}"}}', view) for view in queues]
    for metric, type_, help_, key in QUEUE_METRICS:
        family(metric, type_, help_, [(labels, view[key]) for labels, view in labelled])
    by_exchange = [(f'{{exchange="{_label(view["name"])}"}}', view) for view in exchanges]
    for metric, type_, help_, key in EXCHANGE_METRICS:
        family(metric, type_, help_, [(labels, view[key]) for labels, view in by_exchange])
    if openmetrics:
        out.append("# EOF")
    return "\n".join(out) + "\n"

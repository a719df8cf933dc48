"""What monitoring shows: one function per view, each a dict built on demand
from the live broker and protocol server.

The JSON routes (``api``), the Prometheus exposition (``metrics``) and any
later console all read these views, so a number is computed in one place and
every reader shows the same value for the same state. Nothing here keeps a
copy of the broker's state: each call reads the live objects, which is safe
because it runs on the broker's trio thread between input batches.

The views are pure functions of the live objects and of the clock readings
passed in: no I/O, no trio. The server is duck-typed (anything with
``connections``, each having ``peer``, ``name``, ``sessions`` and
``connected_at`` in trio time), so this package never imports qflow.server.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

from qflow import __version__
from qflow.broker import Broker, BrokerSession
from qflow.broker.exchange import Exchange
from qflow.broker.queue import Queue
from qflow.protocol import spec as P


def iso(wall: float) -> str:
    """A wall-clock time as ISO 8601 UTC with milliseconds, ``...Z``."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def jsonable(value: Any) -> Any:
    """Arguments declared over the protocol may hold msgpack values JSON lacks
    (bytes, non-string keys, NaN): show them rather than fail the request."""
    t = type(value)
    if t in (str, int, bool) or value is None:
        return value
    if t is float:
        return value if math.isfinite(value) else str(value)
    if t is bytes:
        return value.decode("utf-8", "backslashreplace")
    if t in (list, tuple):
        return [jsonable(v) for v in value]
    if t is dict:
        return {k if type(k) is str else str(jsonable(k)): jsonable(v) for k, v in value.items()}
    return repr(value)


# -- queues, exchanges, bindings -------------------------------------------------


def queue_view(broker: Broker, q: Queue) -> dict[str, Any]:
    """Every statistic of one queue, with QMF names (``msgDepth``,
    ``flowStopped``, ``heldTransfers``, ...), plus ``heldSessionCount``."""
    view = broker.queue_stats(q)
    view["arguments"] = jsonable(view["arguments"])
    view["heldSessionCount"] = len(broker.held_sessions(q))
    return view


def queue_views(broker: Broker) -> list[dict[str, Any]]:
    """Every queue's view, ordered by name."""
    return [queue_view(broker, q) for _, q in sorted(broker.queues.items())]


def exchange_view(ex: Exchange) -> dict[str, Any]:
    """An exchange with Qpid's statistics: messages (and bytes) received, routed
    (one per destination queue, as qpidd's msgRoutes) and dropped for want of a
    route (msgDrops: an unroutable message is completed and discarded)."""
    return {"name": ex.name, "type": ex.type, "durable": ex.durable, "arguments": ex.arguments,
            "bindingCount": ex.binding_count,
            "msgReceives": ex.msg_in, "msgRoutes": ex.msg_in - ex.msg_drop + ex.msg_extra, "msgDrops": ex.msg_drop,
            "byteReceives": ex.byte_in, "byteRoutes": ex.byte_in - ex.byte_drop + ex.byte_extra,
            "byteDrops": ex.byte_drop}


def exchange_views(broker: Broker) -> list[dict[str, Any]]:
    """Every exchange's view, ordered by name (the default exchange, ``""``, first)."""
    return [exchange_view(broker.exchanges[name]) for name in sorted(broker.exchanges)]


def binding_views(broker: Broker) -> list[dict[str, str]]:
    """Every binding of a named exchange: ``{exchange, queue, key}``."""
    return broker.bindings()


# -- connections and sessions ------------------------------------------------------


def live_connections(server: Any) -> list[Any]:
    """The server's open protocol connections, oldest first (none without a server)."""
    conns = getattr(server, "connections", None) or ()
    return sorted(conns, key=lambda c: c.connected_at)


def _incomplete_and_held(ssn: BrokerSession) -> tuple[int, int]:
    """(incomplete commands, held transfers) of a session.

    Between input batches (which is whenever this runs: the broker flushes
    before any await) every command is complete except transfers held by flow
    control and execution.syncs waiting behind them. Both are read from the
    session's IncomingCommands, not copied, so the view cannot drift.
    """
    commands = ssn.commands
    incomplete = commands.incomplete_count()
    return incomplete, max(0, incomplete - commands.waiting_syncs)


def session_view(broker: Broker, ssn: BrokerSession, now: float) -> dict[str, Any]:
    """One session: its sender capacity, what is incomplete and held, and which
    queues hold it since when (``now`` is wall-clock time), longest held first."""
    incomplete, held = _incomplete_and_held(ssn)
    held_by = []
    for name, since in ssn.held_since.items():  # what holds it, from the session: not a walk over every queue
        q = broker.queues.get(name)
        if q is not None and ssn in broker.held_sessions(q):
            held_by.append({"queue": name, "since": iso(since), "heldSeconds": round(now - since, 3)})
    for name, since in ssn.holder_since.items():  # the memory alarm, the store's quota
        held_by.append({"holder": name, "since": iso(since), "heldSeconds": round(now - since, 3)})
    held_by.sort(key=lambda h: h["heldSeconds"] or 0, reverse=True)
    return {
        "channel": ssn.channel, "name": ssn.name, "user": ssn.user, "senderCapacity": ssn.capacity,
        "incompleteCommands": incomplete, "heldTransfers": held,
        "unackedDeliveries": ssn.unacked_count, "consumers": sorted(ssn.consumers),
        "flowStopped": bool(held_by), "heldBy": held_by,
    }


def connection_views(broker: Broker, server: Any, now: float, trio_now: float | None) -> list[dict[str, Any]]:
    """Every connection with its sessions' views. ``now`` is wall-clock time;
    ``trio_now`` is trio's clock, which ``connected_at`` is measured on (None
    outside trio: every connection then shows as just connected)."""
    out = []
    for conn in live_connections(server):
        age = max(0.0, trio_now - conn.connected_at) if trio_now is not None else 0.0
        out.append({
            "name": conn.name, "user": conn.user, "peer": conn.peer, "protocol": conn.protocol_name,
            "connectedAt": iso(now - age),
            "connectedSeconds": round(age, 3), "outputBytes": conn.output_bytes,
            "inputBytes": conn.input_bytes, "readingPaused": conn.reading_paused,
            "sessions": [session_view(broker, s, now) for _, s in sorted(conn.sessions.items())],
        })
    return out


def subscription_views(server: Any) -> list[dict[str, Any]]:
    """Every subscription (qpid-stat -u): its destination, queue, connection,
    session, whether it browses, whether its deliveries await an accept,
    whether its queue is exclusive, its credit and how many it was delivered."""
    out = []
    for conn in live_connections(server):
        for _, ssn in sorted(conn.sessions.items()):
            if ssn is None:  # attaching
                continue
            for name, c in sorted(ssn.consumers.items()):
                out.append({
                    "subscription": name, "queue": c.queue.name, "connection": conn.peer, "connectionName": conn.name,
                    "user": conn.user, "protocol": conn.protocol_name,
                    "session": ssn.name, "channel": ssn.channel, "browse": c.acquire_mode == P.ACQUIRE_NOT_ACQUIRED,
                    "acked": c.accept_mode == P.ACCEPT_EXPLICIT, "exclusive": c.queue.exclusive,
                    "creditMode": "unlimited" if c.credit < 0 and c.byte_credit < 0 else "credit",
                    "credit": c.credit, "byteCredit": c.byte_credit, "delivered": c.delivered,
                })
    return out


# -- the broker as a whole ------------------------------------------------------------

# The store's statistics when there is none (--no-data-dir).
_NO_STORE = {"storeSize": 0, "storeOverfull": False, "storeOverfullCount": 0}
# The memory alarm's statistics when there is none (a broker made without one).
_NO_MEMORY_ALARM = {"memoryUsed": 0, "memoryHighWatermark": 0, "memoryLowWatermark": 0, "memoryAlarm": False,
                    "memoryAlarmCount": 0}

# The queue statistics the broker view sums over every queue.
_SUMMED = ("msgDepth", "byteDepth", "msgTotalEnqueues", "msgTotalDequeues", "byteTotalEnqueues",
           "byteTotalDequeues", "heldTransfers")


def broker_view(broker: Broker, server: Any, options: dict[str, Any], started_at: float, now: float,
                queues: list[dict[str, Any]] | None = None, store: Any = None, memory: Any = None) -> dict[str, Any]:
    """Version, uptime, the options in force, the totals, the durable store and the memory alarm.

    ``options`` are the daemon's settings (ports, timeouts) to show beside the
    broker's own defaults. The totals are sums over the queue views, so they
    agree with ``/api/queues`` by construction; pass ``queues`` when the caller
    has built them already. ``store`` (its ``stats()``: storeSize,
    storeOverfull, storeOverfullCount) is None without a data directory: then
    there is nothing on disk, never overfull. ``memory`` (its ``stats()``:
    memoryUsed, memoryHighWatermark, memoryLowWatermark, memoryAlarm,
    memoryAlarmCount) is the memory alarm (qflow.broker.memory_alarm).
    """
    if queues is None:
        queues = queue_views(broker)
    d = broker.defaults
    totals: dict[str, Any] = {
        "queues": len(broker.queues), "exchanges": len(broker.exchanges), "bindings": len(broker.bindings()),
        "connections": len(live_connections(server)), "sessions": len(broker.sessions),
    }
    by_protocol = {"qflow": 0, "amqp1.0": 0}  # both always shown: a dashboard's series do not come and go
    for conn in live_connections(server):
        by_protocol[conn.protocol_name] = by_protocol.get(conn.protocol_name, 0) + 1
    totals["connectionsByProtocol"] = by_protocol
    totals.update({key: sum(view[key] for view in queues) for key in _SUMMED})
    totals["flowStoppedQueues"] = sum(bool(view["flowStopped"]) for view in queues)
    totals["discardsNoRoute"] = broker.discards_no_route
    # Distinct sessions: one held by two queues counts once, so this is not a sum of heldSessionCount.
    totals["heldSessions"] = len({s for q in broker.queues.values() for s in broker.held_sessions(q)})
    return {
        "name": "qflowd", "version": __version__, "startedAt": iso(started_at),
        "uptimeSeconds": round(now - started_at, 3),
        "options": {
            **options,
            "defaultFlowStopThreshold": d.stop_pct, "defaultFlowResumeThreshold": d.resume_pct,
            "defaultQueueLimit": d.queue_limit, "accounting": broker.acct.name,
        },
        "totals": totals,
        **(store.stats() if store is not None else _NO_STORE),
        **(memory.stats() if memory is not None else _NO_MEMORY_ALARM),
    }

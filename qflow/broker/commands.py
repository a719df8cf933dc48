"""The protocol's commands, run against the broker: :func:`execute` takes one
validated non-transfer command to its handler, one per command code, each
taking the broker, the session, the command id and the command's fields
(already checked against the schema, qflow.protocol.spec). A handler returns
the command's result (or None) and raises CommandError to refuse it. This
module calls the model (qflow.broker.broker); the model never calls it. No I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator
from types import GeneratorType
from typing import TYPE_CHECKING, Any

import qflow.broker.broker as broker_module
from qflow import protocol as P
from qflow.broker.acl import queue_request
from qflow.broker.queue import Consumer, Queue
from qflow.protocol import CommandError
from qflow.protocol.entries import Entry
from qflow.protocol.names import check_name, printable
from qflow.protocol.ranges import MAX_RANGES, RangeSet

if TYPE_CHECKING:
    from qflow.broker.broker import Broker, Steps
    from qflow.broker.session import BrokerSession

# The management change log (qflow.management.api logs the API's changes there): a
# client's declare, delete, purge, modify, bind and unbind go to the same log, once
# per command, so an operator sees every change whichever way it came.
change_log = logging.getLogger("qflow.management")

NO_COMPLETE = object()  # a handler's result: the command completes later (execution.sync)

# Bounds on the work one command may ask for: past them the command is
# refused with RESOURCE_LIMIT_EXCEEDED, and the session, its connection and the
# broker carry on. A client never needs more: its receivers accept consecutive
# deliveries as one range, and its senders wait for each sync.
# MAX_RANGES (qflow.protocol.ranges): ranges in one message.accept, message.release or
# queue.remove-sequences, and in a queue.available answer
MAX_WAITING_SYNCS = 1_000  # execution.sync commands of one session waiting for earlier commands


def _log_change(ssn: BrokerSession, command: str, what: str, outcome: str) -> None:
    change_log.info("management change by %s (user '%s'): %s %s %s", ssn.peer or "?", printable(ssn.user), command,
                    printable(what[:300]), printable(outcome[:300]))


def _changes(command: str, what: Callable[..., str | None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Log each run of the handler it decorates as a change made by the
    session's client (``what(*fields)`` says to what), done or refused. A
    handler's long work (a generator of steps) is logged once it has ended."""
    def decorate(handler: Callable[..., Any]) -> Callable[..., Any]:
        def logged(broker: Broker, ssn: BrokerSession, cid: int, *fields: Any) -> Any:
            target = what(*fields)
            if target is None:  # not a change (a passive declare only looks)
                return handler(broker, ssn, cid, *fields)
            try:
                result = handler(broker, ssn, cid, *fields)
            except CommandError as exc:
                _log_change(ssn, command, target, f"refused ({exc.code}): {exc.text}")
                raise
            if type(result) is GeneratorType:
                return _logged_steps(result, ssn, command, target)
            _log_change(ssn, command, target, _done(result))
            return result
        logged.__name__ = handler.__name__
        return logged
    return decorate


def _done(result: Any) -> str:
    if type(result) is dict and "created" in result:
        return "done (created)" if result["created"] else "done (it existed already: nothing changed)"
    return "done"


def _logged_steps(steps: Steps, ssn: BrokerSession, command: str, what: str) -> Generator[None, None, int]:
    try:
        count = yield from steps
    except CommandError as exc:
        _log_change(ssn, command, what, f"refused ({exc.code}): {exc.text}")
        raise
    _log_change(ssn, command, what, f"done ({count} messages removed)")
    return count


def _flags(**flags: bool) -> str:
    return "".join(f" {name.replace('_', '-')}" for name, on in flags.items() if on)


@_changes("queue.declare", lambda queue, durable, exclusive, auto_delete, arguments, passive: None if passive else
          f"'{queue}'{_flags(durable=durable, exclusive=exclusive, auto_delete=auto_delete)} arguments {arguments}")
def _queue_declare(broker: Broker, ssn: BrokerSession, cid: int, queue: str, durable: bool, exclusive: bool,
                   auto_delete: bool, arguments: dict, passive: bool) -> dict:
    if queue not in broker.queues:  # a name the broker holds already (recovered from older data) stays usable
        check_name("queue.declare", "queue", queue)
    if passive:
        broker.authorize(ssn.user, "access", "queue", {"name": queue})
    else:
        broker.authorize(ssn.user, "create", "queue", queue_request(queue, arguments, durable=durable,
                                                                    autodelete=auto_delete, exclusive=exclusive))
    q, created = broker.declare_queue(queue, durable, exclusive, auto_delete, arguments, passive, owner=ssn)
    return {"queue": q.name, "created": created}


@_changes("queue.delete",
          lambda queue, if_empty, if_unused: f"'{queue}'{_flags(if_empty=if_empty, if_unused=if_unused)}")
def _queue_delete(broker: Broker, ssn: BrokerSession, cid: int, queue: str, if_empty: bool,
                  if_unused: bool) -> Steps:
    broker.authorize(ssn.user, "delete", "queue", {"name": queue})
    return broker.delete_queue_steps(queue, if_empty, if_unused, by=ssn)


def _queue_remove_through(broker: Broker, ssn: BrokerSession, cid: int, queue: str, sequence: int) -> Steps:
    # A browsing reader's commit removes what it read: it consumes.
    broker.authorize(ssn.user, "consume", "queue", {"name": queue})
    return broker.remove_through_steps(queue, sequence, by=ssn)


def _queue_available(broker: Broker, ssn: BrokerSession, cid: int, queue: str, after: int, limit: int) -> Steps:
    # What a browsing reader plans to read: as browsing, it needs consume.
    broker.authorize(ssn.user, "consume", "queue", {"name": queue})
    return broker.available_steps(queue, after, limit, by=ssn, max_ranges=MAX_RANGES)


def _queue_remove_sequences(broker: Broker, ssn: BrokerSession, cid: int, queue: str, incarnation: str,
                            sequences: list) -> Steps:
    # A browsing reader's commit removes what it read: it consumes.
    broker.authorize(ssn.user, "consume", "queue", {"name": queue})
    return broker.remove_sequences_steps(queue, incarnation, _ids("queue.remove-sequences", sequences), by=ssn)


def _queue_list(broker: Broker, ssn: BrokerSession, cid: int) -> dict:
    # A reader subscribing by pattern asks which queues there are: only those
    # the user may access are named (an ACL's deny is not an error here).
    names = []
    for name in broker.queues:
        try:
            broker.authorize(ssn.user, "access", "queue", {"name": name})
        except CommandError:
            continue
        names.append(name)
    return {"queues": names}


@_changes("queue.purge", lambda queue: f"'{queue}'")
def _queue_purge(broker: Broker, ssn: BrokerSession, cid: int, queue: str) -> Steps:
    broker.authorize(ssn.user, "purge", "queue", {"name": queue})
    return broker.purge_steps(queue, by=ssn)


def _queue_query(broker: Broker, ssn: BrokerSession, cid: int, queue: str) -> dict:
    broker.authorize(ssn.user, "access", "queue", {"name": queue})
    return broker.queue_stats(broker.queue("queue.query", queue))


@_changes("queue.modify", lambda queue, arguments: f"'{queue}' arguments {arguments}")
def _queue_modify(broker: Broker, ssn: BrokerSession, cid: int, queue: str, arguments: dict) -> dict:
    broker.authorize(ssn.user, "update", "queue", queue_request(queue, arguments))
    broker.modify_queue(broker.queue("queue.modify", queue), arguments, by=ssn)
    return broker.queue_stats(broker.queues[queue])


@_changes("exchange.declare", lambda exchange, type_, durable, passive: None if passive
          else f"'{exchange}' type {type_}{_flags(durable=durable)}")
def _exchange_declare(broker: Broker, ssn: BrokerSession, cid: int, exchange: str, type_: str, durable: bool,
                      passive: bool) -> dict:
    if exchange not in broker.exchanges:
        check_name("exchange.declare", "exchange", exchange)
    if passive:
        broker.authorize(ssn.user, "access", "exchange", {"name": exchange or "amq.default"})
    else:
        broker.authorize(ssn.user, "create", "exchange", {"name": exchange, "type": type_, "durable": durable})
    return {"exchange": exchange, "created": broker.declare_exchange(exchange, type_, durable, passive)}


@_changes("exchange.delete", lambda exchange, if_unused: f"'{exchange}'{_flags(if_unused=if_unused)}")
def _exchange_delete(broker: Broker, ssn: BrokerSession, cid: int, exchange: str, if_unused: bool) -> None:
    broker.authorize(ssn.user, "delete", "exchange", {"name": exchange})
    broker.delete_exchange(exchange, if_unused)


@_changes("exchange.bind", lambda exchange, queue, key: f"'{exchange}' to queue '{queue}' key '{key}'")
def _bind(broker: Broker, ssn: BrokerSession, cid: int, exchange: str, queue: str, key: str) -> None:
    broker.authorize(ssn.user, "bind", "exchange", {"name": exchange, "queuename": queue, "routingkey": key})
    broker.bind(exchange, queue, key, by=ssn)


@_changes("exchange.unbind", lambda exchange, queue, key: f"'{exchange}' from queue '{queue}' key '{key}'")
def _unbind(broker: Broker, ssn: BrokerSession, cid: int, exchange: str, queue: str, key: str) -> None:
    broker.authorize(ssn.user, "unbind", "exchange", {"name": exchange, "queuename": queue, "routingkey": key})
    broker.bind(exchange, queue, key, unbind=True, by=ssn)




def _subscribe(broker: Broker, ssn: BrokerSession, cid: int, queue: str, destination: str, accept_mode: int,
               acquire_mode: int, start_sequence: int) -> None:
    broker.authorize(ssn.user, "consume", "queue", {"name": queue})  # browsing too, as in qpidd
    broker.subscribe(ssn, queue, destination, accept_mode, acquire_mode, start_sequence)


def _consumer(command: str, ssn: BrokerSession, destination: str) -> Consumer:
    c = ssn.consumers.get(destination)
    if c is None:
        raise CommandError(P.NOT_FOUND, f"{command}: no subscription with destination {destination!r}")
    return c


def _flow(broker: Broker, ssn: BrokerSession, cid: int, destination: str, messages: int, nbytes: int) -> None:
    c = _consumer("message.flow", ssn, destination)
    if messages < -1 or nbytes < -1:
        raise CommandError(P.INVALID_ARGUMENT, "message.flow: credit must be >= 0, or -1 for unlimited")
    c.credit = -1 if messages == -1 or c.credit == -1 else c.credit + messages
    c.byte_credit = -1 if nbytes == -1 or c.byte_credit == -1 else c.byte_credit + nbytes
    c.queue.ready[c.queue] = None


def _ids(command: str, wire: list) -> RangeSet:
    """``wire`` as a RangeSet; past MAX_RANGES ranges, refused."""
    limit = MAX_RANGES
    if type(wire) is list and len(wire) > 2 * limit:
        raise CommandError(P.RESOURCE_LIMIT_EXCEEDED,
                           f"{command}: {len(wire) // 2} ranges in one command, more than the limit of "
                           f"{limit}; send them in several commands")
    try:
        return RangeSet.from_wire(wire)
    except ValueError as exc:
        raise CommandError(P.INVALID_ARGUMENT, f"{command}: {exc}") from None


def _take(command: str, ssn: BrokerSession, transfers: list) -> tuple[list[Queue], list[Entry]]:
    """The deliveries awaiting accept with the ids of ``transfers``, taken from the session."""
    ranges = _ids(command, transfers)
    if len(transfers) == 2:  # the usual case: one range
        return ssn.take_unacked(transfers[0], transfers[1])
    queues: list[Queue] = []
    entries: list[Entry] = []
    for first, last in ranges.ranges():
        qs, es = ssn.take_unacked(first, last)
        queues += qs
        entries += es
    return queues, entries


def _accept(broker: Broker, ssn: BrokerSession, cid: int, transfers: list) -> Steps | None:
    queues, entries = _take("message.accept", ssn, transfers)
    if len(entries) > broker_module.SLICE:
        return broker.accept_steps(queues, entries)
    broker.accept(queues, entries)
    return None


def _release(broker: Broker, ssn: BrokerSession, cid: int, transfers: list) -> Steps | None:
    queues, entries = _take("message.release", ssn, transfers)
    if len(entries) > broker_module.SLICE:
        return broker.put_back_steps(queues, entries)
    broker.put_back(queues, entries)
    return None


def _cancel(broker: Broker, ssn: BrokerSession, cid: int, destination: str) -> None:
    broker.remove_consumer(_consumer("message.cancel", ssn, destination))


def _sync(broker: Broker, ssn: BrokerSession, cid: int) -> object:
    commands = ssn.commands
    if commands.floor < cid and commands.waiting_syncs >= MAX_WAITING_SYNCS:
        raise CommandError(P.RESOURCE_LIMIT_EXCEEDED,
                           f"execution.sync: {commands.waiting_syncs} syncs of this session already wait for "
                           f"earlier commands, the limit is {MAX_WAITING_SYNCS}")
    commands.sync(cid)
    broker.report(ssn)  # it may have completed at once: report it at the batch's end
    return NO_COMPLETE


def _sender_capacity(broker: Broker, ssn: BrokerSession, cid: int, capacity: int) -> None:
    if capacity < 0:
        raise CommandError(P.INVALID_ARGUMENT, "session.sender-capacity: capacity must be >= 0")
    broker.set_sender_capacity(ssn, capacity)


HANDLERS: dict[int, Callable[..., Any]] = {
    P.QUEUE_DECLARE: _queue_declare, P.QUEUE_DELETE: _queue_delete, P.QUEUE_PURGE: _queue_purge,
    P.QUEUE_QUERY: _queue_query, P.QUEUE_REMOVE_THROUGH: _queue_remove_through, P.QUEUE_MODIFY: _queue_modify,
    P.EXCHANGE_DECLARE: _exchange_declare, P.EXCHANGE_DELETE: _exchange_delete, P.EXCHANGE_BIND: _bind,
    P.EXCHANGE_UNBIND: _unbind, P.SUBSCRIBE: _subscribe, P.FLOW: _flow, P.ACCEPT: _accept, P.RELEASE: _release,
    P.CANCEL: _cancel, P.SYNC: _sync, P.SENDER_CAPACITY: _sender_capacity,
    P.QUEUE_AVAILABLE: _queue_available, P.QUEUE_REMOVE_SEQUENCES: _queue_remove_sequences,
    P.QUEUE_LIST: _queue_list,
}


def execute(broker: Broker, ssn: BrokerSession, command_id: int, code: int, args: list[Any]) -> None:
    """Run one validated non-transfer command and report it: its result (if
    any) and its completion go to the session's output, or its exception if
    it was refused. execution.sync completes later, once every earlier
    command has."""
    handler = HANDLERS.get(code)
    broker.apply_pending()
    try:
        if handler is None:
            raise CommandError(P.NOT_IMPLEMENTED, f"{P.command_name(code)} is not implemented")
        result = handler(broker, ssn, command_id, *args)
    except CommandError as exc:
        broker.fail(ssn, command_id, exc.code, exc.text)
        return
    if type(result) is GeneratorType:
        work = Unfinished(ssn, command_id, result, code not in (P.ACCEPT, P.RELEASE))
        if not work.step(broker):
            broker.unfinished = work  # the connection runs its other steps, serving others in between
        return
    if result is not NO_COMPLETE:
        broker.done(ssn, command_id, result)


class Unfinished:
    """A long command (queue.purge, queue.delete, queue.remove-through,
    queue.remove-sequences, queue.available, an accept or release of more
    than SLICE deliveries) under way: its steps each do a bounded slice of the work (qflow.broker.broker.SLICE);
    the command completes, with its count as result, after the last one."""

    __slots__ = ("session", "command_id", "steps", "reports_count")

    def __init__(self, session: BrokerSession, command_id: int, steps: Steps, reports_count: bool = True) -> None:
        self.session = session
        self.command_id = command_id
        self.steps = steps
        self.reports_count = reports_count  # the queue commands' result; accept and release have none

    def step(self, broker: Broker) -> bool:
        """Run one step; True once the command is done (and reported)."""
        try:
            next(self.steps)
        except StopIteration as stop:
            if type(stop.value) is dict:  # queue.available: its answer
                result = stop.value
            else:
                result = {"messages": stop.value} if self.reports_count else None
            broker.done(self.session, self.command_id, result)
            return True
        except CommandError as exc:
            broker.fail(self.session, self.command_id, exc.code, exc.text)
            return True
        return False

    def finish(self, broker: Broker) -> None:
        """Run every step left, at once (its connection is closing)."""
        while not self.step(broker):
            pass

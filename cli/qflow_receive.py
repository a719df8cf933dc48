"""qflow-receive: receive messages from a qflow queue, as qpid-receive does from qpidd.

    qflow-receive -b HOST:PORT -a QUEUE [--messages N] [--timeout SECS | --forever]
                  [--print-content yes|no] [--print-headers [yes|no]] [--browse]
                  [--capacity N] [--ack-frequency N] [--report-total]

Prints each body on its own line (``--print-content yes``, the default);
``--print-headers`` prints each message's headers before it, as
qpid-receive does. ``--browse``, or Qpid's address option ``-a 'QUEUE;
{mode: browse}'``, reads without removing: the messages stay on the queue.
``--report-total`` prints qpid-receive's columns: ``tp(m/s)``, and the
latencies ``l-min l-max l-avg`` (ms, from the send time qflow-send and
qpid-send put in the ``ts`` property to the arrival here) when the messages
carry one (without, neither their header nor values).
Exits 0 once N messages arrived (N = 0: no limit) or when nothing arrived
for SECS seconds; every message it took is accepted (dequeued) before it
exits. Exit 1 with the broker's message when the queue is refused or the
broker cannot be reached; 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import trio

import qflow
from qflow.protocol.names import printable

from ._addresses import BrokerUrl
from ._errors import fail
from ._options import (
    add_broker_option,
    add_connection_options,
    client_setup,
    non_negative,
    positive,
    seconds_or_zero,
    yes_no,
)
from ._output import PROGRESS_MIN, progress_bar
from ._qpid_address import AddressOptionsError, parse_qpid_address

PROG = "qflow-receive"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Receive messages from a qflow queue.")
    add_broker_option(p)
    p.add_argument("-a", "--address", required=True, metavar="QUEUE",
                   help="the queue to receive from; Qpid's 'QUEUE; {mode: browse}' browses it")
    p.add_argument("-m", "--messages", type=non_negative, default=0, metavar="N",
                   help="stop after N messages (default 0: no limit)")
    wait = p.add_mutually_exclusive_group()
    wait.add_argument("--timeout", type=seconds_or_zero, default=1.0, metavar="SECS",
                      help="stop when no message arrived for SECS seconds (default 1; 0: wait forever)")
    wait.add_argument("-f", "--forever", action="store_true", help="never stop for want of messages")
    p.add_argument("--print-content", type=yes_no, default=True, metavar="yes|no",
                   help="print each body on its own line (default yes)")
    p.add_argument("--capacity", type=non_negative, default=1000, metavar="N",
                   help="messages the broker may send ahead: the credit window (default 1000; 0: no prefetch, "
                        "one message at a time)")
    p.add_argument("--ack-frequency", type=positive, default=100, metavar="N",
                   help="accept received messages in batches of N (default 100)")
    p.add_argument("--print-headers", type=yes_no, nargs="?", const=True, default=False, metavar="yes|no",
                   help="print each message's headers (routing key, ids, properties...) before its body")
    p.add_argument("--browse", action="store_true",
                   help="read without removing: the messages stay on the queue (Qpid's {mode: browse})")
    p.add_argument("--report-total", action="store_true", help="print the totals and the throughput at the end")
    add_connection_options(p, PROG)
    return p


class Latency:
    """qpid-receive's latency statistics, in ms: from each message's ``ts``
    property (its send time, ns since the epoch) to its arrival."""

    __slots__ = ("samples", "total", "low", "high")

    def __init__(self) -> None:
        self.samples = 0
        self.total = 0.0
        self.low = float("inf")
        self.high = 0.0

    def add(self, sent_ns: object) -> None:
        if type(sent_ns) is not int:  # no stamp (or not one we know): the message counts for throughput only
            return
        # Clocks of two hosts may disagree a little: a negative latency counts as 0.
        ms = max(time.time_ns() - sent_ns, 0) / 1e6
        self.samples += 1
        self.total += ms
        self.low = min(self.low, ms)
        self.high = max(self.high, ms)

    def columns(self) -> str:
        """The three columns as qpid-receive prints them (none without a sample)."""
        if not self.samples:
            return ""
        return f"\t{self.low:.2f}\t{self.high:.2f}\t{self.total / self.samples:.2f}"


def headers_text(msg: qflow.ReceivedMessage) -> str:
    """A message's headers as --print-headers shows them: one ``Name: value`` a line, those that
    are set, the application properties last (as JSON, or their repr if JSON cannot hold them)."""
    lines = [("Exchange", msg.exchange), ("RoutingKey", msg.routing_key), ("MessageId", msg.message_id),
             ("CorrelationId", msg.correlation_id), ("ContentType", msg.content_type),
             ("Durable", "true" if msg.durable else None), ("Redelivered", "true" if msg.redelivered else None),
             ("Sequence", msg.sequence)]
    out = "".join(f"{name}: {printable(str(value))}\n" for name, value in lines if value not in (None, ""))
    try:
        properties = json.dumps(msg.headers, sort_keys=True, default=str)
    except (TypeError, ValueError):
        properties = repr(msg.headers)
    return out + f"Properties: {printable(properties)}\n"


async def receive(args: argparse.Namespace, url: BrokerUrl, options: dict[str, Any],
                  latency: Latency) -> tuple[int, int, float]:
    """Receive until done; returns (messages, bytes, seconds from the first message to the last)."""
    out = sys.stdout.buffer
    flush_each = sys.stdout.isatty()  # a person watching sees each line at once; a pipe gets big writes
    # open_connection, not connect: the connection's tasks run in this task's nursery, so none
    # outlives the run and an error of theirs reaches main() as the tool's own.
    async with qflow.open_connection(url.host, url.port, name=args.connection_name, **options) as conn:
        ssn = await conn.session()
        capacity = args.capacity or 1  # Qpid's capacity 0: no prefetch beyond the message being fetched
        receiver = await ssn.receiver(args.queue, capacity=capacity, accept="auto",
                                      ack_frequency=min(args.ack_frequency, capacity), browse=args.browse)
        limit = args.messages
        timeout = None if args.forever or args.timeout == 0 else args.timeout
        bar = progress_bar(limit or None, PROG, not args.print_content and (limit == 0 or limit >= PROGRESS_MIN))
        received = nbytes = 0
        first = last = 0.0
        report = args.report_total
        try:
            while limit == 0 or received < limit:
                try:
                    msg = await receiver.fetch(timeout)
                except qflow.Empty:
                    break
                last = trio.current_time()
                if not received:
                    first = last
                received += 1
                nbytes += len(msg.body)
                if report:
                    latency.add(msg.headers.get("ts"))
                if args.print_headers:
                    out.write(headers_text(msg).encode())
                if args.print_content:
                    out.write(msg.body + b"\n")
                    if flush_each:
                        out.flush()
                bar.update()
        finally:
            bar.close()
        # Accept what was taken and wait for the broker to have it: a message
        # printed here must be gone from the queue once we exit.
        await receiver.close()
        out.flush()
        return received, nbytes, last - first


def queue_and_mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.queue`` and ``args.browse`` from -a (Qpid's ``QUEUE; {mode: browse}``) and --browse.

    Raises:
      SystemExit: status 2 for options that are not a Qpid map, or that qflow-receive does not take.
    """
    try:
        args.queue, address_options = parse_qpid_address(args.address)
    except AddressOptionsError as exc:
        parser.error(f"-a {args.address!r}: {exc}")
    unknown = sorted(set(address_options) - {"mode"})
    if unknown:  # refused rather than ignored: {create: always} would otherwise seem to declare the queue
        parser.error(f"-a {args.address!r}: address option{'s' if len(unknown) > 1 else ''} "
                     f"{', '.join(map(repr, unknown))} not supported (qflow-receive takes mode)")
    mode = address_options.get("mode", "consume")
    if mode not in ("browse", "consume"):
        parser.error(f"-a {args.address!r}: mode must be browse or consume, not {mode!r}")
    args.browse = args.browse or mode == "browse"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, url, options = client_setup(parser, argv)
    queue_and_mode(parser, args)
    try:
        latency = Latency()
        received, nbytes, seconds = trio.run(receive, args, url, options, latency)
    except qflow.QflowError as exc:
        return fail(PROG, exc.text)
    except BrokenPipeError:
        # Whoever read our output (head, say) has gone: stop quietly, and keep
        # Python from complaining when it flushes stdout on the way out.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        return fail(PROG, f"cannot connect to {url.host}:{url.port}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130
    if args.report_total:  # qpid-receive's columns, tab-separated; the latencies only if messages had a ts
        print("tp(m/s)\tl-min\tl-max\tl-avg" if latency.samples else "tp(m/s)")
        print(f"{received / seconds if seconds > 0 else 0.0:.0f}{latency.columns()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""qflow-send: send messages to a qflow broker, as qpid-send does to qpidd.

    qflow-send -b HOST:PORT -a ADDRESS [--messages N] [--content-string S | --content-size N |
               --content-stdin] [--capacity N] [--durable yes|no] [--send-rate N] [--timestamp yes|no]
               [--report-total]

ADDRESS is a queue name (sent through the default exchange) or
``EXCHANGE/ROUTING-KEY``; it must exist, as a Qpid address must resolve.
``--capacity`` is the sender window: how many transfers may be incomplete
at once. When a destination queue's flow control holds completions, sending
pauses after that many (a warning says which queue every few seconds).
``--timestamp yes`` puts each message's send time in the property ``ts``
(nanoseconds since the epoch, as qpid-send does), from which qflow-receive
``--report-total`` computes latencies. Unlike qpid-send, the default is no:
a stamped message's properties differ from the last one's, so it cannot
join a run of transfers, and sending is about nine times slower.

Exit 0 only once every transfer is complete; 1 with the broker's message when
a transfer (or the address) is refused or the broker cannot be reached; 2 for
a usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import trio

import qflow
from qflow.client.pacing import pace

from ._addresses import BrokerUrl
from ._errors import fail, single_error
from ._options import (
    add_broker_option,
    add_connection_options,
    client_setup,
    non_negative,
    positive_float,
    seconds_or_zero,
    yes_no,
)
from ._output import PROGRESS_MIN, bar_logging, progress_bar, show_held

PROG = "qflow-send"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Send messages to a qflow broker.")
    add_broker_option(p)
    p.add_argument("-a", "--address", required=True, help="QUEUE, or EXCHANGE/ROUTING-KEY")
    p.add_argument("-m", "--messages", type=non_negative, default=None, metavar="N",
                   help="messages to send (default 1, or every line with --content-stdin)")
    content = p.add_mutually_exclusive_group()
    content.add_argument("--content-string", metavar="S", help="the body of every message")
    content.add_argument("--content-size", type=non_negative, metavar="N", help="bodies of N bytes ('X' each)")
    content.add_argument("--content-stdin", action="store_true", help="one message per line of standard input")
    p.add_argument("--capacity", type=non_negative, default=1000, metavar="N",
                   help="transfers that may be incomplete at once: the sender window (default 1000); "
                        "0: each send waits for the previous one to complete")
    p.add_argument("--durable", type=yes_no, nargs="?", const=True, default=False, metavar="yes|no",
                   help="mark messages persistent: kept across a restart on a durable queue, and each "
                        "transfer completes only once it is on disk (default no)")
    p.add_argument("--send-rate", type=seconds_or_zero, default=0, metavar="N",
                   help="send at most N messages a second (default 0: no limit)")
    p.add_argument("--flow-timeout", type=positive_float, metavar="SECS",
                   help="give up (exit 1) after waiting SECS for broker flow control (default: wait)")
    p.add_argument("--timestamp", type=yes_no, default=False, metavar="yes|no",
                   help="put the send time in each message's 'ts' property, for qflow-receive's latency "
                        "columns (default no: qpid-send's is yes, but stamped sends are ~9x slower)")
    p.add_argument("--report-total", action="store_true", help="print the totals and the throughput at the end")
    add_connection_options(p, PROG)
    return p


def bodies(args: argparse.Namespace) -> Iterator[bytes]:
    if args.content_stdin:
        limit = args.messages
        for n, line in enumerate(sys.stdin.buffer):
            if limit is not None and n >= limit:
                return
            yield line.rstrip(b"\r\n")
        return
    count = 1 if args.messages is None else args.messages
    if args.content_size is not None:
        body = b"X" * args.content_size
    else:
        body = (args.content_string or "").encode()
    for _ in range(count):
        yield body


async def send(args: argparse.Namespace, url: BrokerUrl, options: dict[str, Any]) -> tuple[int, int, float]:
    """Send everything and wait for every completion. Returns (messages, bytes, seconds)."""
    # open_connection, not connect: the connection's tasks run in this task's nursery, so none
    # outlives the run and an error of theirs reaches main() as the tool's own.
    async with qflow.open_connection(url.host, url.port, name=args.connection_name, **options) as conn:
        ssn = await conn.session()
        exchange, slash, key = args.address.partition("/")
        if slash:
            await ssn.declare_exchange(exchange, passive=True)
        else:
            await ssn.query_queue(args.address)
        # Qpid's 0s: capacity 0 is a synchronous sender (one transfer in flight), rate 0 no limit.
        # The rate is kept here, not by the sender, so that a message's ts is taken after any
        # pacing sleep (as qpid-send's is): the latency it carries is the message's, not the pacing's.
        sender = ssn.sender(args.address, capacity=args.capacity or 1, flow_timeout=args.flow_timeout,
                            durable=args.durable)
        interval = 1.0 / args.send_rate if args.send_rate else 0.0
        slot = 0.0
        total = None if args.content_stdin else (1 if args.messages is None else args.messages)
        bar = progress_bar(total, PROG, total is None or total >= PROGRESS_MIN)
        started = trio.current_time()
        sent = nbytes = 0
        try:
            with bar_logging(bar):
                try:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(show_held, bar, ssn.held_by, ssn.holders)
                        stamp = time.time_ns if args.timestamp else None
                        for body in bodies(args):
                            if interval:
                                slot = await pace(slot, interval)
                            if stamp is None:
                                await sender.send(body)
                            else:  # qpid-send's "ts": the wall clock, so that another host can compare
                                await sender.send(body, headers={"ts": stamp()})
                            sent += 1
                            nbytes += len(body)
                            bar.update()
                        await sender.sync()  # "exits 0 only after every transfer is complete"
                        nursery.cancel_scope.cancel()
                except BaseExceptionGroup as group:  # the refusal itself, as main() reports it
                    raise single_error(group) from None
        finally:
            bar.close()
        return sent, nbytes, trio.current_time() - started


def main(argv: list[str] | None = None) -> int:
    args, url, options = client_setup(build_parser(), argv)
    # The client warns through logging while flow control holds the sender: show it.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format=f"{PROG}: %(message)s")
    try:
        sent, nbytes, seconds = trio.run(send, args, url, options)
    except qflow.QflowError as exc:
        return fail(PROG, exc.text)
    except OSError as exc:
        return fail(PROG, f"cannot connect to {url.host}:{url.port}: {exc.strerror or exc}")
    except KeyboardInterrupt:
        return 130
    if args.report_total:  # qpid-send's columns: the throughput of the whole run
        print("tp(m/s)")
        print(f"{sent / seconds if seconds > 0 else 0.0:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

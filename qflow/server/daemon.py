"""qflowd's composition root: one broker, its protocol listener and its
management server, run until SIGINT or SIGTERM. ``qflow.cli.qflowd`` parses
the command line and calls :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
from collections.abc import Awaitable, Callable

import trio

from qflow.broker import Broker
from qflow.broker.accounting import load_accounting
from qflow.management import ManagementApi, ManagementServer
from qflow.server.listener import Server


class ListenError(Exception):
    """A listener could not be opened; main() turns it into one line and exit 1."""

    def __init__(self, what: str, host: str, port: int, exc: OSError) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}")


async def _start(nursery: trio.Nursery, what: str, serve: Callable[..., Awaitable[None]], host: str,
                 port: int) -> int:
    try:
        return await nursery.start(serve, host, port)
    except OSError as exc:
        raise ListenError(what, host, port, exc) from None


async def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM; prints ``qflowd ready port=P mgmt-port=M``
    once both ports listen. Raises ListenError if either cannot be opened."""
    accounting = load_accounting()
    logging.getLogger("qflow").info("accounting: %s", accounting.name)
    broker = Broker(args.defaults, accounting)
    server = Server(broker, args.max_frame_size)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            port = await _start(nursery, "protocol", server.serve, args.host, args.port)
            options = {"host": args.host, "port": port, "maxFrameSize": args.max_frame_size,
                       "mgmtTimeout": args.mgmt_timeout}
            api = ManagementApi(broker, server, options)
            mgmt = ManagementServer(api, timeout=args.mgmt_timeout)
            mgmt_port = await _start(nursery, "management", mgmt.serve, args.host, args.mgmt_port)
            api.options["mgmtPort"] = mgmt_port
            # Long-lived start-up objects need no more cyclic-GC scans.
            gc.collect()
            gc.freeze()
            print(f"qflowd ready port={port} mgmt-port={mgmt_port}", flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break

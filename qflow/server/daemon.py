"""qflowd's composition root: one broker, its protocol listener and its
management server, run until SIGINT or SIGTERM. ``qflow.cli.qflowd`` parses
the command line and calls :func:`run`.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import trio

from qflow.broker import Broker
from qflow.broker.accounting import load_accounting
from qflow.broker.config_hooks import ConfigHooks
from qflow.management import ManagementApi, ManagementServer
from qflow.server.listener import Server
from qflow.store import ConfigStore, DataDir

log = logging.getLogger("qflow")


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


def open_store(broker: Broker, data_dir: str, resources: ExitStack) -> str:
    """Lock the data directory, then rebuild ``broker``'s durable configuration
    from it; both are released by ``resources``. Returns the directory's path.
    Raises StoreError (locked, unreadable, or a configuration the broker refuses)."""
    started = time.monotonic()
    datadir = DataDir.open(data_dir)
    resources.callback(datadir.close)
    store = ConfigStore.open(datadir.path)
    resources.callback(store.close)
    queues, exchanges, bindings = store.restore(broker)
    log.info("recovered %d queues, %d exchanges, %d bindings from %s in %.1f ms", queues, exchanges, bindings,
             datadir.path, (time.monotonic() - started) * 1000)
    return str(datadir.path)


async def run(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM; prints ``qflowd ready port=P mgmt-port=M``
    once both ports listen. The data directory (``args.data_dir``; None: in
    memory only) is locked and its configuration recovered before anything
    listens. Raises ListenError if a port cannot be opened, StoreError if the
    data directory cannot be used."""
    accounting = load_accounting()
    log.info("accounting: %s", accounting.name)
    broker = Broker(args.defaults, accounting)
    server = Server(broker, args.max_frame_size)
    with ExitStack() as resources:
        data_dir = None
        if args.data_dir is not None:
            data_dir = open_store(broker, args.data_dir, resources)
        else:
            log.info("no data directory: nothing survives a restart")
        await _serve(args, broker, server, data_dir)


async def _serve(args: argparse.Namespace, broker: Broker, server: Server, data_dir: str | None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            port = await _start(nursery, "protocol", server.serve, args.host, args.port)
            options = {"host": args.host, "port": port, "maxFrameSize": args.max_frame_size,
                       "mgmtTimeout": args.mgmt_timeout, "dataDir": data_dir}
            api = ManagementApi(broker, server, options)
            mgmt = ManagementServer(api, timeout=args.mgmt_timeout)
            mgmt_port = await _start(nursery, "management", mgmt.serve, args.host, args.mgmt_port)
            api.options["mgmtPort"] = mgmt_port
            # Long-lived start-up objects need no more cyclic-GC scans.
            gc.collect()
            gc.freeze()
            print(f"qflowd ready port={port} mgmt-port={mgmt_port}", flush=True)
            async for _ in signals:
                # Shutting down closes every session, which deletes exclusive and auto-delete queues: those
                # deletions are nobody's request, so they are not recorded, and a clean stop recovers what a
                # crash would.
                broker.config_hooks = ConfigHooks()
                nursery.cancel_scope.cancel()
                break

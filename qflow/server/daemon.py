"""qflowd's composition root: one broker, its protocol listener and its
management server, run until SIGINT or SIGTERM. ``qflow.cli.qflowd`` parses
the command line and calls :func:`run`.

With a data directory, start-up is: lock it, restore the durable
configuration (``config.log``), recover the message journal (``journal/``),
start the store's committer task, put the recovered messages back on their
queues, and only then listen. If the committer fails (a write or a sync),
the daemon stops with exit 1: persistent transfers could no longer be
completed truthfully.
"""

from __future__ import annotations

import argparse
import gc
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

import trio

from qflow.broker import Broker
from qflow.broker.accounting import load_accounting
from qflow.broker.config_hooks import ConfigHooks
from qflow.broker.memory_alarm import MemoryAlarm
from qflow.management import ManagementApi, ManagementServer
from qflow.protocol.entries import Entry
from qflow.server.listener import Server
from qflow.server.memory_monitor import run_memory_monitor
from qflow.server.store_task import run_store
from qflow.store import ConfigStore, DataDir, StoreError
from qflow.store.journal import Journal
from qflow.store.message_store import MessageStore
from qflow.store.quota import QuotaLimits

log = logging.getLogger("qflow")

JOURNAL_DIR = "journal"  # the message journal's subdirectory of the data directory


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
        journal = None
        if args.data_dir is not None:
            data_dir = open_store(broker, args.data_dir, resources)
            journal = Journal(Path(data_dir) / JOURNAL_DIR, segment_size=args.store_segment_size)
            resources.callback(journal.close)  # after _serve: its nursery has waited for the last sync
        else:
            log.info("no data directory: nothing survives a restart")
        await _serve(args, broker, server, data_dir, journal)


def _recover(journal: Journal) -> dict[str, list[Entry]]:
    try:
        return journal.recover()
    except OSError as exc:
        raise StoreError(f"cannot read the message journal in {journal.directory}: {exc.strerror or exc}") from None


async def _run_store(broker: Broker, journal: Journal, quota: QuotaLimits,
                     task_status: trio.TaskStatus[MessageStore] = trio.TASK_STATUS_IGNORED) -> None:
    """run_store, its failure turned into StoreError: the nursery then cancels
    everything and qflowd exits 1. Persistent transfers still held stay
    incomplete: their producers see the connection drop, never a completion."""
    try:
        await run_store(broker, journal, quota, task_status=task_status)
    except Exception as exc:
        log.critical("store: writing the message journal in %s failed (%s: %s); stopping: persistent messages "
                     "can no longer be made durable", journal.directory, type(exc).__name__, exc)
        raise StoreError(f"the message journal in {journal.directory} could not be written: {exc}") from exc


async def _open_messages(nursery: trio.Nursery, broker: Broker, journal: Journal,
                         quota: QuotaLimits) -> MessageStore:
    """Recover the journal, start the committer, put the recovered messages back
    (the durable queues are declared already: the configuration comes first)."""
    started = time.monotonic()
    recovered = _recover(journal)
    store: MessageStore = await nursery.start(_run_store, broker, journal, quota)
    # MessageStore.restore keeps (in the journal, undelivered) the messages of a queue that is no
    # longer declared: deleting a queue is journalled, so that happens only if config.log lost the
    # queue (damaged, edited), and then the messages must not be destroyed by a configuration error.
    store.restore(recovered)
    restored = [entries for name, entries in recovered.items()
                if (q := broker.queues.get(name)) is not None and q.durable]
    messages, queues = sum(len(entries) for entries in restored), len(restored)
    log.info("recovered %d messages on %d queues from %s in %.1f ms", messages, queues, journal.directory,
             (time.monotonic() - started) * 1000)
    return store


async def _serve(args: argparse.Namespace, broker: Broker, server: Server, data_dir: str | None,
                 journal: Journal | None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            store = None
            if journal is not None:
                store = await _open_messages(nursery, broker, journal, args.store_quota)
            alarm = MemoryAlarm(broker, args.memory_high, args.memory_low)
            if alarm.high:
                log.info("memory alarm: high watermark %d bytes, low watermark %d bytes", alarm.high, alarm.low)
                nursery.start_soon(run_memory_monitor, alarm)
            else:
                log.info("memory alarm: off (--memory-high-watermark 0)")
            port = await _start(nursery, "protocol", server.serve, args.host, args.port)
            options = {"host": args.host, "port": port, "maxFrameSize": args.max_frame_size,
                       "mgmtTimeout": args.mgmt_timeout, "dataDir": data_dir,
                       "storeOverfullSize": args.store_quota.overfull if journal is not None else None,
                       "storeUnderfullSize": args.store_quota.resume if journal is not None else None,
                       "storeSegmentSize": journal.segment_size if journal is not None else None}
            api = ManagementApi(broker, server, options, store=store, memory=alarm)
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

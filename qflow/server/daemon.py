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
import functools
import gc
import logging
import os
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import trio

from qflow.auth.users_file import SaslDb
from qflow.broker import Broker
from qflow.broker.accounting import load_accounting
from qflow.broker.acl import Acl, AclError, parse
from qflow.broker.config_hooks import ConfigHooks
from qflow.broker.memory_alarm import MemoryAlarm
from qflow.management import ManagementApi, ManagementServer, RequestGuard
from qflow.protocol.entries import Entry
from qflow.protocol.sasl import check_password, decoy_verifier
from qflow.server.admission import serve_listeners
from qflow.server.amqp_pump import DEFAULT_CREDIT_WINDOW
from qflow.server.listener import Server
from qflow.server.memory_monitor import run_memory_monitor
from qflow.server.store_task import run_store
from qflow.store import DataDir, DefinitionStore, StoreError
from qflow.store.journal import Journal
from qflow.store.message_store import MessageStore
from qflow.store.quota import QuotaLimits

log = logging.getLogger("qflow")

JOURNAL_DIR = "journal"  # the message journal's subdirectory of the data directory


class TlsError(Exception):
    """The TLS certificate or key cannot be used; main() turns it into one line and exit 1."""


def server_ssl_context(cert_file: str, key_file: str | None, ca_file: str | None = None,
                       require_client_auth: bool = False) -> ssl.SSLContext:
    """The TLS context of --ssl-port and of the management port: the broker's
    certificate chain and key (PEM). With ``ca_file`` (--ssl-ca-file), a client
    certificate is asked for and must be signed by one of its CAs (only
    those: not the system's); ``require_client_auth``
    (--ssl-require-client-authentication): a client without one is refused in
    the handshake."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        what = f"--ssl-cert-file {cert_file}" + (f" / --ssl-key-file {key_file}" if key_file else "")
        raise TlsError(f"cannot load {what}: {getattr(exc, 'strerror', None) or exc}") from None
    if ca_file is not None:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            raise TlsError(f"cannot load --ssl-ca-file {ca_file}: {getattr(exc, 'strerror', None) or exc}") \
                from None
        context.verify_mode = ssl.CERT_REQUIRED if require_client_auth else ssl.CERT_OPTIONAL
    return context


class AclFileError(ValueError):
    """The ACL file cannot be read or is refused (naming its line): exit 1 at
    start, a 400 on reload with the old rules kept."""


def load_acl(path: str) -> Acl:
    """The rules of the ACL file ``path``; raises AclFileError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise AclFileError(f"cannot read --acl-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        return parse(text)
    except AclError as exc:
        raise AclFileError(f"--acl-file {path}: {exc}") from None


def acl_reloader(broker: Broker, path: str) -> Callable[[], dict[str, object]]:
    """The management API's reload: the file read and parsed whole before its rules replace the old ones."""

    def reload() -> dict[str, object]:
        acl = load_acl(path)
        broker.set_acl(acl)
        log.info("ACL reloaded from %s: %d rules, %d groups", path, len(acl.rules), len(acl.groups))
        return {"aclFile": path, "rules": len(acl.rules), "groups": len(acl.groups), "reloaded": True}

    return reload


class ListenError(Exception):
    """A listener could not be opened; main() turns it into one line and exit 1."""

    def __init__(self, what: str, host: str, port: int, exc: OSError) -> None:
        super().__init__(f"cannot listen on {host}:{port} ({what}): {exc.strerror or exc}")


async def _start(nursery: trio.Nursery, what: str, serve: Callable[..., Awaitable[None]], host: str,
                 port: int, *more: object) -> int:
    try:
        return await nursery.start(serve, host, port, *more)
    except OSError as exc:
        raise ListenError(what, host, port, exc) from None


def open_users(args: argparse.Namespace) -> SaslDb | None:
    """The users clients authenticate as (``--auth yes``), or None (``--auth
    no``: ANONYMOUS, anyone). Raises SaslDbError if the file cannot be read."""
    if not args.auth:
        log.info("authentication off (--auth no): ANONYMOUS is offered, and any user named is believed")
        return None
    users = SaslDb.open(args.sasl_db)
    log.info("authentication on: %d users in %s (SCRAM-SHA-256, PLAIN)", len(users.users), users.path)
    return users


def management_authenticator(users: SaslDb | None, secret: bytes) -> Callable[[str, str], bool] | None:
    """HTTP Basic for the management API, against the same users (None with --auth no)."""
    if users is None:
        return None

    def authenticate(user: str, password: str) -> bool:
        verifier = users.verifier(user)
        # An unknown user costs the same hashing as a known one.
        ok = check_password(verifier or decoy_verifier(user, secret, users.usual_iterations), password)
        return ok and verifier is not None

    return authenticate


def open_store(broker: Broker, data_dir: str, resources: ExitStack) -> str:
    """Lock the data directory, then rebuild ``broker``'s durable configuration
    from it; both are released by ``resources``. Returns the directory's path.
    Raises StoreError (locked, unreadable, or a configuration the broker refuses)."""
    started = time.monotonic()
    datadir = DataDir.open(data_dir)
    resources.callback(datadir.close)
    store = DefinitionStore.open(datadir.path)
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
    data directory cannot be used, AclFileError if the ACL file is refused."""
    accounting = load_accounting()
    log.info("accounting: %s", accounting.name)
    broker = Broker(args.defaults, accounting)
    acl_file = args.acl_file
    if acl_file is not None:
        acl = load_acl(acl_file)
        broker.set_acl(acl)
        log.info("ACL: %d rules, %d groups from %s (what no rule allows is denied)", len(acl.rules),
                 len(acl.groups), acl_file)
    users = open_users(args)
    tls = None
    if args.ssl_cert_file:
        tls = server_ssl_context(args.ssl_cert_file, args.ssl_key_file, args.ssl_ca_file,
                                 args.ssl_require_client_auth)
        log.info("TLS: certificate %s; client certificates: %s", args.ssl_cert_file,
                 f"required, signed by a CA of {args.ssl_ca_file}" if args.ssl_require_client_auth else
                 f"optional, signed by a CA of {args.ssl_ca_file}" if args.ssl_ca_file else "not asked for")
        if args.require_encryption:
            log.info("--require-encryption: plain connections on the messaging port are refused")
    server = Server(broker, args.max_frame_size, users, args.limits,
                    amqp_credit=getattr(args, "amqp_credit_window", DEFAULT_CREDIT_WINDOW),
                    queue_patterns=getattr(args, "queue_patterns", ()))
    with ExitStack() as resources:
        data_dir = None
        journal = None
        if args.data_dir is not None:
            data_dir = open_store(broker, args.data_dir, resources)
            journal = Journal(Path(data_dir) / JOURNAL_DIR, segment_size=args.store_segment_size)
            resources.callback(journal.close)  # after _serve: its nursery has waited for the last sync
        else:
            log.info("no data directory: nothing survives a restart")
        await _serve(args, broker, server, data_dir, journal, tls)


async def _sweep_expired(broker: Broker, interval: float) -> None:
    """Every ``interval`` seconds, the expired messages of every queue go
    (Broker.expire_steps), one step per checkpoint: a queue nobody reads
    releases the producers its expired messages held."""
    while True:
        await trio.sleep(interval)
        for _ in broker.expire_steps():
            await trio.sleep(0)


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
                 journal: Journal | None, tls: ssl.SSLContext | None) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            store = None
            if journal is not None:
                store = await _open_messages(nursery, broker, journal, args.store_quota)
            interval = args.queue_purge_interval
            if interval and interval > 0:
                nursery.start_soon(_sweep_expired, broker, interval)
            alarm = MemoryAlarm(broker, args.memory_high, args.memory_low)
            if alarm.high:
                log.info("memory alarm: high watermark %d bytes, low watermark %d bytes", alarm.high, alarm.low)
                nursery.start_soon(partial(run_memory_monitor, alarm, gate=server.publish_gate))
            else:
                log.info("memory alarm: off (--memory-high-watermark 0)")
            ssl_port = None
            if tls is not None:
                ssl_port = await _start(nursery, "TLS", server.serve, args.host, args.ssl_port, tls)
            plain = server.serve
            if args.require_encryption:
                # qpidd's --require-encryption: the plain port still answers, with the reason and the way in.
                plain = functools.partial(server.serve, refuse=(
                    f"this broker requires encryption (--require-encryption): connect with TLS to port {ssl_port}"))
            port = await _start(nursery, "protocol", plain, args.host, args.port)
            ready = f"qflowd ready port={port}"
            # With a certificate, the management API is served over TLS on its port (with the same client
            # certificate rules): credentials sent as HTTP Basic are not to cross the network in clear.
            mgmt_tls = tls if args.mgmt_ssl else None
            limits = args.limits
            options = {"host": args.host, "port": port, "maxFrameSize": args.max_frame_size,
                       "maxConnections": limits.max_connections, "connectionLimitPerIp": limits.per_ip,
                       "connectionLimitPerUser": limits.per_user,
                       "maxNegotiateTime": round(limits.negotiate_time * 1000), "idleTimeout": limits.idle_timeout,
                       "maxUnfinishedInput": limits.max_unfinished_input,
                       "mgmtTimeout": args.mgmt_timeout, "dataDir": data_dir,
                       "storeOverfullSize": args.store_quota.overfull if journal is not None else None,
                       "storeUnderfullSize": args.store_quota.resume if journal is not None else None,
                       "storeSegmentSize": journal.segment_size if journal is not None else None,
                       "auth": server.users is not None,
                       "saslDb": str(server.users.path) if server.users is not None else None, "sslPort": ssl_port,
                       "sslRequireClientAuthentication": args.ssl_require_client_auth,
                       "requireEncryption": args.require_encryption,
                       "sslCaFile": args.ssl_ca_file, "mgmtSsl": mgmt_tls is not None,
                       "mgmtAllowedHosts": list(args.mgmt_allowed_hosts), "aclFile": args.acl_file}
            api = ManagementApi(broker, server, options, store=store, memory=alarm,
                                reload_acl=acl_reloader(broker, args.acl_file) if args.acl_file else None)
            mgmt = ManagementServer(api, timeout=args.mgmt_timeout,
                                    authenticate=management_authenticator(server.users, server.secret),
                                    guard=RequestGuard(args.mgmt_allowed_hosts),
                                    serve_listeners=serve_listeners)
            mgmt_port = await _start(nursery, "management", mgmt.serve, args.host, args.mgmt_port, mgmt_tls)
            api.options["mgmtPort"] = mgmt_port
            # The tools take the broker's one address (as Qpid's do) and learn the management port from the
            # connection.open-ok. A wildcard host is the client's to fill in: it knows which address reached us.
            server.announce["management_port"] = mgmt_port
            server.announce["management_scheme"] = "https" if mgmt_tls is not None else "http"
            # Long-lived start-up objects need no more cyclic-GC scans.
            gc.collect()
            gc.freeze()
            log.info("qflowd started (pid %d): port %d, management port %d (%s)%s, data directory %s",
                     os.getpid(), port, mgmt_port, "https" if mgmt_tls is not None else "http", f", TLS port {ssl_port}" if ssl_port is not None else "", data_dir or "none")
            ready += f" mgmt-port={mgmt_port}" + (f" ssl-port={ssl_port}" if ssl_port is not None else "")
            print(ready, flush=True)
            async for signum in signals:
                log.info("qflowd stopping on %s: closing %d connections", signal.Signals(signum).name,
                         len(server.connections))
                # Shutting down closes every session, which deletes exclusive and auto-delete queues: those
                # deletions are nobody's request, so they are not recorded, and a clean stop recovers what a
                # crash would.
                broker.config_hooks = ConfigHooks()
                nursery.cancel_scope.cancel()
                break

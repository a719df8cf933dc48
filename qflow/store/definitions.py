"""Durable definitions: the durable queues, exchanges and bindings (what
qpidd calls the durable configuration, RabbitMQ the definitions), kept in
``DIR/config.log`` so that a restarted broker has them again.

**What is kept.** A queue declared durable, with its arguments exactly as
given (and as changed by queue.modify), so its limits and flow thresholds
resolve again as they did; an exchange declared durable; a binding whose
exchange and queue are both durable (the built-in ``amq.*`` exchanges are
durable, the default exchange's bindings are implicit). Nothing non-durable is
ever written. Exclusivity is not kept, as in qpidd (which stores no owner):
the owning session is gone after a restart, so a durable exclusive queue comes
back as an ordinary durable queue anyone may use. ``auto_delete`` is kept: the
queue is deleted when the last consumer of its new life goes.

**The format: an append-only log, one record per change, compacted.** Each
change appends one record and ``fdatasync``s it before the broker makes the
change (qflow.broker.config_hooks), so a command that completed is on disk.
Appending costs one small write and one sync whatever the size of the
configuration, where rewriting a whole file per change (temp file, fsync,
rename, fsync of the directory) costs O(size) and two syncs: declaring 10,000
durable queues would write 10,000 growing files. The log is rewritten
compactly (one record per live object) through a temp file, fsync, rename and
fsync of the directory only at start-up, when it holds more records than live
objects, and at run time once dead records dominate; a crash at any point
leaves either the old log or the new one.

The framing is every store file's (qflow.store.records; docs/store.md)::

    record  = u32 length | u32 crc32(payload) | payload        little-endian
    payload = msgpack [kind, fields...]
      ["qflow-config", version]               the first record of every log
      ["queue", name, auto_delete, arguments] declared, or its arguments changed
      ["queue-deleted", name]                  and every binding to it
      ["exchange", name, type]
      ["exchange-deleted", name]               and every binding from it
      ["bind", exchange, queue, key]
      ["unbind", exchange, queue, key]

**Recovery** reads the records in order and stops at the first bad one (short,
bad length, crc mismatch, or not a record we know), keeps everything before it
and logs what it dropped and why, with the offset: the same rule as the
message journal's. A torn record can only be the change whose command never
completed. The damaged file is kept beside the new one
(``config.log.damaged-TIME``) for inspection. A first record that is not our
header is not a torn write (the log is created whole by a rename): qflowd then
refuses to start rather than replace a file it does not understand.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack

import qflow.store.records as records
from qflow import protocol as P
from qflow.broker.arguments import unsupported
from qflow.broker.config_hooks import ConfigHooks
from qflow.protocol import CommandError
from qflow.store.datadir import StoreError, fsync_dir

if TYPE_CHECKING:
    from qflow.broker import Broker
    from qflow.broker.exchange import Exchange
    from qflow.broker.queue import Queue

log = logging.getLogger("qflow.store")

CONFIG_NAME = "config.log"
MAGIC = "qflow-config"
VERSION = 1
MAX_RECORD = 64 << 20  # far above any real declaration: a larger length is damage, not data
# Rewrite at run time once the log holds this many more records than live objects.
COMPACT_SLACK = 1024


class DefinitionError(StoreError):
    """The configuration log cannot be used, or what it holds cannot be restored."""


def frame(record: list[Any]) -> bytes:
    """One definition record, framed as every store file's records are (qflow.store.records)."""
    return records.frame(msgpack.packb(record))


class DurableConfig:
    """The durable configuration as the log describes it: what a restart rebuilds."""

    def __init__(self) -> None:
        self.queues: dict[str, tuple[bool, dict[str, Any]]] = {}  # name -> (auto_delete, arguments)
        self.exchanges: dict[str, tuple[str, dict[str, Any]]] = {}  # name -> (type, arguments)
        self.bindings: dict[tuple[str, str, str], None] = {}  # (exchange, queue, key), in bind order

    def apply(self, record: Any) -> None:
        """Apply one record; ValueError if it is not one we write."""
        if not isinstance(record, list) or not record or not isinstance(record[0], str):
            raise ValueError("not a [kind, ...] list")
        kind, fields = record[0], record[1:]
        if kind == "queue" and _shape(fields, str, bool, dict):
            self.queues[fields[0]] = (fields[1], fields[2])
        elif kind == "queue-deleted" and _shape(fields, str):
            self.queues.pop(fields[0], None)
            self.bindings = {b: None for b in self.bindings if b[1] != fields[0]}
        elif kind == "exchange" and _shape(fields, str, str):
            self.exchanges[fields[0]] = (fields[1], {})
        elif kind == "exchange" and _shape(fields, str, str, dict):
            self.exchanges[fields[0]] = (fields[1], fields[2])
        elif kind == "exchange-deleted" and _shape(fields, str):
            self.exchanges.pop(fields[0], None)
            self.bindings = {b: None for b in self.bindings if b[0] != fields[0]}
        elif kind == "bind" and _shape(fields, str, str, str):
            self.bindings[(fields[0], fields[1], fields[2])] = None
        elif kind == "unbind" and _shape(fields, str, str, str):
            self.bindings.pop((fields[0], fields[1], fields[2]), None)
        else:
            raise ValueError(f"unknown record {kind!r} with {len(fields)} fields")

    @property
    def live(self) -> int:
        """How many records the compacted log holds after its header."""
        return len(self.queues) + len(self.exchanges) + len(self.bindings)

    def records(self) -> list[list[Any]]:
        """One record per live object: the compacted log after the header."""
        return ([["exchange", name, type_, arguments] if arguments else ["exchange", name, type_]
                 for name, (type_, arguments) in self.exchanges.items()]
                + [["queue", name, auto_delete, arguments] for name, (auto_delete, arguments) in self.queues.items()]
                + [["bind", *binding] for binding in self.bindings])


def _shape(fields: list[Any], *types: type) -> bool:
    return len(fields) == len(types) and all(isinstance(f, t) for f, t in zip(fields, types, strict=True))


def read_log(data: bytes, path: Path) -> tuple[DurableConfig, int, int, str | None]:
    """Replay a log's bytes: (config, records read, good bytes, why it stopped early or None).
    Raises DefinitionError if the first record is not our header."""
    config = DurableConfig()
    pos = count = 0
    while pos < len(data):
        why = None
        try:
            payload = records.read_record(data, pos, MAX_RECORD)
        except records.BadRecord as exc:
            why = str(exc)
        else:
            end = pos + records.HEAD_SIZE + len(payload)
            try:
                record = msgpack.unpackb(payload, raw=False, strict_map_key=False)
                if count == 0:
                    _check_header(record, path)
                else:
                    config.apply(record)
            except ValueError as exc:  # msgpack's errors are ValueErrors too
                why = f"undecodable record ({exc})"
        if why is not None:
            if count == 0:
                raise DefinitionError(f"{path} is not a qflow configuration log (its first record: {why}); "
                                  "move it away to start with an empty configuration")
            return config, count, pos, why
        pos = end
        count += 1
    if count == 0:
        raise DefinitionError(f"{path} is empty, not a qflow configuration log; move it away to start with an "
                          "empty configuration")
    return config, count, pos, None


def _check_header(record: Any, path: Path) -> None:
    if not (isinstance(record, list) and len(record) == 2 and record[0] == MAGIC and isinstance(record[1], int)):
        raise DefinitionError(f"{path} is not a qflow configuration log (no {MAGIC!r} header); move it away to "
                          "start with an empty configuration")
    if record[1] != VERSION:
        raise DefinitionError(f"{path} is format version {record[1]}; this qflowd reads version {VERSION}")


class DefinitionStore(ConfigHooks):
    """The configuration log of one data directory, as the broker's config hooks.

    :meth:`open` reads and replays the log; :meth:`restore` declares what it
    holds into a fresh broker and then installs itself as the broker's hooks,
    from when on every durable change is appended and synced before it is made.
    A change the log cannot take is refused (CommandError), and the broker is
    left as it was.
    """

    def __init__(self, path: Path, config: DurableConfig, fd: int | None = None, size: int = 0,
                 records: int = 0) -> None:
        self.path = path
        self.config = config
        self._fd = fd  # open for writing at _size; None until open() has a whole log
        self._size = size  # bytes of whole, synced records: the next record goes here
        self._records = records
        self._broken: str | None = None  # why appending is no longer safe

    # -- opening and recovery -------------------------------------------------
    @classmethod
    def open(cls, directory: Path) -> DefinitionStore:
        """Read ``directory``'s log (creating an empty one if there is none),
        keep the good records, and leave it compact and ready to append to."""
        path = directory / CONFIG_NAME
        tmp = path.with_name(CONFIG_NAME + ".tmp")
        try:
            tmp.unlink(missing_ok=True)  # a compaction that a crash interrupted; the log itself is whole
            data = path.read_bytes() if path.exists() else None
        except OSError as exc:
            raise DefinitionError(f"cannot read {path}: {exc.strerror or exc}") from None
        if data is None:
            config, count, good, why = DurableConfig(), 0, 0, None
        else:
            config, count, good, why = read_log(data, path)
        if why is not None:
            kept = path.with_name(f"{CONFIG_NAME}.damaged-{time.strftime('%Y%m%dT%H%M%S')}")
            log.error("%s: the record at offset %d is bad (%s): kept the %d records before it, dropped the "
                      "%d bytes from there to the end; the damaged file is kept as %s",
                      path, good, why, count, len(data) - good, kept.name)
            try:
                # A second name for the damaged file, not a rename: until the good prefix is rewritten
                # under the log's name (atomically, below), a crash must still find a log there.
                os.link(path, kept)
            except FileExistsError:
                if not os.path.samefile(path, kept):  # the same file is kept already if a crash cut this short
                    raise DefinitionError(f"cannot keep the damaged {path}: {kept.name} exists") from None
            except OSError as exc:
                raise DefinitionError(f"cannot keep the damaged {path} as {kept.name}: {exc.strerror or exc}") from None
        if data is None or why is not None or count > config.live + 1:
            store = cls(path, config)
            store._rewrite()
            return store
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise DefinitionError(f"cannot open {path}: {exc.strerror or exc}") from None
        return cls(path, config, fd, good, count)

    def restore(self, broker: Broker) -> tuple[int, int, int]:
        """Declare the durable configuration into ``broker`` (fresh, with no
        queues yet), then become its config hooks. Returns (queues, exchanges,
        bindings). Raises DefinitionError naming the first object the broker
        refuses: the log is kept as it is, for a broker started with the options
        it was written under."""
        c = self.config
        steps: list[tuple[str, Any]] = (
            [(f"exchange {name!r}", lambda n=name, t=type_, a=arguments: broker.declare_exchange(
                n, t, durable=True, arguments=a))
             for name, (type_, arguments) in c.exchanges.items()]
            + [(f"queue {name!r}", lambda n=name, a=auto_delete, args=arguments: broker.declare_queue(
                n, durable=True, auto_delete=a, arguments=args, recovered=True))
               for name, (auto_delete, arguments) in c.queues.items()]
            + [(f"binding {q!r} to {ex!r} with key {key!r}", lambda e=ex, q=q, k=key: broker.bind(e, q, k))
               for ex, q, key in c.bindings])
        for name, (_auto_delete, arguments) in c.queues.items():
            # Declared before qflow refused them: the queue and its messages are recovered all the same
            # (refusing would keep them from everyone), and the operator is told the arguments do nothing.
            for reason in unsupported("queue", arguments):
                log.warning("recovered queue %r: %s, and has no effect", name, reason)
        for what, step in steps:
            try:
                step()
            except CommandError as exc:
                raise DefinitionError(f"cannot recover {what} from {self.path}: {exc.text} (were the broker's options "
                                  "different when it was declared?)") from None
        broker.config_hooks = self
        return len(c.queues), len(c.exchanges), len(c.bindings)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # -- writing ----------------------------------------------------------------
    def _rewrite(self) -> None:
        """Replace the log by one record per live object: temp file, fsync, rename, fsync of the directory."""
        tmp = self.path.with_name(CONFIG_NAME + ".tmp")
        records = [[MAGIC, VERSION], *self.config.records()]
        data = b"".join(frame(r) for r in records)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, data, 0)
                os.fsync(fd)
                os.rename(tmp, self.path)
                fsync_dir(self.path.parent)
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise DefinitionError(f"cannot write {self.path}: {exc.strerror or exc}") from None
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size, self._records = fd, len(data), len(records)

    def _append(self, record: list[Any], what: str) -> None:
        """Append and sync ``record`` (the change ``what``), then apply it to the
        mirror. CommandError if it could not be made durable; the log is then as
        it was before."""
        if self._broken is not None or self._fd is None:
            raise CommandError(P.INTERNAL_ERROR, f"{what}: refused, the store cannot write {self.path} since "
                                                 f"an earlier failure ({self._broken}); restart qflowd")
        data = frame(record)
        try:
            _write_all(self._fd, data, self._size)
            os.fdatasync(self._fd)
        except OSError as exc:
            self._undo(exc)
            code = P.RESOURCE_LIMIT_EXCEEDED if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) \
                else P.INTERNAL_ERROR
            raise CommandError(code, f"{what}: refused, the store could not write it to {self.path}: "
                                     f"{exc.strerror or exc}") from None
        self._size += len(data)
        self._records += 1
        self.config.apply(record)
        if self._records > 2 * (self.config.live + 1) + COMPACT_SLACK:
            try:
                self._rewrite()
            except DefinitionError as exc:  # the change itself is safely appended: only the compaction waits
                log.warning("compacting the configuration log failed; it stays as it is: %s", exc)

    def _undo(self, exc: OSError) -> None:
        """Cut off a part-written record, so the next append does not follow garbage
        (recovery would stop there and drop it). If that fails, stop appending."""
        try:
            os.ftruncate(self._fd, self._size)
            os.fsync(self._fd)
        except OSError as again:
            self._broken = f"{exc.strerror or exc}, then truncating failed: {again.strerror or again}"
            log.error("the store cannot write %s any more: %s; durable configuration changes are refused "
                      "until qflowd restarts", self.path, self._broken)

    # -- the broker's config hooks ----------------------------------------------
    def declare_queue(self, name: str, durable: bool, auto_delete: bool, arguments: dict[str, Any]) -> None:
        if durable:
            self._append(["queue", name, auto_delete, arguments], f"queue.declare {name!r}")

    def modify_queue(self, q: Queue, arguments: dict[str, Any]) -> None:
        if q.durable:
            self._append(["queue", q.name, q.auto_delete, arguments], f"queue.modify {q.name!r}")

    def delete_queue(self, q: Queue) -> None:
        if q.name in self.config.queues:
            self._append(["queue-deleted", q.name], f"queue.delete {q.name!r}")

    def declare_exchange(self, name: str, type_: str, durable: bool, arguments: dict[str, Any]) -> None:
        if durable:
            # Without arguments, the record is as it always was (a journal written before exchanges
            # took arguments reads the same).
            record = ["exchange", name, type_, arguments] if arguments else ["exchange", name, type_]
            self._append(record, f"exchange.declare {name!r}")

    def delete_exchange(self, ex: Exchange) -> None:
        if ex.name in self.config.exchanges:
            self._append(["exchange-deleted", ex.name], f"exchange.delete {ex.name!r}")

    def bind(self, ex: Exchange, q: Queue, key: str) -> None:
        if ex.durable and q.durable:
            self._append(["bind", ex.name, q.name, key], f"exchange.bind {q.name!r} to {ex.name!r}")

    def unbind(self, ex: Exchange, q: Queue, key: str) -> None:
        if (ex.name, q.name, key) in self.config.bindings:
            self._append(["unbind", ex.name, q.name, key], f"exchange.unbind {q.name!r} from {ex.name!r}")


def _write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


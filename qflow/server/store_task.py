"""The durable store's committer task: group commit with the sync off the
event loop (docs/store.md "Group commit, on the loop and off it").

One commit is in flight at a time; whatever the broker stages while a sync
runs goes into the next one, so the sync rate follows the disk by itself.
A commit that only appends to the open segment (nearly all) is written by
the native sync thread (qflow.store.sync_thread), which takes no GIL and
wakes the task through an eventfd; the others by Journal.write_and_sync in a
trio worker thread (docs/store.md, "Group commit, on the loop and off it").
The daemon starts it once the journal is recovered and the durable queues
are declared::

    store = await nursery.start(run_store, broker, journal)

If a write or a sync fails, the task raises (the journal refuses further
commits): persistent transfers can no longer be made durable, and completing
them anyway would be a lie. The daemon should then stop.
"""

from __future__ import annotations

import logging

import trio

from qflow.broker.broker import Broker
from qflow.store import sync_thread
from qflow.store.journal import Batch, Journal
from qflow.store.message_store import MessageStore
from qflow.store.quota import QuotaLimits

log = logging.getLogger("qflow.store")


async def run_store(broker: Broker, journal: Journal, quota: QuotaLimits | None = None,
                    task_status: trio.TaskStatus[MessageStore] = trio.TASK_STATUS_IGNORED) -> None:
    """Hold ``broker``'s durable queues' transfers until ``journal`` has them
    on disk (and, while ``quota`` says the journal is overfull, until it is
    underfull again); runs until cancelled. ``journal`` must be recovered already.
    Reports the :class:`MessageStore` through ``task_status``."""
    poked = trio.Event()

    def wake() -> None:  # called on the loop, possibly inside the broker's apply: only signal
        poked.set()

    store = MessageStore(broker, journal, wake, quota)
    sync = None
    if sync_thread.wanted():
        try:
            sync = sync_thread.SyncThread()
        except OSError as exc:  # every commit is then written by a worker thread: slower, as durable
            log.warning("store: %s; commits are written by a worker thread instead", exc)
    try:
        task_status.started(store)
        while True:
            await poked.wait()
            poked = trio.Event()
            commit = store.prepare()
            if commit is None:
                continue
            if commit.batch is not None:
                await _write(journal, commit.batch, sync)
            store.finish(commit)
    finally:
        if sync is not None:
            sync.close()


async def _write(journal: Journal, batch: Batch, sync: sync_thread.SyncThread | None) -> None:
    """Make ``batch`` durable: in the native sync thread if it only appends to
    the open segment, else in a worker thread."""
    fd = journal.fd_for(batch) if sync is not None else -1
    try:
        # Not cancellable: a commit abandoned half way would leave the journal's two sides out
        # of step; shutdown waits for at most one sync (to_thread's default; shielded here).
        if fd >= 0:
            sync.submit(fd, batch)  # type: ignore[union-attr]
            with trio.CancelScope(shield=True):
                await trio.lowlevel.wait_readable(sync.event_fd)  # type: ignore[union-attr]
            try:
                sync.done()  # type: ignore[union-attr]
            except BaseException as exc:
                journal.write_failed(f"{type(exc).__name__}: {exc}")
                raise
        else:
            await trio.to_thread.run_sync(journal.write_and_sync, batch)
    except BaseException:
        journal.committed(batch)  # MessageStore.finish says it otherwise
        raise

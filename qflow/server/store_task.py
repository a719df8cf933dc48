"""The durable store's committer task: group commit with the sync off the
event loop (issue 14, docs/store.md "Group commit, on the loop and off it").

One commit is in flight at a time; whatever the broker stages while a sync
runs goes into the next one, so the sync rate follows the disk by itself.
The daemon starts it once the journal is recovered and the durable queues
are declared::

    store = await nursery.start(run_store, broker, journal)

If a write or a sync fails, the task raises (the journal refuses further
commits): persistent transfers can no longer be made durable, and completing
them anyway would be a lie. The daemon should then stop.
"""

from __future__ import annotations

import trio

from qflow.broker.broker import Broker
from qflow.store.journal import Journal
from qflow.store.message_store import MessageStore
from qflow.store.quota import QuotaLimits


async def run_store(broker: Broker, journal: Journal, quota: QuotaLimits | None = None,
                    task_status: trio.TaskStatus[MessageStore] = trio.TASK_STATUS_IGNORED) -> None:
    """Hold ``broker``'s durable queues' transfers until ``journal`` has them
    on disk (and, while ``quota`` says the journal is overfull, until it is
    underfull again); runs until cancelled. ``journal`` must be recovered already.
    Reports the :class:`MessageStore` through ``task_status``."""
    poked = trio.Event()  # for the committer
    poked_in_flight = trio.Event()  # for the early releaser
    in_flight = False

    def wake() -> None:  # called on the loop, possibly inside the broker's apply: only signal
        poked.set()
        poked_in_flight.set()

    async def release_early() -> None:
        # While a sync runs (milliseconds on a busy disk), what needs no write completes at once:
        # transient transfers to durable queues, and persistent ones whose messages were accepted
        # before they were staged (with a fast consumer, a third to a half of them). Waiting for the
        # sync would keep them in their producers' windows for nothing.
        nonlocal poked_in_flight
        while True:
            await poked_in_flight.wait()
            poked_in_flight = trio.Event()
            if in_flight:  # else the committer's prepare() does the same
                store.stage()
                broker.flush()

    store = MessageStore(broker, journal, wake, quota)
    task_status.started(store)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_early)
            while True:
                await poked.wait()
                poked = trio.Event()
                commit = store.prepare()
                broker.flush()  # the transient transfers prepare() released complete now, not after the sync
                if commit is None:
                    continue
                if commit.batch is not None:
                    in_flight = True
                    try:
                        # Not cancellable (trio's default): a commit abandoned half way would leave the
                        # journal's two sides out of step; shutdown waits for at most one sync.
                        await trio.to_thread.run_sync(journal.write_and_sync, commit.batch)
                    except BaseException:
                        journal.committed(commit.batch)
                        raise
                    finally:
                        in_flight = False
                store.finish(commit)
                broker.flush()
    except ExceptionGroup as group:  # the committer's failure, as it was raised (the releaser cannot fail)
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise

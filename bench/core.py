"""The broker's per-message cost without sockets: ``python bench/core.py``.

Feeds pre-encoded frames straight into a ConnectionPump (qflow.server.pump: the
sans-I/O path qflowd runs for each read) for one producer and one consumer
on one queue, and times what the broker does per message: decode, route,
enqueue, account, dispatch, encode the delivery, take the accept, dequeue,
report completions. The consumer's side returns credit and accepts in
batches of 500, as the client library's ``accept="auto"`` does, and takes
deliveries in message.deliver-run frames, as the client library asks
(``--single-deliveries``: one message.deliver frame each, as a raw client
that does not ask gets them).

Use it to measure a change to the broker's hot path in isolation: figures
are microseconds of broker CPU per message, medians of several rounds.

``--persistent``: the same on a durable queue from a durable sender, with the
message store (qflow.store.message_store) holding every transfer and a journal
(qflow.store.journal) in a fresh temporary directory, committed after each
read as qflowd's store task does, but inline: the writer thread's work
(encode, crc, write, sync) is timed with the rest, and also apart
(``writer_us``). Rounds alternate with transient ones, and ``persistent_over
_transient`` is the median of the pairs' ratios of CPU per message (2.0 is the
most the throughput goal, persistent at least half of transient, allows when
the broker's CPU is the limit). ``--sync stub`` replaces fdatasync and the
directory fsync by nothing, for the CPU alone; ``--sync real`` (the default)
syncs to the temporary directory's disk, and its wait is not counted: only
the calling thread's CPU time (time.thread_time) is.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

import msgpack
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from qflow import protocol as P  # noqa: E402
from qflow.broker import Broker  # noqa: E402
from qflow.broker.acl import parse  # noqa: E402
from qflow.protocol.framing import PROTOCOL_HEADER  # noqa: E402
from qflow.server.pump import ConnectionPump  # noqa: E402
from qflow.store.journal import Journal  # noqa: E402
from qflow.store.message_store import MessageStore  # noqa: E402

# Per round, seconds in: [transfers and deliveries (with the store's work), accepts and credit, and of the
# first, the store's: staging (prepare), the writer, releasing (finish and its flush)]
PARTS: list[list[float]] = []
CLOCK = [time.perf_counter]  # --persistent: time.thread_time (a real sync's wait is not the broker's CPU)
NO_FLOW = {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0, "qpid.max_size": 0}


def _feed(conn: ConnectionPump, data: bytes) -> None:
    conn.receive(data, 0.0)


def _open(conn: ConnectionPump, deliver_runs: bool = False) -> None:
    pk = msgpack.Packer(use_bin_type=True)
    _feed(conn, PROTOCOL_HEADER + pk.pack([P.OPEN, {"mechanism": "ANONYMOUS", "deliver_runs": deliver_runs}])
          + pk.pack([P.ATTACH, 0, ""]))
    conn.encoder.take()


def one_round(count: int, size: int, batch: int, arguments: dict, deliver_runs: bool = True,
              acl: bool = False, persistent: bool = False) -> float:
    """Seconds of broker work for ``count`` messages through one queue (``acl``:
    with bench/auth.py's BENCH_ACL in force; ``persistent``: durable, see the module's doc)."""
    if persistent:
        with tempfile.TemporaryDirectory(prefix="qflow-core-") as tmp:
            return _round(count, size, batch, arguments, deliver_runs, acl, tmp)
    return _round(count, size, batch, arguments, deliver_runs, acl, None)


def _round(count: int, size: int, batch: int, arguments: dict, deliver_runs: bool, acl: bool,
           data_dir: str | None) -> float:
    broker = Broker()
    store = journal = None
    if data_dir is not None:
        journal = Journal(data_dir)
        journal.recover()
        store = MessageStore(broker, journal)
    if acl:
        from auth import BENCH_ACL  # noqa: E402 - bench/ is not a package

        broker.set_acl(parse(BENCH_ACL))
    producer = ConnectionPump(broker, 1 << 20, 0.0)
    consumer = ConnectionPump(broker, 1 << 20, 0.0)
    _open(producer)
    _open(consumer, deliver_runs)
    pk = msgpack.Packer(use_bin_type=True)
    _feed(producer, pk.pack([P.QUEUE_DECLARE, 0, "bench", store is not None, False, False, arguments, False]))
    _feed(consumer, pk.pack([P.SUBSCRIBE, 0, "bench", "d", P.ACCEPT_EXPLICIT, P.ACQUIRE_PRE_ACQUIRED, 0])
          + pk.pack([P.FLOW, 0, "d", 1000, -1]))
    producer.encoder.take()
    consumer.encoder.take()
    body = b"x" * size
    frame = pk.pack([P.TRANSFER, 0, "", "bench", {"durable": True} if store else None, body])
    chunks = [frame * batch] * (count // batch)
    unpacker = msgpack.Unpacker(raw=False)
    delivered = 0
    accepted = 0  # deliveries accepted so far
    credited = 0
    pending_credit = 0
    gc.collect()
    clock = CLOCK[0]
    elapsed = 0.0  # broker time only: the consumer's decoding here is not the broker's work
    parts = [0.0, 0.0, 0.0, 0.0, 0.0]
    completed = 0
    for chunk in chunks:
        t0 = clock()
        _feed(producer, chunk)
        if store is not None:  # what qflowd's store task does after a read, its thread's part inline
            t1 = clock()
            commit = store.prepare()
            broker.flush()
            t2 = clock()
            parts[2] += t2 - t1
            if commit is not None:
                if commit.batch is not None:
                    journal.write_and_sync(commit.batch)
                    journal.committed(commit.batch)
                t3 = clock()
                parts[3] += t3 - t2
                store.finish(commit)
                broker.flush()
                parts[4] += clock() - t3
        completed += len(producer.encoder.take())
        out = consumer.encoder.take()
        parts[0] += clock() - t0
        elapsed += clock() - t0
        unpacker.feed(out)
        for f in unpacker:
            if f[0] == P.DELIVER_RUN:
                delivered += f[4]
            elif f[0] == P.DELIVER:
                delivered += 1
        # the consumer returns credit and accepts every 500 deliveries, as the client does
        reply = b""
        while delivered - accepted >= 500:
            reply += pk.pack([P.ACCEPT, 0, [accepted, accepted + 499]])
            accepted += 500
            pending_credit += 500
        if pending_credit:
            reply += pk.pack([P.FLOW, 0, "d", pending_credit, 0])
            credited += pending_credit
            pending_credit = 0
        if reply:
            t0 = clock()
            _feed(consumer, reply)
            parts[1] += clock() - t0
            elapsed += clock() - t0
    if delivered != count:
        raise SystemExit(f"delivered {delivered} of {count}")
    if not completed:
        raise SystemExit("the producer was told of no completion")
    if journal is not None:
        if journal.live_messages() != count - accepted:
            raise SystemExit(f"the journal holds {journal.live_messages()} messages, {count - accepted} are unaccepted")
        journal.close()
    PARTS.append(parts)
    return elapsed


def measure(count: int = 200_000, size: int = 64, batch: int = 500, rounds: int = 3, flow: bool = False,
            deliver_runs: bool = True, acl: bool = False) -> dict:
    """Median broker microseconds per message, in total and split."""
    arguments = {"qpid.flow_stop_count": 100_000_000, "qpid.max_size": 0} if flow else NO_FLOW
    PARTS.clear()

    async def run() -> list[float]:
        return [one_round(count, size, batch, arguments, deliver_runs, acl) for _ in range(rounds)]

    times = trio.run(run)
    return {
        "us_per_msg": round(statistics.median(times) / count * 1e6, 2),
        "transfer_and_deliver_us": round(statistics.median(p[0] for p in PARTS) / count * 1e6, 2),
        "accept_and_credit_us": round(statistics.median(p[1] for p in PARTS) / count * 1e6, 2),
    }


def acl_overhead(count: int = 200_000, size: int = 64, batch: int = 500, rounds: int = 5) -> dict:
    """Broker us/msg without and with an ACL in force, rounds interleaved in
    one run; ``acl_over_none`` is the median of each round's ratio."""
    pairs = []

    async def run() -> None:
        for _ in range(rounds):
            pairs.append((one_round(count, size, batch, NO_FLOW), one_round(count, size, batch, NO_FLOW, acl=True)))

    trio.run(run)
    return {"us_per_msg_no_acl": round(statistics.median(a for a, _ in pairs) / count * 1e6, 3),
            "us_per_msg_acl": round(statistics.median(b for _, b in pairs) / count * 1e6, 3),
            "acl_over_none": round(statistics.median(b / a for a, b in pairs), 3), "rounds": rounds, "count": count}


def persistent_overhead(count: int = 200_000, size: int = 64, batch: int = 500, rounds: int = 6,
                        sync: str = "real") -> dict:
    """Broker CPU us/msg transient and persistent (the store and its journal
    included, the writer's share apart), rounds alternated in one run;
    ``persistent_over_transient`` is the median of each pair's ratio."""
    if sync == "stub":
        import qflow.store.journal as journal_module

        class _NoSync:  # os, but syncing nothing: the CPU without the disk
            def __getattr__(self, name: str) -> object:
                return getattr(os, name)

            @staticmethod
            def fdatasync(fd: int) -> None:
                pass

        journal_module.os = _NoSync()  # type: ignore[assignment]
        journal_module.fsync_dir = lambda path: None  # type: ignore[assignment]
    CLOCK[0] = time.thread_time
    pairs = []
    split: list[list[float]] = []  # the persistent rounds' PARTS

    async def run() -> None:
        for _ in range(rounds):
            PARTS.clear()
            transient = one_round(count, size, batch, NO_FLOW)
            persistent = one_round(count, size, batch, NO_FLOW, persistent=True)
            pairs.append((transient, persistent))
            split.append(PARTS[-1])

    trio.run(run)
    us = 1e6 / count

    def part(i: int) -> float:
        return round(statistics.median(p[i] for p in split) * us, 3)

    return {"us_per_msg_transient": round(statistics.median(a for a, _ in pairs) * us, 3),
            "us_per_msg_persistent": round(statistics.median(b for _, b in pairs) * us, 3),
            # of us_per_msg_persistent: the producer's reads (transfers, deliveries) without the store's
            # part, the consumer's (accepts, credit: also the journal's dequeues), and the store's steps
            "read_us": round(statistics.median(p[0] - p[2] - p[3] - p[4] for p in split) * us, 3),
            "accept_us": part(1), "stage_us": part(2), "writer_us": part(3), "release_us": part(4),
            "persistent_over_transient": round(statistics.median(b / a for a, b in pairs), 3),
            "rounds": rounds, "count": count, "size": size, "sync": sync}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500, help="transfers per read")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--flow", action="store_true", help="flow thresholds configured, never reached")
    parser.add_argument("--single-deliveries", action="store_true",
                        help="a consumer that takes one message.deliver frame per message")
    parser.add_argument("--acl", action="store_true",
                        help="without and with an ACL (bench/auth.py BENCH_ACL), interleaved: the ratio")
    parser.add_argument("--persistent", action="store_true",
                        help="transient and persistent (a durable queue, the store, a journal), interleaved: "
                             "CPU per message and the ratio")
    parser.add_argument("--sync", choices=("real", "stub"), default="real",
                        help="--persistent: fdatasync for real, or replaced by nothing (the CPU alone)")
    args = parser.parse_args()
    if args.persistent:
        print(json.dumps(persistent_overhead(args.count, args.size, args.batch, args.rounds, args.sync)))
        return
    if args.acl:
        print(json.dumps(acl_overhead(args.count, args.size, args.batch, args.rounds)))
        return
    r = measure(args.count, args.size, args.batch, args.rounds, args.flow, not args.single_deliveries)
    print(f"broker core: {r['us_per_msg']:.2f} us/msg ({1e6 / r['us_per_msg']:,.0f} msg/s of broker CPU); "
          f"transfer+deliver {r['transfer_and_deliver_us']} us, accept+credit {r['accept_and_credit_us']} us")


if __name__ == "__main__":
    main()

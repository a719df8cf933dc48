"""qflow against RabbitMQ, side by side in one run: ``make bench-compare``.

Installs Debian's ``rabbitmq-server`` (apt) if it is missing, starts a private
RabbitMQ node on 127.0.0.1 (free ports, its own epmd, data, logs and config
under a temporary folder, no plugins), starts one qflowd, and runs the same
workloads against both, interleaved (qflow, RabbitMQ, qflow, RabbitMQ ...).
Every client is its own process, as a user's would be. bench/README.md says
exactly what each side does in each workload.

Figures drift on these shared 2-core machines, so only ratios measured in this
one run mean anything; the spin-loop probe before and after shows how much
the machine drifted meanwhile. The last line printed is one JSON object.

    python bench/compare.py            # default run, several minutes
    python bench/compare.py --quick    # a minute or two
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import queue as queue_mod
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RABBIT_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
RABBIT_LIBS = ("py-amqp", "pika", "aio-pika")
SIZES = {"64b": 64, "1k": 1024}

# Queue arguments. Throughput workloads: no limit and no flow control on either
# side (RabbitMQ's default; qflow's default 100 MiB limit with flow at 80 % is
# switched off, as bench/run.py does).
QFLOW_PLAIN = {"qpid.flow_stop_count": 0, "qpid.flow_stop_size": 0, "qpid.max_size": 0}
# The flow workload: a hard bound of 3000 messages on both sides; qflow stops
# producers above 900 (900 + 2 senders x 1000 capacity <= 3000, so nothing is
# ever refused), RabbitMQ refuses (nacks) above 3000 and producers resend.
FLOW_MAX, FLOW_STOP, FLOW_RESUME = 3000, 900, 700
QFLOW_FLOW = {"qpid.max_count": FLOW_MAX, "qpid.max_size": 0, "qpid.flow_stop_count": FLOW_STOP,
              "qpid.flow_resume_count": FLOW_RESUME}
RABBIT_FLOW = {"x-max-length": FLOW_MAX, "x-overflow": "reject-publish"}
# The back-pressure comparison (the numbers).
BP_WINDOWS = (50, 13, 149)
BP_COUNTS = (1213, 797, 331)
BP_MAX = 373
BP_PREFETCH = 10  # the consumer's credit/prefetch: a round trip per message would cap the rate under load
BP_STOP, BP_RESUME = 160, 140  # 160 + 50 + 13 + 149 = 372 <= 373
QFLOW_BP = {"qpid.max_count": BP_MAX, "qpid.max_size": 0, "qpid.flow_stop_count": BP_STOP,
            "qpid.flow_resume_count": BP_RESUME}
RABBIT_BP = {"x-max-length": BP_MAX, "x-overflow": "reject-publish"}


# =============================================================================
# Client side: every client is `compare.py --client SPEC_JSON`. It connects and
# sets up, prints READY, waits for "go" on stdin, runs, and prints one line
# "RESULT {json}". Times are time.monotonic() (CLOCK_MONOTONIC, shared by all
# processes), CPU is the client's own process time from "go" to the end.
# =============================================================================
def _ready() -> None:
    sys.stdout.write("READY\n")
    sys.stdout.flush()


def _wait_go() -> None:
    sys.stdin.readline()


def _result(**fields) -> None:
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


END = b"END"  # a producer's last message, sent once all its data messages are confirmed


def _body_maker(spec: dict):
    """Index -> body: a fixed body for throughput, one that starts with a
    unique 8-byte id when tracking; index -1 is the END marker."""
    size, tag = spec["size"], spec.get("tag", "a")
    if spec.get("track"):
        return lambda i: END if i < 0 else f"{tag}{i:07d}".encode().ljust(size, b"x")
    body = b"x" * size
    return lambda i: END if i < 0 else body


class Pub:
    """AMQP 0-9-1 publisher-confirm bookkeeping shared by the three RabbitMQ
    clients: at most ``window`` unconfirmed publishes; a nacked message is
    resent after ``backoff`` seconds, during which this producer publishes
    nothing (nacked messages go out again first, in order). Publishing stops
    after ``count`` messages or ``duration`` seconds; with ``end`` set, once
    every data message is confirmed, an END marker follows (resent if nacked)."""

    def __init__(self, spec: dict) -> None:
        self.count = spec["count"]
        self.window = spec["window"]
        self.backoff = spec.get("backoff", 0.01)
        self.duration = spec.get("duration", 0)
        self.deadline = 0.0
        self.end = spec.get("end", False)
        self.end_sent = False
        self.next = 0
        self.tag = 0  # delivery tag of the last publish (confirms count from 1 per channel)
        self.pending: dict[int, int] = {}  # delivery tag -> message index
        self.order: collections.deque[int] = collections.deque()
        self.resend: collections.deque[int] = collections.deque()
        self.pause_until = 0.0
        self.published = self.resends = self.acked = self.nacked = 0

    def start(self, now: float) -> None:
        self.deadline = now + self.duration if self.duration else 0.0

    def next_to_send(self, now: float) -> int | None:
        if len(self.pending) >= self.window or now < self.pause_until:
            return None
        if self.resend:
            self.resends += 1
            return self.resend.popleft()
        if self.next < self.count:
            if self.deadline and not self.next & 63 and now > self.deadline:
                self.count = self.next  # time is up: no more data messages
            else:
                self.next += 1
                return self.next - 1
        if self.end and not self.end_sent and not self.pending:
            self.end_sent = True
            return -1
        return None

    def sent(self, idx: int) -> int:
        self.tag += 1
        self.pending[self.tag] = idx
        self.order.append(self.tag)
        self.published += 1
        return self.tag

    def _settle(self, tag: int, multiple: bool) -> list[int]:
        if not multiple:
            idx = self.pending.pop(tag, None)
            return [] if idx is None else [idx]
        out = []
        order, pending = self.order, self.pending
        while order and order[0] <= tag:
            idx = pending.pop(order.popleft(), None)
            if idx is not None:
                out.append(idx)
        return out

    def ack(self, tag: int, multiple: bool) -> None:
        self.acked += sum(1 for i in self._settle(tag, multiple) if i >= 0)

    def nack(self, tag: int, multiple: bool) -> None:
        idxs = self._settle(tag, multiple)
        self.nacked += len(idxs)
        self.resend.extend(sorted(idxs))
        self.pause_until = time.monotonic() + self.backoff

    def done(self) -> bool:
        return (self.next >= self.count and not self.resend and not self.pending
                and (self.end_sent or not self.end))

    def wait_hint(self, now: float) -> float:
        return max(0.0, self.pause_until - now) if self.pause_until > now else 1.0

    def report(self, t0: float, t1: float, cpu: float, timed_out: bool) -> None:
        _result(role="produce", published=self.published, acked=self.acked, nacked=self.nacked,
                resends=self.resends, lost=self.count - self.acked, t0=t0, t1=t1, cpu=cpu, timed_out=timed_out)


class Cons:
    """Consumer bookkeeping shared by every client: counts, ids, pacing. It
    is done after ``ends`` END markers (one per producer feeding its queue),
    or, with ``ends`` 0, after ``count`` (unique, when tracking) messages."""

    def __init__(self, spec: dict) -> None:
        self.count = spec.get("count", 0)
        self.ends = spec.get("ends", 0)
        self.ends_seen = 0
        self.track = spec.get("track", False)
        self.ack_every = spec["ack_every"]
        self.pause_every = spec.get("pause_every", 0)
        self.slow_factor = spec.get("slow_factor", 3.0)
        self.batch_start = 0.0
        self.paused_at = 0
        self.rest_until = 0.0  # when the last rest was due to end
        self.overslept = 0.0  # rest taken beyond what was due, owed back
        self.rested = 0.0  # seconds spent resting in all
        rate = spec.get("rate") or 0
        self.interval = 1.0 / rate if rate else 0.0
        self.next_slot = 0.0
        self.n = 0
        self.seen: set[bytes] = set()
        self.t_last = 0.0

    def got(self, body: bytes) -> bool:
        """Record one delivery; True once everything expected has arrived."""
        if body == END:
            self.ends_seen += 1
            return self.ends_seen >= self.ends
        self.n += 1
        self.t_last = time.monotonic()
        if self.track:
            self.seen.add(bytes(body[:8]))
            return not self.ends and len(self.seen) >= self.count
        return not self.ends and self.n >= self.count

    def delay(self) -> float:
        """Seconds to wait before taking the next message (fixed rate or periodic pause)."""
        if self.interval:
            # A fixed average rate: slots every `interval`, caught up after a late
            # wake-up (timer overshoot), but never more than 50 ms behind.
            now = time.monotonic()
            self.next_slot = max(self.next_slot + self.interval, now - 0.05) if self.next_slot else now
            return self.next_slot - now
        if self.pause_every:
            # A slow consumer: after every `pause_every` messages it rests `slow_factor`
            # times as long as those took (3: a quarter of its own speed, whatever that is).
            if not self.batch_start:
                self.batch_start = time.monotonic()
            elif self.n and self.n % self.pause_every == 0 and self.n != self.paused_at:
                now = time.monotonic()
                self.paused_at = self.n
                rest = (now - self.batch_start) * self.slow_factor - self.overslept
                if rest <= 0:  # still owed from overshoots: work on, owe the rest
                    self.overslept = -rest
                    self.batch_start = now
                    return 0.0
                self.overslept = 0.0
                self.rest_until = now + rest
                self.batch_start = now
                return rest
        return 0.0

    def awake(self) -> None:
        """Called as a rest that :meth:`delay` asked for ends. Sleeps overshoot,
        and by client: an event loop's timer wakes on a whole millisecond
        (trio.sleep(0.0003) takes 1.2 ms here), time.sleep within 0.1 ms. The
        overshoot is taken off the next rest rather than counted as work, so
        every client keeps to the same quarter of its own speed."""
        if not self.pause_every:
            return
        now = time.monotonic()
        self.overslept += now - self.rest_until
        self.rested += now - self.batch_start  # batch_start: when the rest began
        self.batch_start = now

    def report(self, t0: float, cpu: float, timed_out: bool) -> None:
        unique = len(self.seen) if self.track else self.n
        _result(role="consume", received=self.n, unique=unique, duplicates=self.n - unique if self.track else 0,
                t0=t0, t_last=self.t_last or time.monotonic(), cpu=cpu, timed_out=timed_out,
                rested=round(self.rested, 4))


# -- qflow clients (trio) ---------------------------------------------------------
def qflow_client(spec: dict) -> None:
    import trio

    sys.path.insert(0, ROOT)
    import qflow

    async def go() -> None:
        await trio.to_thread.run_sync(_wait_go)

    async def produce() -> None:
        async with await qflow.connect("127.0.0.1", spec["port"]) as conn:
            ssn = await conn.session()
            address = f"{spec['exchange']}/{spec['routing_key']}" if spec["exchange"] else spec["routing_key"]
            sender = ssn.sender(address, capacity=spec["window"])
            body = _body_maker(spec)
            count = spec["count"]
            send = sender.send
            refused = 0
            _ready()
            await go()
            t0, c0 = time.monotonic(), time.process_time()
            end_at = t0 + spec["duration"] if spec.get("duration") else math.inf
            sent = 0
            with trio.move_on_after(spec["timeout"]) as scope:
                while sent < count:
                    if not sent & 63 and time.monotonic() > end_at:
                        break
                    try:
                        await send(body(sent))
                    except qflow.ResourceLimitExceeded:  # an earlier transfer was refused
                        refused += 1
                        await send(body(sent))
                    sent += 1
                while True:
                    try:
                        await sender.sync()
                        break
                    except qflow.ResourceLimitExceeded:
                        refused += 1
                if spec.get("end"):
                    await send(END)
                    await sender.sync()
            timed_out = scope.cancelled_caught
            t1, cpu = time.monotonic(), time.process_time() - c0
            _result(role="produce", published=sent, acked=sent - refused, nacked=refused, resends=0,
                    lost=refused, t0=t0, t1=t1, cpu=cpu, timed_out=timed_out, max_incomplete=sender.max_incomplete)

    async def consume() -> None:
        async with await qflow.connect("127.0.0.1", spec["port"]) as conn:
            ssn = await conn.session()
            cons = Cons(spec)
            # accept="auto" accepts in batches of capacity // 2 (the RabbitMQ consumers' ack_every)
            receiver = await ssn.receiver(spec["queue"], capacity=spec["prefetch"], accept="auto")
            fetch = receiver.fetch
            got = cons.got
            paced = bool(cons.interval or cons.pause_every)
            _ready()
            await go()
            t0, c0 = time.monotonic(), time.process_time()
            timed_out = False
            with trio.move_on_after(spec["timeout"]) as scope:
                while True:
                    if paced:  # the same pacing code as the RabbitMQ consumers
                        d = cons.delay()
                        if d > 0:
                            await trio.sleep(d)
                            cons.awake()
                    if got((await fetch()).body):
                        break
            timed_out = scope.cancelled_caught
            cpu = time.process_time() - c0
            cons.report(t0, cpu, timed_out)
            with trio.move_on_after(5):
                await receiver.close()
                await ssn.sync()

    async def monitor() -> None:
        async with await qflow.connect("127.0.0.1", spec["port"]) as conn:
            ssn = await conn.session()
            peak = 0
            stop = trio.Event()
            _ready()
            await go()

            async def wait_stop() -> None:
                await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                stop.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(wait_stop)
                with trio.move_on_after(spec["timeout"]):
                    while not stop.is_set():
                        peak = max(peak, (await ssn.query_queue(spec["queue"]))["msgDepth"])
                        await trio.sleep(spec["interval"])
                nursery.cancel_scope.cancel()
            _result(role="monitor", peak_depth=peak, peak_unacked=0)

    trio.run({"produce": produce, "consume": consume, "monitor": monitor}[spec["role"]])


# -- RabbitMQ with py-amqp (synchronous) --------------------------------------------
def pyamqp_client(spec: dict) -> None:
    import amqp

    conn = amqp.Connection(f"127.0.0.1:{spec['port']}", heartbeat=0)
    conn.connect()
    ch = conn.channel()
    role = spec["role"]
    if role == "produce":
        pub = Pub(spec)
        ch.confirm_select()  # the public call: confirms arrive as events, publishes do not wait
        ch.events["basic_ack"].add(pub.ack)
        ch.events["basic_nack"].add(pub.nack)
        exchange, rk = spec["exchange"], spec["routing_key"]
        body = _body_maker(spec)
        fixed = None if spec.get("track") else amqp.Message(body(0))
        publish = ch.basic_publish
        drain = conn.drain_events
        _ready()
        _wait_go()
        t0, c0 = time.monotonic(), time.process_time()
        pub.start(t0)
        deadline = t0 + spec["timeout"]
        while not pub.done():
            now = time.monotonic()
            if now > deadline:
                break
            idx = pub.next_to_send(now)
            if idx is not None:
                publish(fixed if fixed is not None and idx >= 0 else amqp.Message(body(idx)), exchange=exchange,
                        routing_key=rk)
                pub.sent(idx)
                continue
            if pub.pending:
                try:
                    drain(timeout=min(pub.wait_hint(now), 1.0))
                except TimeoutError:
                    pass
            else:
                time.sleep(pub.wait_hint(now))
        t1, cpu = time.monotonic(), time.process_time() - c0
        pub.report(t0, t1, cpu, not pub.done())
    elif role == "consume":
        cons = Cons(spec)
        state = {"unacked": 0, "done": False}
        ack_every = cons.ack_every

        def on_message(msg) -> None:
            d = cons.delay()
            if d > 0:
                time.sleep(d)
                cons.awake()
            done = cons.got(msg.body)
            state["unacked"] += 1
            state["tag"] = msg.delivery_info["delivery_tag"]
            if state["unacked"] >= ack_every or done:
                ch.basic_ack(state["tag"], multiple=True)
                state["unacked"] = 0
            state["done"] = done

        ch.basic_qos(0, spec["prefetch"], False)
        ch.basic_consume(spec["queue"], callback=on_message)
        _ready()
        _wait_go()
        t0, c0 = time.monotonic(), time.process_time()
        deadline = t0 + spec["timeout"]
        while not state["done"] and time.monotonic() < deadline:
            try:
                conn.drain_events(timeout=1.0)
            except TimeoutError:
                pass
        cons.report(t0, time.process_time() - c0, not state["done"])
    elif role == "monitor":
        _rabbit_monitor(lambda q: ch.queue_declare(q, passive=True).message_count, spec)
    try:
        conn.close()
    except Exception:
        pass


def _rabbit_monitor(depth, spec: dict) -> None:
    """Poll the ready count (passive queue.declare) until told to stop."""
    peak = 0
    stop = threading.Event()
    _ready()
    _wait_go()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    deadline = time.monotonic() + spec["timeout"]
    while not stop.is_set() and time.monotonic() < deadline:
        peak = max(peak, depth(spec["queue"]))
        time.sleep(spec["interval"])
    _result(role="monitor", peak_depth=peak, peak_unacked=spec.get("consumer_prefetch", 0))


# -- RabbitMQ with pika (SelectConnection producer, BlockingConnection consumer) ------
def pika_client(spec: dict) -> None:
    import pika
    from pika.spec import Basic

    params = pika.ConnectionParameters(host="127.0.0.1", port=spec["port"], heartbeat=0)
    role = spec["role"]
    if role == "produce":
        # The blocking adapter's confirm mode waits for every publish (a window
        # of 1); the asynchronous SelectConnection is pika's way to a window.
        pub = Pub(spec)
        exchange, rk = spec["exchange"], spec["routing_key"]
        body = _body_maker(spec)
        st: dict = {"timer": None, "t0": 0.0, "c0": 0.0, "t1": 0.0, "cpu": 0.0, "timed_out": False, "error": None}

        def finish(conn, timed_out: bool) -> None:
            if not st["t1"]:
                st["t1"], st["cpu"], st["timed_out"] = time.monotonic(), time.process_time() - st["c0"], timed_out
                conn.close()

        def pump() -> None:
            st["timer"] = None
            ch, conn = st["ch"], st["conn"]
            now = time.monotonic()
            publish = ch.basic_publish
            while True:
                idx = pub.next_to_send(now)
                if idx is None:
                    break
                publish(exchange, rk, body(idx))
                pub.sent(idx)
            if pub.done():
                finish(conn, False)
            elif now > st["t0"] + spec["timeout"]:
                finish(conn, True)
            elif pub.pause_until > now and st["timer"] is None:
                st["timer"] = conn.ioloop.call_later(pub.pause_until - now, pump)

        def on_confirm(frame) -> None:
            m = frame.method
            if isinstance(m, Basic.Ack):
                pub.ack(m.delivery_tag, m.multiple)
            else:
                pub.nack(m.delivery_tag, m.multiple)
            pump()

        def on_selected(_frame) -> None:
            _ready()
            _wait_go()
            st["t0"], st["c0"] = time.monotonic(), time.process_time()
            pub.start(st["t0"])
            st["conn"].ioloop.call_later(spec["timeout"] + 1, lambda: finish(st["conn"], True))
            pump()

        def on_channel(ch) -> None:
            st["ch"] = ch
            ch.confirm_delivery(ack_nack_callback=on_confirm, callback=on_selected)

        def on_open_error(conn, err) -> None:
            st["error"] = repr(err)
            conn.ioloop.stop()

        conn = pika.SelectConnection(params, on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
                                     on_open_error_callback=on_open_error,
                                     on_close_callback=lambda c, reason: c.ioloop.stop())
        st["conn"] = conn
        conn.ioloop.start()
        if st["error"]:
            raise SystemExit(f"pika producer: {st['error']}")
        pub.report(st["t0"], st["t1"], st["cpu"], st["timed_out"] or not pub.done())
        return
    conn = pika.BlockingConnection(params)
    ch = conn.channel()
    if role == "consume":
        cons = Cons(spec)
        state = {"unacked": 0, "done": False}
        ack_every = cons.ack_every

        def on_message(channel, method, _props, body) -> None:
            d = cons.delay()
            if d > 0:
                time.sleep(d)
                cons.awake()
            done = cons.got(body)
            state["unacked"] += 1
            if state["unacked"] >= ack_every or done:
                channel.basic_ack(method.delivery_tag, multiple=True)
                state["unacked"] = 0
            if done:
                state["done"] = True
                channel.stop_consuming()

        ch.basic_qos(prefetch_count=spec["prefetch"])
        ch.basic_consume(spec["queue"], on_message, auto_ack=False)
        _ready()
        _wait_go()
        t0, c0 = time.monotonic(), time.process_time()
        deadline = t0 + spec["timeout"]
        while not state["done"] and time.monotonic() < deadline:
            conn.process_data_events(time_limit=1.0)
        cons.report(t0, time.process_time() - c0, not state["done"])
    elif role == "monitor":
        _rabbit_monitor(lambda q: ch.queue_declare(q, passive=True).method.message_count, spec)
    try:
        conn.close()
    except Exception:
        pass


# -- RabbitMQ with aio-pika (asyncio) --------------------------------------------------
def aiopika_client(spec: dict) -> None:
    import asyncio

    import aio_pika

    async def wait_go() -> None:
        await asyncio.get_running_loop().run_in_executor(None, _wait_go)

    async def main() -> None:
        conn = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{spec['port']}/")
        role = spec["role"]
        if role == "produce":
            ch = await conn.channel(publisher_confirms=True)
            ex = await ch.get_exchange(spec["exchange"], ensure=False) if spec["exchange"] else ch.default_exchange
            rk = spec["routing_key"]
            pub = Pub(spec)
            body = _body_maker(spec)
            Message = aio_pika.Message

            space = asyncio.Event()
            tasks: set = set()

            def settled(task, tag: int) -> None:
                tasks.discard(task)
                if not task.cancelled():  # a nack (DeliveryError) or any other failure: resend it
                    (pub.ack if task.exception() is None else pub.nack)(tag, False)
                space.set()

            _ready()
            await wait_go()
            t0, c0 = time.monotonic(), time.process_time()
            pub.start(t0)
            deadline = t0 + spec["timeout"]
            create = asyncio.ensure_future
            publish = ex.publish
            while not pub.done():
                now = time.monotonic()
                if now > deadline:
                    break
                idx = pub.next_to_send(now)
                if idx is not None:
                    tag = pub.sent(idx)
                    task = create(publish(Message(body(idx)), routing_key=rk, mandatory=False))
                    tasks.add(task)
                    task.add_done_callback(lambda t, tag=tag: settled(t, tag))
                    continue
                space.clear()
                try:
                    await asyncio.wait_for(space.wait(), min(pub.wait_hint(now), 1.0))
                except TimeoutError:
                    pass
            t1, cpu = time.monotonic(), time.process_time() - c0
            for t in tasks:
                t.cancel()
            pub.report(t0, t1, cpu, not pub.done())
        elif role == "consume":
            ch = await conn.channel()
            await ch.set_qos(prefetch_count=spec["prefetch"])
            q = await ch.get_queue(spec["queue"], ensure=False)
            cons = Cons(spec)
            done_ev = asyncio.Event()
            state = {"unacked": 0}
            ack_every = cons.ack_every

            # aio-pika runs each message's callback as its own task: without the lock, one
            # resting callback would not stop the next from taking messages (no slow
            # consumer at all), and END could be counted while earlier messages still wait.
            in_order = asyncio.Lock()  # FIFO: callbacks go one at a time, in delivery order

            async def on_message(msg) -> None:
                async with in_order:
                    if done_ev.is_set():
                        return
                    d = cons.delay()
                    if d > 0:
                        await asyncio.sleep(d)
                        cons.awake()
                    done = cons.got(msg.body)
                    state["unacked"] += 1
                    if state["unacked"] >= ack_every or done:
                        await msg.ack(multiple=True)
                        state["unacked"] = 0
                    if done:
                        done_ev.set()

            await q.consume(on_message, no_ack=False)
            _ready()
            await wait_go()
            t0, c0 = time.monotonic(), time.process_time()
            try:
                await asyncio.wait_for(done_ev.wait(), spec["timeout"])
            except TimeoutError:
                pass
            cons.report(t0, time.process_time() - c0, not done_ev.is_set())
        elif role == "monitor":
            ch = await conn.channel()
            peak = 0
            _ready()
            await wait_go()
            loop = asyncio.get_running_loop()
            stop = loop.run_in_executor(None, sys.stdin.readline)
            deadline = time.monotonic() + spec["timeout"]
            while not stop.done() and time.monotonic() < deadline:
                res = await ch.declare_queue(spec["queue"], passive=True)
                peak = max(peak, res.declaration_result.message_count)
                await asyncio.sleep(spec["interval"])
            _result(role="monitor", peak_depth=peak, peak_unacked=spec.get("consumer_prefetch", 0))
        await conn.close()

    asyncio.run(main())


CLIENTS = {"qflow": qflow_client, "py-amqp": pyamqp_client, "pika": pika_client, "aio-pika": aiopika_client}


# =============================================================================
# Orchestration (the parent process)
# =============================================================================
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) used so far by ``pid`` and its live descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(")") + 2:].split()
        stats[int(name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    children: dict[int, list[int]] = collections.defaultdict(list)
    for p, (ppid, _) in stats.items():
        children[ppid].append(p)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += stats[p][1]
        todo.extend(children.get(p, ()))
    return total


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out.extend(kids)
        todo.extend(kids)
    return out


class ClientRun:
    """Start client processes, wait until all are READY, say go, collect results."""

    def __init__(self, specs: list[dict], timeout: float) -> None:
        self.specs = specs
        self.timeout = timeout
        self.lines: queue_mod.Queue = queue_mod.Queue()
        self.procs: list[subprocess.Popen] = []

    def _reader(self, i: int, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.put((i, line.rstrip("\n")))
        self.lines.put((i, None))

    def _collect(self, want: str, which: set[int], deadline: float) -> dict[int, str]:
        got: dict[int, str] = {}
        while which - set(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"clients {sorted(which - set(got))} gave no {want} in time")
            try:
                i, line = self.lines.get(timeout=remaining)
            except queue_mod.Empty:
                continue
            if line is None:
                if i in which and i not in got:
                    raise RuntimeError(f"client {i} ({self.specs[i]['lib']} {self.specs[i]['role']}) exited "
                                       f"with status {self.procs[i].wait()} before {want}")
                continue
            if line.startswith(want) and i in which:
                got[i] = line[len(want):].strip()
            elif line:
                print(f"  [client {i}] {line}", file=sys.stderr)
        return got

    def run(self, on_go=None) -> list[dict]:
        try:
            for i, spec in enumerate(self.specs):
                proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--client", json.dumps(spec)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
                self.procs.append(proc)
                threading.Thread(target=self._reader, args=(i, proc), daemon=True).start()
            everyone = set(range(len(self.specs)))
            self._collect("READY", everyone, time.monotonic() + 60)
            if on_go:
                on_go()
            order = sorted(everyone, key=lambda i: {"consume": 0, "monitor": 1, "produce": 2}[self.specs[i]["role"]])
            for i in order:
                self.procs[i].stdin.write("go\n")
                self.procs[i].stdin.flush()
            workers = {i for i in everyone if self.specs[i]["role"] != "monitor"}
            results = self._collect("RESULT", workers, time.monotonic() + self.timeout + 15)
            for i in everyone - workers:  # monitors: stop now
                self.procs[i].stdin.write("stop\n")
                self.procs[i].stdin.flush()
            results.update(self._collect("RESULT", everyone - workers, time.monotonic() + 15))
            for proc in self.procs:
                proc.stdin.close()
                proc.wait(timeout=15)
            return [dict(json.loads(results[i]), lib=self.specs[i]["lib"]) for i in range(len(self.specs))]
        finally:
            for proc in self.procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()


# -- the brokers ---------------------------------------------------------------------
class QflowSide:
    name = "qflow"

    def __init__(self) -> None:
        from qflow import testing as qflowd

        self.daemon = qflowd.start("--log-level", "warning")  # as `make bench` starts it
        self.proc, self.port = self.daemon.proc, self.daemon.port
        self.pid = self.proc.pid

    def _admin(self, fn) -> object:
        import trio

        import qflow

        async def go():
            async with await qflow.connect("127.0.0.1", self.port) as conn:
                return await fn(await conn.session())

        return trio.run(go)

    def setup(self, queues: list[str], arguments: dict, fanout: str | None = None) -> None:
        async def fn(ssn):
            for q in queues:
                await ssn.declare_queue(q, arguments=arguments)
            if fanout:
                await ssn.declare_exchange(fanout, "fanout")
                for q in queues:
                    await ssn.bind(fanout, q)

        self._admin(fn)

    def teardown(self, queues: list[str], fanout: str | None = None) -> dict:
        async def fn(ssn):
            stats = {q: await ssn.query_queue(q) for q in queues}
            for q in queues:
                await ssn.delete_queue(q)
            if fanout:
                await ssn.delete_exchange(fanout)
            return stats

        stats = self._admin(fn)
        return {"flow_stops": sum(s.get("flowStoppedCount", 0) for s in stats.values()),
                "left": sum(s.get("msgDepth", 0) for s in stats.values())}

    def stop(self) -> None:
        self.daemon.stop()


class RabbitSide:
    name = "rabbitmq"

    def __init__(self, log) -> None:
        self.log = log
        self.dir = tempfile.mkdtemp(prefix="qflow-bench-rabbitmq-")
        self.port, self.dist_port, self.epmd_port = free_port(), free_port(), free_port()
        self.node = f"qflowbench{os.getpid()}@localhost"
        self.epmd: subprocess.Popen | None = None
        self.proc: subprocess.Popen | None = None
        self.conn = None
        self.version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "rabbitmq-server"],
                                      capture_output=True, text=True).stdout.strip()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        d = self.dir
        with open(os.path.join(d, "enabled_plugins"), "w") as f:
            f.write("[].\n")  # no plugins at all: no management plugin
        with open(os.path.join(d, "rabbitmq.conf"), "w") as f:
            f.write(f"listeners.tcp.default = 127.0.0.1:{self.port}\n"
                    "disk_free_limit.absolute = 50MB\n"
                    "loopback_users = none\n")
        env = {
            **os.environ,
            "HOME": d,  # the Erlang cookie goes here
            "ERL_EPMD_ADDRESS": "127.0.0.1",
            "ERL_EPMD_PORT": str(self.epmd_port),
            "ERL_CRASH_DUMP": os.path.join(d, "erl_crash.dump"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(d, "rabbitmq-env.conf"),  # not /etc/rabbitmq's
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_USE_LONGNAME": "false",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_CONFIG_FILE": os.path.join(d, "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(d, "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": os.path.join(d, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(d, "log"),
            "RABBITMQ_PLUGINS_EXPAND_DIR": os.path.join(d, "plugins-expand"),
            "RABBITMQ_PID_FILE": os.path.join(d, "rabbitmq.pid"),
            # Erlang distribution on loopback only, on the port chosen above.
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        }
        open(env["RABBITMQ_CONF_ENV_FILE"], "w").close()
        # Our own epmd on its own loopback port: the node registers there, and
        # stopping it cannot disturb any other Erlang node on this machine.
        self.epmd = subprocess.Popen([shutil.which("epmd") or "epmd", "-address", "127.0.0.1",
                                      "-port", str(self.epmd_port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _wait_port(self.epmd_port, 10, self.epmd)
        self.out = open(os.path.join(d, "stdout.log"), "w")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([RABBIT_SERVER], env=env, cwd=d, stdout=self.out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        import amqp

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rabbitmq-server exited with {self.proc.returncode}:\n{self._tail()}")
            try:
                conn = amqp.Connection(f"127.0.0.1:{self.port}", heartbeat=0, connect_timeout=2)
                conn.connect()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rabbitmq-server not ready after 120 s:\n{self._tail()}") from None
                time.sleep(0.5)
        self.conn = conn
        self.ch = conn.channel()
        pids = [self.proc.pid, *descendants(self.proc.pid)]
        self.log(f"RabbitMQ {self.version} ready in {time.monotonic() - t0:.1f} s on 127.0.0.1:{self.port} "
                 f"(node {self.node}, pids {pids}, epmd pid {self.epmd.pid} port {self.epmd_port}, dir {d})")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _tail(self) -> str:
        try:
            with open(os.path.join(self.dir, "stdout.log")) as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def beam_pid(self) -> int:
        for p in [self.proc.pid, *descendants(self.proc.pid)]:
            try:
                with open(f"/proc/{p}/comm") as f:
                    if f.read().strip() == "beam.smp":
                        return p
            except OSError:
                pass
        return self.proc.pid

    def setup(self, queues: list[str], arguments: dict, fanout: str | None = None) -> None:
        for q in queues:
            self.ch.queue_declare(q, durable=False, auto_delete=False, arguments=arguments)
        if fanout:
            self.ch.exchange_declare(fanout, "fanout", durable=False, auto_delete=False)
            for q in queues:
                self.ch.queue_bind(q, fanout, "")

    def teardown(self, queues: list[str], fanout: str | None = None) -> dict:
        left = 0
        for q in queues:
            left += self.ch.queue_declare(q, passive=True).message_count
            self.ch.queue_delete(q)
        if fanout:
            self.ch.exchange_delete(fanout)
        return {"left": left}

    def stop(self) -> None:
        """Stop only what we started, by PID: the node (SIGTERM to beam.smp,
        RabbitMQ's orderly shutdown), then our epmd."""
        if self.conn is not None:
            try:
                self.conn.close()
            except Exception:
                pass
            self.conn = None
        if self.proc is not None and self.proc.poll() is None:
            tree = descendants(self.proc.pid)
            try:
                os.kill(self.beam_pid(), signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                for p in [*tree, self.proc.pid]:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self.proc.wait()
            for p in tree:  # e.g. erl_child_setup, if it outlived beam.smp
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.epmd is not None and self.epmd.poll() is None:
            self.epmd.terminate()
            try:
                self.epmd.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.epmd.kill()
                self.epmd.wait()
        if getattr(self, "out", None):
            self.out.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _wait_port(port: int, seconds: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args[0]} exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {seconds} s")


def ensure_rabbitmq(log) -> None:
    if os.path.exists(RABBIT_SERVER):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit(f"{RABBIT_SERVER} is missing: install Debian's rabbitmq-server (needs root and apt-get)")
    log("installing Debian's rabbitmq-server with apt-get ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "--no-install-recommends", "rabbitmq-server"], check=True,
                   env=env, stdout=subprocess.DEVNULL)


# -- workloads -------------------------------------------------------------------------
class Bench:
    def __init__(self, args, qside: QflowSide, rside: RabbitSide, log) -> None:
        self.args = args
        self.sides = {"qflow": qside, "rabbitmq": rside}
        self.log = log
        self.seq = 0

    def throughput(self, workload: str, size_name: str, lib: str) -> dict:
        """One run of a throughput workload on one side: producers publish for
        --duration seconds, wait for every confirm/completion, then send END;
        msgs/s = data messages delivered / (last delivery - first publish)."""
        side = self.sides["qflow" if lib == "qflow" else "rabbitmq"]
        size = SIZES[size_name]
        self.seq += 1
        prefix = f"cmp.{self.seq}.{workload}"
        fanout = None
        arguments = QFLOW_PLAIN if lib == "qflow" else {}
        common = {"lib": lib, "port": side.port, "size": size, "timeout": self.args.client_timeout}
        prod = {**common, "role": "produce", "window": 1000, "exchange": "", "count": self.args.max_count,
                "duration": self.args.duration, "end": True}
        cons = {**common, "role": "consume", "prefetch": 1000, "ack_every": 500, "ends": 1}
        if workload == "1p1c":
            queues = [f"{prefix}.0"]
            specs = [{**cons, "queue": queues[0]}, {**prod, "routing_key": queues[0]}]
        elif workload == "4p4c":
            queues = [f"{prefix}.{i}" for i in range(4)]
            specs = [{**cons, "queue": q} for q in queues]
            specs += [{**prod, "routing_key": q} for q in queues]
        elif workload == "fanout4":
            queues = [f"{prefix}.{i}" for i in range(4)]
            fanout = f"{prefix}.fan"
            specs = [{**cons, "queue": q} for q in queues]
            specs.append({**prod, "exchange": fanout, "routing_key": ""})
        elif workload == "flow":
            queues = [f"{prefix}.0"]
            arguments = QFLOW_FLOW if lib == "qflow" else RABBIT_FLOW
            specs = [{**cons, "queue": queues[0], "ends": 2, "pause_every": self.args.slow_every,
                      "slow_factor": self.args.slow_factor}]
            specs += [{**prod, "routing_key": queues[0], "tag": t} for t in "ab"]
        else:
            raise ValueError(workload)
        side.setup(queues, arguments, fanout)
        try:
            cpu0 = [0.0]
            results = ClientRun(specs, self.args.client_timeout).run(
                on_go=lambda: cpu0.__setitem__(0, proc_tree_cpu(side.pid)))
            broker_cpu = proc_tree_cpu(side.pid) - cpu0[0]
        finally:
            stats = side.teardown(queues, fanout)
        producers = [r for r in results if r["role"] == "produce"]
        consumers = [r for r in results if r["role"] == "consume"]
        if any(r["timed_out"] for r in results):
            raise RuntimeError(f"{workload} {size_name} {lib}: a client timed out: {results}")
        acked = sum(r["acked"] for r in producers)
        received = sum(r["received"] for r in consumers)
        expected = acked * (4 if fanout else 1)
        if received != expected:
            raise RuntimeError(f"{workload} {size_name} {lib}: {acked} messages confirmed, {received} delivered "
                               f"(expected {expected}): {results}")
        t0 = min(r["t0"] for r in producers)
        elapsed = max(r["t_last"] for r in consumers) - t0
        return {
            # fanout: messages published (each was delivered four times)
            "msgs_per_s": round(acked / elapsed), "seconds": round(elapsed, 3), "count": acked,
            "broker_cpu_s": round(broker_cpu, 2), "producer_cpu_s": round(sum(r["cpu"] for r in producers), 2),
            "consumer_cpu_s": round(sum(r["cpu"] for r in consumers), 2),
            "resends": sum(r["resends"] for r in producers), "nacks": sum(r["nacked"] for r in producers),
            **{k: v for k, v in stats.items() if k == "flow_stops"},
            # the slow consumer's share of the run spent resting (3/4 when it keeps to its pace)
            **({"consumer_rested": round(consumers[0]["rested"] / elapsed, 2)} if workload == "flow" else {}),
        }

    def backpressure(self, lib: str) -> dict:
        """Three producers (windows 50/13/149; 1213/797/331 messages) into a
        373-message queue drained at a fixed slow rate."""
        side = self.sides["qflow" if lib == "qflow" else "rabbitmq"]
        self.seq += 1
        q = f"cmp.{self.seq}.backpressure"
        total = sum(BP_COUNTS)
        common = {"lib": lib, "port": side.port, "size": 64, "timeout": self.args.client_timeout, "track": True}
        specs = [{**common, "role": "consume", "queue": q, "count": total, "prefetch": BP_PREFETCH,
                  "ack_every": max(1, BP_PREFETCH // 2),
                  "rate": self.args.bp_rate}]
        specs += [{**common, "role": "produce", "exchange": "", "routing_key": q, "window": w, "count": n, "tag": t,
                   "backoff": self.args.bp_backoff_ms / 1000}
                  for w, n, t in zip(BP_WINDOWS, BP_COUNTS, "abc", strict=True)]
        specs.append({**common, "role": "monitor", "queue": q, "interval": 0.005, "consumer_prefetch": BP_PREFETCH})
        side.setup([q], QFLOW_BP if lib == "qflow" else RABBIT_BP)
        try:
            cpu0 = [0.0]
            results = ClientRun(specs, self.args.client_timeout).run(
                on_go=lambda: cpu0.__setitem__(0, proc_tree_cpu(side.pid)))
            broker_cpu = proc_tree_cpu(side.pid) - cpu0[0]
        finally:
            stats = side.teardown([q])
        producers = [r for r in results if r["role"] == "produce"]
        (consumer,) = [r for r in results if r["role"] == "consume"]
        (mon,) = [r for r in results if r["role"] == "monitor"]
        t0 = min(r["t0"] for r in producers)
        return {
            "lost": total - consumer["unique"],
            "duplicates": consumer["duplicates"],
            "resends": sum(r["resends"] for r in producers),
            "nacks": sum(r["nacked"] for r in producers),
            "publishes": sum(r["published"] for r in producers),
            # qflow: msgDepth (queued + delivered-unaccepted); RabbitMQ: ready + the consumer's prefetch,
            # the most that can be delivered-unacked (x-max-length counts ready messages only).
            "peak_depth": mon["peak_depth"] + mon["peak_unacked"],
            "peak_unacked_bound": mon["peak_unacked"],
            "wall_s": round(consumer["t_last"] - t0, 3),
            "broker_cpu_s": round(broker_cpu, 3),
            "producer_cpu_s": round(sum(r["cpu"] for r in producers), 3),
            "consumer_cpu_s": round(consumer["cpu"], 3),
            "timed_out": any(r.get("timed_out") for r in results),
            **{k: v for k, v in stats.items() if k == "flow_stops"},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a minute or two: fewer messages, one round")
    parser.add_argument("--rounds", type=int, default=0, help="A B rounds per workload (default 2, quick 1)")
    parser.add_argument("--duration", type=float, default=0,
                        help="seconds each producer publishes in a throughput run (default 2, quick 0.75)")
    parser.add_argument("--max-count", type=int, default=2_000_000,
                        help="at most this many messages per producer and run (bounds memory)")
    parser.add_argument("--clients", default=",".join(RABBIT_LIBS),
                        help="RabbitMQ clients to measure on the one-producer/one-consumer workload; the fastest "
                             "is used for the others")
    parser.add_argument("--close", type=float, default=0.25,
                        help="clients within this fraction of the fastest on 1p1c also run the other workloads")
    parser.add_argument("--workloads", default="1p1c,4p4c,fanout4,flow,backpressure")
    parser.add_argument("--slow-every", type=int, default=100, help="flow workload: after this many messages the "
                        "consumer rests ...")
    parser.add_argument("--slow-factor", type=float, default=3.0, help="... this many times as long as they took "
                        "(3: the consumer runs at a quarter of its own speed)")
    parser.add_argument("--bp-rate", type=float, default=1000, help="back-pressure consumer: messages per second")
    parser.add_argument("--bp-backoff-ms", type=float, default=10, help="RabbitMQ producers' pause after a nack")
    parser.add_argument("--client-timeout", type=float, default=120, help="seconds any one client may run")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.duration = args.duration or (0.75 if args.quick else 2.0)
    workloads = args.workloads.split(",")
    libs = [c for c in args.clients.split(",") if c]
    for c in libs:
        if c not in RABBIT_LIBS:
            raise SystemExit(f"unknown client {c!r}: choose from {', '.join(RABBIT_LIBS)}")
    started = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {msg}", file=sys.stderr, flush=True)

    sys.path.insert(0, HERE)
    from run import rss_peak_bytes, spin_loop  # bench/run.py: the same probe as `make bench`

    available = []
    for c in libs:
        try:
            __import__({"py-amqp": "amqp", "pika": "pika", "aio-pika": "aio_pika"}[c])
            available.append(c)
        except ImportError:
            log(f"client {c} is not installed: skipped (pip install pika aio-pika amqp)")
    if not available:
        raise SystemExit("no RabbitMQ client library installed: pip install pika aio-pika amqp")
    try:
        import amqp  # noqa: F401  (the orchestrator administers RabbitMQ with py-amqp)
    except ImportError:
        raise SystemExit("py-amqp is needed to administer RabbitMQ: pip install amqp") from None

    ensure_rabbitmq(log)
    stop_requested = []

    def on_term(signum, frame):  # turn SIGTERM into an exception so the finally blocks stop the brokers
        stop_requested.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    spin_before = spin_loop()
    qside = rside = None
    results: dict[str, dict[str, list[dict]]] = collections.defaultdict(lambda: collections.defaultdict(list))
    bp: dict[str, list[dict]] = collections.defaultdict(list)
    best: dict[str, str] = {}
    failures: list[str] = []
    rss = {}
    try:
        rside = RabbitSide(log)
        qside = QflowSide()
        log(f"qflowd ready on 127.0.0.1:{qside.port} (pid {qside.pid})")
        bench = Bench(args, qside, rside, log)
        finalists: dict[str, list[str]] = {}  # size -> the clients carried past the bake-off
        for workload in [w for w in workloads if w != "backpressure"]:
            for size_name in SIZES:
                key = f"{workload}_{size_name}"
                # The client bake-off is the 1p1c workload (every client); the others run with
                # the winner and any client within --close of it.
                cands = available if workload == "1p1c" else finalists.get(size_name, available)
                for rnd in range(args.rounds):
                    for lib in ["qflow", *cands]:  # interleaved: A B [B' B''] A B ...
                        try:
                            r = bench.throughput(workload, size_name, lib)
                        except RuntimeError as exc:  # one failed run: say so, and go on
                            failures.append(f"{key} round {rnd + 1} {lib}: {exc}")
                            log(f"{key:>12} round {rnd + 1} {lib:>8}: FAILED: {str(exc)[:300]}")
                            continue
                        r["round"] = rnd
                        results[key][lib].append(r)
                        extra = f", {r['resends']} resends" if r["resends"] else ""
                        extra += f", {r['flow_stops']} flow stops" if r.get("flow_stops") else ""
                        extra += f", consumer rested {r['consumer_rested']:.0%}" if "consumer_rested" in r else ""
                        log(f"{key:>12} round {rnd + 1} {lib:>8}: {r['msgs_per_s']:>8} msg/s "
                            f"({r['count']} in {r['seconds']} s, broker cpu {r['broker_cpu_s']} s{extra})")
                speed = {c: statistics.median(x["msgs_per_s"] for x in results[key][c])
                         for c in cands if results[key][c]}
                if not speed:
                    continue
                best[key] = max(speed, key=speed.__getitem__)
                if workload == "1p1c":
                    finalists[size_name] = [c for c in speed if speed[c] >= (1 - args.close) * speed[best[key]]]
                    log(f"{key}: fastest RabbitMQ client {best[key]}; carried on: {', '.join(finalists[size_name])}")
        if "backpressure" in workloads:
            bp_lib = best.get("1p1c_64b", available[0])
            for rnd in range(args.rounds):
                for lib in ("qflow", bp_lib):
                    try:
                        r = bench.backpressure(lib)
                    except RuntimeError as exc:
                        failures.append(f"back-pressure round {rnd + 1} {lib}: {exc}")
                        log(f"back-pressure round {rnd + 1} {lib:>8}: FAILED: {str(exc)[:300]}")
                        continue
                    bp[lib].append(r)
                    log(f"back-pressure round {rnd + 1} {lib:>8}: {json.dumps(r)}")
        rss = {"qflow": rss_peak_bytes(qside.pid), "rabbitmq": rss_peak_bytes(rside.beam_pid())}
    finally:
        for side in (qside, rside):
            if side is not None:
                side.stop()
        log("brokers stopped")
    spin_after = spin_loop()

    # -- report ----------------------------------------------------------------------
    def med(runs: list[dict], field: str = "msgs_per_s") -> float:
        return statistics.median(r[field] for r in runs) if runs else 0

    def us_per_msg(runs: list[dict]) -> float:
        return statistics.median(1e6 * r["broker_cpu_s"] / max(1, r["count"]) for r in runs) if runs else 0

    ratios, per_client, rows = {}, collections.defaultdict(dict), []
    for key, by_lib in results.items():
        b = best.get(key)
        if not by_lib.get("qflow") or not b:
            continue
        # Each round's qflow/RabbitMQ pair ran back to back; the median of the pair
        # ratios cancels the machine's drift between rounds.
        rmq_by_round = {r["round"]: r for r in by_lib[b]}
        pair = [q["msgs_per_s"] / rmq_by_round[q["round"]]["msgs_per_s"] for q in by_lib["qflow"]
                if q["round"] in rmq_by_round]
        ratios[key] = round(statistics.median(pair), 2) if pair else None
        for lib, runs in by_lib.items():
            if lib != "qflow":
                per_client[lib][key] = round(med(runs))
        rows.append((key, round(med(by_lib["qflow"])), round(med(by_lib[b])), b, ratios[key],
                     us_per_msg(by_lib["qflow"]), us_per_msg(by_lib[b])))
    print()
    print("throughput, median msg/s of the rounds; ratio = median of the per-round qflow/RabbitMQ ratios")
    print(f"{'workload':<13}{'qflow':>9}{'RabbitMQ':>10}  {'client':<9}{'ratio':>7}   broker CPU us/msg: qflow  RabbitMQ")
    for key, q, rb, b, ratio, qc, rc in rows:
        print(f"{key:<13}{q:>9}{rb:>10}  {b:<9}{(ratio or 0):>6.1f}x{qc:>27.1f}{rc:>10.1f}")
    if per_client:
        keys = [k for k in results if any(k in v for v in per_client.values())]
        print("RabbitMQ clients, median msg/s: " + "  ".join(
            f"{lib}: " + ", ".join(f"{k} {vals[k]}" for k in keys if k in vals) for lib, vals in per_client.items()))
    bp_summary = {}
    if bp:
        print()
        print(f"back-pressure: {sum(BP_COUNTS)} messages from 3 producers (windows {'/'.join(map(str, BP_WINDOWS))}), "
              f"limit {BP_MAX}, consumer {args.bp_rate:g} msg/s; medians ({args.rounds} run(s), lost/peak: worst)")
        print(f"{'':<20}{'lost':>6}{'resends':>9}{'publishes':>11}{'peak depth':>12}{'wall s':>8}"
              f"{'broker CPU s':>14}{'producer CPU s':>16}")
        for lib, runs in bp.items():
            side = "qflow" if lib == "qflow" else "rabbitmq"
            m = {c: med(runs, c) for c in ("resends", "nacks", "publishes", "duplicates", "wall_s", "broker_cpu_s",
                                           "producer_cpu_s", "consumer_cpu_s")}
            m = {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()}
            m["lost"] = max(r["lost"] for r in runs)  # the worst run, not the median
            m["peak_depth"] = max(r["peak_depth"] for r in runs)
            m["timed_out"] = any(r["timed_out"] for r in runs)
            m["client"] = lib
            m["runs"] = len(runs)
            bp_summary[side] = m
            print(f"{side + ' (' + lib + ')':<20}{m['lost']:>6}{m['resends']:>9.0f}{m['publishes']:>11.0f}"
                  f"{m['peak_depth']:>12}{m['wall_s']:>8.2f}{m['broker_cpu_s']:>14.2f}{m['producer_cpu_s']:>16.2f}")
    out = {
        "ratio_vs_rabbitmq": ratios,
        "rabbitmq_client": best.get("1p1c_64b"),
        "rabbitmq_client_per_workload": best,
        "rabbitmq_clients_msgs_per_s": per_client,
        "qflow_msgs_per_s": {k: round(med(v["qflow"])) for k, v in results.items()},
        "rabbitmq_msgs_per_s": {k: round(med(v[best[k]])) for k, v in results.items() if k in best},
        # the flow workload: how often qflow stopped its producers, how often RabbitMQ's made them resend
        "flow_events": {k: {"qflow_flow_stops": med(v["qflow"], "flow_stops") if v["qflow"] else None,
                            "rabbitmq_resends": med(v[best[k]], "resends"),
                            # the slow consumers' share of the run spent resting: 0.75 keeps the pace
                            "qflow_consumer_rested": med(v["qflow"], "consumer_rested") if v["qflow"] else None,
                            "rabbitmq_consumer_rested": med(v[best[k]], "consumer_rested")}
                        for k, v in results.items() if k.startswith("flow_") and k in best},
        "backpressure": bp_summary,
        "broker_peak_rss": rss,
        "rabbitmq_version": rside.version if rside else None,
        "rounds": args.rounds,
        "duration_s": args.duration,
        "quick": args.quick,
        "spin_loop_s": [round(spin_before, 3), round(spin_after, 3)],
        "failures": failures,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--client":
        spec = json.loads(sys.argv[2])
        CLIENTS[spec["lib"]](spec)
    else:
        main()

"""The client processes of ``bench/compare``: every producer, consumer and
depth monitor, for qflow (trio) and for RabbitMQ through py-amqp, pika and
aio-pika.

A client is ``python bench/compare --client SPEC_JSON``. It connects and sets
up, prints READY, waits for "go" on stdin, runs, and prints one line
"RESULT {json}". Times are time.monotonic() (CLOCK_MONOTONIC, shared by all
processes), CPU is the client's own process time from "go" to the end.

The RabbitMQ clients share one publisher-confirm bookkeeping (``Pub``) and
every consumer, qflow's too, shares one consumer bookkeeping (``Cons``), so
the sides differ only in what their client libraries do. This module imports
nothing outside the standard library at import time: tests load it by path.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
        self.timeout = spec["timeout"]
        self.give_up = math.inf
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
        self.give_up = now + self.timeout

    def running(self, now: float) -> bool:
        """Something is left to publish or to be confirmed, and there is time for it."""
        return not self.done() and now <= self.give_up

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


async def _consume_plain(fetch, cons: Cons) -> None:
    """``Cons.got`` inlined, for the throughput workloads (no pacing, no ids):
    make bench's consumer loop plus only what a run bounded in time needs, the
    END check and the clock. A call to ``got`` per message costs about as much
    again as reading the body: a tenth of a qflow consumer's time per message,
    but under 1 % of a RabbitMQ client's. The clock is read every 64 messages,
    not after each (a clock read is another 5 % of a qflow consumer's time per
    message): the last data message's time is then early by at most 63
    messages' work, about 0.1 ms of a run of 0.5 s or more."""
    end, clock = END, time.monotonic
    n, t_last, ends = 0, 0.0, 0
    try:
        while True:
            body = (await fetch()).body
            if body == end:
                ends += 1
                if ends >= cons.ends:
                    return
                continue
            n += 1
            if not n & 63:
                t_last = clock()
    finally:
        cons.n, cons.ends_seen = n, ends
        cons.t_last = t_last or cons.t_last


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
            sender = ssn.sender(address, capacity=spec["window"], durable=bool(spec.get("persistent")))
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
                if spec.get("plain"):
                    # Nothing can be refused and the body never changes: make bench's
                    # loop, so that its 64b figure and 1p1c_64b's measure the same client
                    # work; the clock is read once per 64 sends, as RabbitMQ's Pub does.
                    fixed = body(0)
                    while sent < count and time.monotonic() <= end_at:
                        n = min(64, count - sent)
                        for _ in range(n):
                            await send(fixed)
                        sent += n
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
                if spec.get("plain"):
                    await _consume_plain(fetch, cons)
                else:
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
        # delivery_mode 2: persistent (on a durable queue, confirmed once RabbitMQ has it on disk)
        props = {"delivery_mode": 2} if spec.get("persistent") else {}
        fixed = None if spec.get("track") else amqp.Message(body(0), **props)
        publish = ch.basic_publish
        drain = conn.drain_events
        _ready()
        _wait_go()
        t0, c0 = time.monotonic(), time.process_time()
        pub.start(t0)
        while pub.running(now := time.monotonic()):
            idx = pub.next_to_send(now)
            if idx is not None:
                publish(fixed if fixed is not None and idx >= 0 else amqp.Message(body(idx), **props),
                        exchange=exchange, routing_key=rk)
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
        props = pika.BasicProperties(delivery_mode=2) if spec.get("persistent") else None
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
                publish(exchange, rk, body(idx), props)
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
            mode = aio_pika.DeliveryMode.PERSISTENT if spec.get("persistent") else aio_pika.DeliveryMode.NOT_PERSISTENT

            def Message(b: bytes) -> aio_pika.Message:  # noqa: N802 - aio_pika's class, with the delivery mode
                return aio_pika.Message(b, delivery_mode=mode)

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
            create = asyncio.ensure_future
            publish = ex.publish
            while pub.running(now := time.monotonic()):
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


def run_client(spec_json: str) -> None:
    spec = json.loads(spec_json)
    CLIENTS[spec["lib"]](spec)

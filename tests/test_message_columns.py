"""qflow.client.message.columns: many messages' fields column by column, the
same as reading each message's fields one by one."""

from __future__ import annotations

import qflow
from qflow.client.message import arrow_columns, columns
from tests.conftest import wait_for


async def test_columns_match_the_per_message_fields(ssn):
    await ssn.declare_queue("q")
    sender = ssn.sender("q")
    await sender.send_many([b"a", b"b"])  # a run sharing exchange, key and properties
    await sender.send(b"x" * 300, message_id="m-1", headers={"k": "v", "n": 1})  # a bin16 body
    await sender.send(b"y" * 70_000, correlation_id="c", content_type="text/plain")  # a bin32 body
    await sender.send_many([b"c", b"d"], message_id="same")
    await sender.send(b"")
    await sender.sync()
    receiver = await ssn.receiver("q", accept="none")
    got: list[qflow.ReceivedMessage] = []
    while len(got) < 7:
        got += await receiver.fetch_many(timeout=10)
    bodies, exchanges, keys, props, seqs, redelivered = columns(got)
    assert bodies == [m.body for m in got] and bodies[2] == b"x" * 300 and bodies[6] == b""
    assert exchanges == [m.exchange for m in got] == [""] * 7
    assert keys == [m.routing_key for m in got] == ["q"] * 7
    assert props == [m.properties for m in got]
    assert props[2] == {"message_id": "m-1", "headers": {"k": "v", "n": 1}}
    assert seqs == [m.sequence for m in got] == list(range(1, 8))
    assert redelivered == [m.redelivered for m in got] == [False] * 7
    assert columns([]) == ([], [], [], [], [], [])


def _arrow_as_lists(messages: list[qflow.ReceivedMessage]) -> tuple[list, ...]:
    bodies, seqs, redelivered, index, heads = arrow_columns(messages)
    fields = [heads[i] for i in index.to_pylist()]
    return (bodies.to_pylist(), [f[0] for f in fields], [f[1] for f in fields], [f[2] for f in fields],
            seqs.to_pylist(), redelivered.to_pylist())


async def test_arrow_columns_are_the_columns(running, ssn):
    """arrow_columns (Arrow arrays, built from the runs' bytes) gives what
    columns gives, for messages of several runs and heads, out of order,
    with gaps in their sequence numbers, and redelivered."""
    await ssn.declare_queue("q")
    sender = ssn.sender("q", capacity=100)
    await sender.send_many([b"r%d" % i for i in range(300)])  # runs sharing their head
    await sender.send_many([b"i" * 300] * 5, message_ids=[f"id-{i}" for i in range(5)], content_type="t")
    await sender.send(b"y" * 70_000, headers={"k": "v", "n": 1})
    await sender.send_many([b"", b"e"])
    await sender.sync()
    other = await running.connect()
    taker = await (await other.session()).receiver("q", accept="explicit", capacity=3)
    assert len(await taker.fetch_many(timeout=10)) >= 1  # delivered, not accepted: redelivered once its session ends
    await other.close()

    async def all_available() -> bool:  # the taker's deliveries are back on the queue
        return len((await ssn.available("q", 0, -1))["sequences"]) == 308

    await wait_for(all_available)
    got: list[qflow.ReceivedMessage] = []
    browser = await ssn.receiver("q", browse=True, capacity=50)
    while len(got) < 308:
        got += await browser.fetch_many(timeout=10)
    assert _arrow_as_lists(got) == columns(got)
    assert any(_arrow_as_lists(got)[5]) and sorted(m.sequence for m in got) == list(range(1, 309))
    picked = got[5:9] + got[20:300:7] + got[299:] + got[:2]  # gaps, several runs, not in order
    assert _arrow_as_lists(picked) == columns(picked)
    assert _arrow_as_lists(got[:1]) == columns(got[:1])
    assert [len(a) for a in arrow_columns([])[:4]] == [0, 0, 0, 0]

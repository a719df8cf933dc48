"""qflow.client.message.columns: many messages' fields column by column, the
same as reading each message's fields one by one."""

from __future__ import annotations

import qflow
from qflow.client.message import columns


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

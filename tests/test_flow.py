"""Producer flow control end to end, each rule of the Qpid C++ manual by example.

Broker and clients talk over loopback. The whole file runs once per
accounting implementation (``make test`` sets QFLOW_ACCOUNTING).
"""

from __future__ import annotations

import logging

import pytest
import trio

import qflow
from qflow.broker.settings import FlowDefaults
from tests.conftest import start_broker, wait_for


async def stats(ssn: qflow.Session, queue: str) -> dict:
    return await ssn.query_queue(queue)


async def push_until_blocked(nursery: trio.Nursery, sender: qflow.Sender, limit: int = 100_000) -> None:
    """Send from a background task until ``capacity`` transfers are incomplete."""

    async def run() -> None:
        for i in range(limit):
            await sender.send(b"m%d" % i)

    nursery.start_soon(run)
    await wait_for(lambda: sender.incomplete >= sender.capacity)


async def drain(receiver: qflow.Receiver, n: int) -> list[qflow.ReceivedMessage]:
    out = []
    for _ in range(n):
        out.append(await receiver.fetch(timeout=20))
    receiver._flush_acks()  # accept now, not at the next fetch
    return out


async def test_manual_count_example_900_500_of_1000(running, ssn, nursery):
    """Max 1000 messages, stop 900, resume 500: OFF while <= 900, ON at the 901st,
    ON until fewer than 500, then OFF."""
    await ssn.declare_queue("q", arguments={"qpid.max_count": 1000, "qpid.flow_stop_count": 900,
                                            "qpid.flow_resume_count": 500})
    sender = ssn.sender("q", capacity=2000)
    for i in range(900):
        await sender.send(b"%d" % i)
    await sender.sync()
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"], s["flowStoppedCount"]) == (900, False, 0)

    await sender.send(b"901st")
    await wait_for(lambda: sender.session.held_by)
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"], s["flowStoppedCount"], s["heldTransfers"]) == (901, True, 1, 1)
    assert sender.incomplete == 1

    rssn = await ssn.conn.session()
    receiver = await rssn.receiver("q", capacity=1, accept="explicit")
    for _ in range(401):  # 901 -> 500: still ON ("until ... less than 500")
        msg = await receiver.fetch(timeout=20)
        msg.accept()
    await rssn.sync()
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"]) == (500, True)
    assert sender.incomplete == 1

    msg = await receiver.fetch(timeout=20)  # 499 < 500: OFF, the held transfer completes
    msg.accept()
    with trio.fail_after(20):
        await sender.sync()
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"], s["flowStoppedCount"], s["heldTransfers"]) == (499, False, 1, 0)


async def test_manual_combined_example_4000_messages_8k_bytes(running, ssn):
    """Stop at 4000 messages or 8K bytes (either), resume below 3000 AND 6K (both).

    Bytes are message sizes (docs/protocol.md): a message to "by-size" on the default
    exchange with no properties is 10 bytes ("" 1, "by-size" 8, nil 1) plus its body,
    one to "by-count" 12 with a one-byte body ("by-count" is 9). With the header
    counted, as qpidd counts it since QPID-5199, 4001 messages can never fit in 8K
    bytes, so the count alone is shown against ten times the manual's bytes."""
    args = {"qpid.max_count": 5000, "qpid.max_size": 10240, "qpid.flow_stop_count": 4000,
            "qpid.flow_resume_count": 3000, "qpid.flow_stop_size": 8192, "qpid.flow_resume_size": 6144}
    await ssn.declare_queue("by-count", arguments={**args, "qpid.max_size": 102400, "qpid.flow_stop_size": 81920,
                                                   "qpid.flow_resume_size": 61440})
    await ssn.declare_queue("by-size", arguments=args)
    sender = ssn.sender("by-count", capacity=10)

    # ON by count alone: 4001 messages of 12 bytes are only 48012 bytes.
    for _ in range(4000):
        await sender.send(b"x")
    await sender.sync()
    assert (await stats(ssn, "by-count"))["flowStopped"] is False
    await sender.send(b"x")
    await wait_for(lambda: sender.session.held_by)
    s = await stats(ssn, "by-count")
    assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (4001, 4001 * 12, True)

    # ON by bytes alone: 8 messages of 1010 bytes are 8080, not above 8192; the 9th makes 9090.
    big = ssn.sender("by-size", capacity=10)
    for _ in range(8):
        await big.send(b"b" * 1000)
    await big.sync()
    assert (await stats(ssn, "by-size"))["flowStopped"] is False
    await big.send(b"b" * 1000)
    await wait_for(lambda: big.incomplete == 1 and "by-size" in big.session.held_by)
    s = await stats(ssn, "by-size")
    assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (9, 9090, True)

    # OFF only when both are below.
    rssn = await ssn.conn.session()
    receiver = await rssn.receiver("by-count", capacity=500, accept="auto")
    await drain(receiver, 1002)  # 4001 -> 2999 messages, 35988 bytes: both below
    await wait_for(lambda: sender.incomplete == 0)
    s = await stats(ssn, "by-count")
    assert (s["msgDepth"], s["flowStopped"], s["flowStoppedCount"]) == (2999, False, 1)

    # by-size: the count (9) is far below 3000, but the bytes must come below 6144 too.
    r2 = await rssn.receiver("by-size", capacity=1, accept="explicit")
    for _ in range(2):  # 9090 -> 7070 bytes: still ON
        (await r2.fetch(timeout=20)).accept()
    await rssn.sync()
    assert (await stats(ssn, "by-size"))["flowStopped"] is True
    assert big.incomplete == 1
    (await r2.fetch(timeout=20)).accept()  # 6060 < 6144 and 6 < 3000: OFF
    with trio.fail_after(20):
        await big.sync()
    assert (await stats(ssn, "by-size"))["flowStopped"] is False


async def test_both_resume_thresholds_must_be_satisfied(running, ssn):
    """Count below its resume threshold is not enough while bytes are not below theirs."""
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 10, "qpid.flow_resume_count": 5,
                                            "qpid.flow_stop_size": 1000, "qpid.flow_resume_size": 500,
                                            "qpid.max_size": 0})
    sender = ssn.sender("q", capacity=100)
    for _ in range(3):
        await sender.send(b"x" * 400)  # 3 messages of 404 bytes ("" 1, "q" 2, nil 1, body 400): ON by size
    await wait_for(lambda: sender.session.held_by)
    rssn = await ssn.conn.session()
    receiver = await rssn.receiver("q", capacity=1, accept="explicit")
    (await receiver.fetch(timeout=20)).accept()  # 2 messages (< 5), 808 bytes (not < 500): still ON
    await rssn.sync()
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["byteDepth"], s["flowStopped"]) == (2, 808, True)
    (await receiver.fetch(timeout=20)).accept()  # 1 message, 404 bytes: OFF
    with trio.fail_after(20):
        await sender.sync()
    assert (await stats(ssn, "q"))["flowStopped"] is False


async def test_manual_capacity_example_c1_50_c2_15_overshoot_at_most_65(running, nursery):
    """Stop 100, C1 capacity 50, C2 capacity 15: the queue receives up to 165 messages."""
    c1 = await running.connect(name="C1")
    c2 = await running.connect(name="C2")
    s1, s2 = await c1.session(), await c2.session()
    await s1.declare_queue("q", arguments={"qpid.flow_stop_count": 100})
    send1, send2 = s1.sender("q", capacity=50), s2.sender("q", capacity=15)
    await push_until_blocked(nursery, send1)
    await push_until_blocked(nursery, send2)
    s = await stats(s1, "q")
    assert s["msgDepth"] == 165
    assert s["flowStopped"] is True
    assert s["heldTransfers"] == 65
    assert s["worstCaseDepth"] == 165
    assert send1.max_incomplete == 50 and send2.max_incomplete == 15
    await trio.sleep(0.2)  # nothing more arrives while both are blocked
    assert (await stats(s1, "q"))["msgDepth"] == 165
    nursery.cancel_scope.cancel()


async def test_fanout_to_stopped_and_unstopped_queue_completes_when_both_release(running, ssn):
    await ssn.declare_queue("stopped", arguments={"qpid.flow_stop_count": 1})
    await ssn.declare_queue("open")
    await ssn.declare_exchange("fan", "fanout")
    await ssn.bind("fan", "stopped")
    await ssn.bind("fan", "open")
    direct = ssn.sender("stopped", capacity=10)
    await direct.send(b"1")
    await direct.sync()
    fan = ssn.sender("fan/", capacity=10)
    await fan.send(b"both")  # 'stopped' goes to 2 > 1: ON, holds; 'open' does not hold
    await wait_for(lambda: "stopped" in ssn.held_by)
    assert fan.incomplete == 1
    assert (await stats(ssn, "open"))["msgDepth"] == 1
    rssn = await ssn.conn.session()
    r_open = await rssn.receiver("open", accept="auto")
    await drain(r_open, 1)
    await rssn.sync()
    assert fan.incomplete == 1  # 'open' let go, 'stopped' still holds
    r_stopped = await rssn.receiver("stopped", accept="auto")
    await drain(r_stopped, 2)  # 0 < 1: OFF
    with trio.fail_after(20):
        await fan.sync()


async def test_held_message_consumed_while_flow_still_on_is_released_alone(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 2})
    first = ssn.sender("q", capacity=100)
    for _ in range(5):
        await first.send(b"early")
    await first.sync()
    held = ssn.sender("q", capacity=100)
    for _ in range(3):
        await held.send(b"held")  # depth 6, 7, 8: all held
    await wait_for(lambda: held.incomplete == 3)
    assert (await stats(ssn, "q"))["heldTransfers"] == 3
    rssn = await ssn.conn.session()
    receiver = await rssn.receiver("q", capacity=1, accept="explicit")
    for _ in range(5):  # consume the 5 early ones: depth 3, still ON (3 >= 2)
        (await receiver.fetch(timeout=20)).accept()
    await rssn.sync()
    s = await stats(ssn, "q")
    assert (s["flowStopped"], s["heldTransfers"], held.incomplete) == (True, 3, 3)
    (await receiver.fetch(timeout=20)).accept()  # a held one is dequeued: depth 2, still ON
    await rssn.sync()
    await wait_for(lambda: held.incomplete == 2)
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"], s["heldTransfers"]) == (2, True, 2)


async def test_queue_deletion_releases_blocked_senders(running, ssn, nursery):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 3})
    sender = ssn.sender("q", capacity=4)
    await push_until_blocked(nursery, sender, limit=7)
    other = await (await running.connect()).session()
    await other.delete_queue("q")
    with trio.fail_after(20):
        await sender.sync()
    assert sender.incomplete == 0


async def test_explicit_zero_stop_thresholds_disable_flow_control(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.max_count": 100, "qpid.flow_stop_count": 0,
                                            "qpid.flow_stop_size": 0})
    sender = ssn.sender("q", capacity=5)
    for _ in range(100):
        await sender.send(b"x")
    await sender.sync()
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["flowStopped"], s["flowStopCount"], s["flowStopSize"]) == (100, False, 0, 0)
    with pytest.raises(qflow.ResourceLimitExceeded):
        await sender.send(b"101st")
        await sender.sync()


async def test_ring_queues_never_get_flow_control(running, ssn):
    await ssn.declare_queue("ring", arguments={"qpid.max_count": 10, "qpid.policy_type": "ring",
                                               "qpid.flow_stop_count": 5})
    sender = ssn.sender("ring", capacity=3)
    for i in range(50):
        await sender.send(b"%d" % i)
    await sender.sync()
    s = await stats(ssn, "ring")
    assert (s["msgDepth"], s["flowStopped"], s["flowStopCount"], s["discardsRing"]) == (10, False, 0, 40)


async def test_broker_default_thresholds_are_percentages_of_the_maximum(nursery):
    running = await start_broker(nursery, FlowDefaults(80, 70, 0))
    async with await running.connect() as conn:
        ssn = await conn.session()
        await ssn.declare_queue("q", arguments={"qpid.max_count": 10000, "qpid.max_size": 1000000})
        s = await stats(ssn, "q")
        assert (s["flowStopCount"], s["flowResumeCount"]) == (8000, 7000)
        assert (s["flowStopSize"], s["flowResumeSize"]) == (800000, 700000)
        await ssn.declare_queue("odd", arguments={"qpid.max_size": 2950001})
        s = await stats(ssn, "odd")
        assert (s["flowStopSize"], s["flowResumeSize"], s["flowStopCount"]) == (2360001, 2065000, 0)


async def test_default_queue_limit_gives_every_queue_default_flow_control(nursery):
    running = await start_broker(nursery, FlowDefaults(80, 70, 1000))
    async with await running.connect() as conn:
        ssn = await conn.session()
        await ssn.declare_queue("q")
        s = await stats(ssn, "q")
        assert (s["maxSize"], s["flowStopSize"], s["flowResumeSize"]) == (1000, 800, 700)
        sender = ssn.sender("q", capacity=2)
        body = b"x" * 96  # a message of 100 bytes: "" 1, "q" 2, nil 1 and the body
        for _ in range(8):
            await sender.send(body)
        await sender.sync()
        await sender.send(body)  # 900 > 800: held
        await wait_for(lambda: ssn.held_by)
        await sender.send(body)  # 1000: still fits the 1000-byte maximum
        await wait_for(lambda: sender.incomplete == 2)
        assert (await stats(ssn, "q"))["byteDepth"] == 1000


async def test_zero_default_percentages_turn_default_flow_control_off(nursery):
    running = await start_broker(nursery, FlowDefaults(0, 0))
    async with await running.connect() as conn:
        ssn = await conn.session()
        await ssn.declare_queue("plain", arguments={"qpid.max_count": 10})
        await ssn.declare_queue("manual", arguments={"qpid.flow_stop_count": 4})
        assert (await stats(ssn, "plain"))["flowStopCount"] == 0
        assert (await stats(ssn, "manual"))["flowStopCount"] == 4


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        ({"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 9},
         ["qpid.flow_resume_count", "qpid.flow_stop_count"]),
        ({"qpid.flow_stop_size": 50, "qpid.flow_resume_size": 90},
         ["qpid.flow_resume_size", "qpid.flow_stop_size"]),
        ({"qpid.max_count": 10, "qpid.flow_stop_count": 11}, ["qpid.flow_stop_count", "qpid.max_count"]),
        ({"qpid.max_size": 10, "qpid.flow_stop_size": 11}, ["qpid.flow_stop_size", "qpid.max_size"]),
        ({"qpid.flow_stop_count": -1}, ["qpid.flow_stop_count"]),
        ({"qpid.flow_stop_count": 2.5}, ["qpid.flow_stop_count"]),
        ({"qpid.flow_stop_size": "100"}, ["qpid.flow_stop_size"]),
        ({"qpid.flow_stop_count": 2**32}, ["qpid.flow_stop_count"]),
    ],
)
async def test_bad_thresholds_are_refused_naming_the_keys(running, ssn, arguments, words):
    with pytest.raises(qflow.InvalidArgument) as err:
        await ssn.declare_queue("bad", arguments=arguments)
    for word in words:
        assert word in err.value.text
    with pytest.raises(qflow.NotFound):
        await ssn.query_queue("bad")
    await ssn.declare_queue("good")  # the session is unharmed


async def test_consumer_on_the_same_session_keeps_receiving_while_producer_is_held(running, ssn, nursery):
    """Flow control holds transfers, never connections or sessions."""
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 10, "qpid.flow_resume_count": 5})
    sender = ssn.sender("q", capacity=5)
    await push_until_blocked(nursery, sender, limit=15)
    assert (await stats(ssn, "q"))["flowStopped"] is True
    receiver = await ssn.receiver("q", capacity=100, accept="auto")  # same session as the held producer
    got = await drain(receiver, 15)
    assert len(got) == 15
    with trio.fail_after(20):
        await sender.sync()
    assert (await stats(ssn, "q"))["flowStopped"] is False


async def test_session_opened_while_stopped_is_held_from_its_first_transfer(running, ssn, nursery):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 2})
    first = ssn.sender("q", capacity=10)
    for _ in range(3):
        await first.send(b"x")
    await wait_for(lambda: ssn.held_by)
    late = await (await running.connect()).session()
    sender = late.sender("q", capacity=10)
    await sender.send(b"late")
    await wait_for(lambda: "q" in late.held_by)
    assert sender.incomplete == 1
    assert (await stats(ssn, "q"))["heldTransfers"] == 2


async def test_closing_a_held_producer_keeps_its_messages(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 2})
    conn = await running.connect()
    producer = (await conn.session()).sender("q", capacity=10)
    for _ in range(5):
        await producer.send(b"x")
    await wait_for(lambda: producer.incomplete == 3)
    assert (await stats(ssn, "q"))["heldTransfers"] == 3
    await conn.close()
    await wait_for(lambda: not running.broker.held_sessions(running.broker.queues["q"]))
    s = await stats(ssn, "q")
    assert (s["msgDepth"], s["heldTransfers"], s["flowStopped"]) == (5, 0, True)
    receiver = await ssn.receiver("q", accept="auto")
    assert len(await drain(receiver, 5)) == 5
    await ssn.sync()
    assert (await stats(ssn, "q"))["flowStopped"] is False


async def test_live_threshold_change_releases_held_transfers(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 2})
    sender = ssn.sender("q", capacity=10)
    for _ in range(4):
        await sender.send(b"x")
    await wait_for(lambda: sender.incomplete == 2)
    with pytest.raises(qflow.InvalidArgument):
        await ssn.modify_queue("q", {"qpid.flow_stop_count": 5, "qpid.flow_resume_count": 6})
    assert sender.incomplete == 2
    s = await ssn.modify_queue("q", {"qpid.flow_stop_count": 10, "qpid.flow_resume_count": 8})
    assert (s["flowStopCount"], s["flowResumeCount"]) == (10, 8)
    with trio.fail_after(20):
        await sender.sync()
    s = await stats(ssn, "q")
    assert (s["flowStopped"], s["msgDepth"], s["flowStoppedCount"]) == (False, 4, 1)


async def test_modify_resolves_the_arguments_plus_the_change_as_a_declare(running, ssn):
    # Issue 13: a live change re-resolves against the queue's arguments plus the change, by qpidd's rule.
    await ssn.declare_queue("q", arguments={"qpid.max_count": 1000, "qpid.flow_stop_count": 900})
    s = await stats(ssn, "q")  # "resumes at 700 (the default 70 %), and keeps the size thresholds"
    assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopSize"], s["flowResumeSize"]) == (
        900, 700, 83886080, 73400320)
    s = await ssn.modify_queue("q", {"qpid.flow_resume_count": 0})  # resume 0 becomes the stop
    assert (s["flowStopCount"], s["flowResumeCount"]) == (900, 900)
    s = await ssn.modify_queue("q", {"qpid.max_count": 100, "qpid.flow_stop_count": 80, "qpid.flow_resume_count": 5})
    assert (s["flowStopCount"], s["flowResumeCount"], s["maxCount"]) == (80, 5, 100)
    with pytest.raises(qflow.InvalidArgument, match=r"qpid\.flow_resume_size=73400320"):
        await ssn.modify_queue("q", {"qpid.flow_stop_size": 5000})  # the pre-filled resume size is larger
    s = await stats(ssn, "q")  # a refused change changes nothing
    assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopSize"]) == (80, 5, 83886080)
    assert "qpid.flow_stop_size" not in s["arguments"]


async def test_resume_without_stop_is_accepted_with_a_warning(running, ssn, caplog):
    # qpidd's createLimit logs a warning for a resume key with no stop key, and creates the queue.
    caplog.set_level(logging.WARNING, logger="qflow.broker")
    await ssn.declare_queue("q", arguments={"qpid.flow_resume_count": 5})
    s = await stats(ssn, "q")
    assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopSize"], s["flowResumeSize"]) == (
        0, 5, 83886080, 73400320)
    warnings = [r.getMessage() for r in caplog.records if "qpid.flow_resume_count given without" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith('queue "q": ')


async def test_flow_transitions_are_logged_with_threshold_and_depth(running, ssn, caplog):
    caplog.set_level(logging.INFO, logger="qflow.broker")
    await ssn.declare_queue("orders", arguments={"qpid.flow_stop_count": 3, "qpid.flow_resume_count": 2})
    sender = ssn.sender("orders", capacity=10)
    for _ in range(4):
        await sender.send(b"x")
    await wait_for(lambda: sender.incomplete == 1)
    receiver = await ssn.receiver("orders", accept="auto")
    await drain(receiver, 3)
    with trio.fail_after(20):
        await sender.sync()
    lines = [r.getMessage() for r in caplog.records if "flow" in r.getMessage()]
    assert 'queue "orders": flow stopped (count 4 > 3)' in lines
    # The size unit takes part in resuming too: qpidd pre-fills its resume from the 100 MB default limit
    # (the old rule, where any flow key dropped the defaults, logged "(count 1 < 2)" alone).
    # One message left: 10 bytes ("" 1, "orders" 7, nil 1, body 1).
    assert 'queue "orders": flow resumed (count 1 < 2, bytes 10 < 73400320)' in lines
    assert len(lines) == 2  # never per message


async def test_worst_case_warning_once_when_it_exceeds_the_maximum(running, ssn, caplog):
    caplog.set_level(logging.WARNING, logger="qflow.broker")
    await ssn.declare_queue("q", arguments={"qpid.max_count": 120, "qpid.flow_stop_count": 100})
    sender = ssn.sender("q", capacity=50)
    for _ in range(3):
        await sender.send(b"x")
    await sender.sync()
    s = await stats(ssn, "q")
    assert s["worstCaseDepth"] == 150
    warnings = [r.getMessage() for r in caplog.records if "worst-case" in r.getMessage()]
    assert len(warnings) == 1 and "150" in warnings[0] and "qpid.max_count 120" in warnings[0]


async def test_flow_control_timeout_leaves_the_session_usable(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 1})
    sender = ssn.sender("q", capacity=1, flow_timeout=0.5, flow_notify=0.2)
    await sender.send(b"1")
    await sender.send(b"2")  # 2 > 1: held; the window is full now
    with pytest.raises(qflow.FlowControlTimeout):
        await sender.send(b"3")
    s = await stats(ssn, "q")
    assert s["msgDepth"] == 2  # the third message was not sent
    await ssn.declare_queue("other")  # the session still works


async def test_blocked_send_warns_every_notify_period(running, ssn, caplog):
    caplog.set_level(logging.WARNING, logger="qflow.client")
    await ssn.declare_queue("slowq", arguments={"qpid.flow_stop_count": 1})
    sender = ssn.sender("slowq", capacity=1, flow_timeout=1.0, flow_notify=0.3)
    await sender.send(b"1")
    await sender.send(b"2")
    with pytest.raises(qflow.FlowControlTimeout):
        await sender.send(b"3")
    warnings = [r.getMessage() for r in caplog.records if "delayed" in r.getMessage()]
    assert warnings and all("broker flow control: held by queue slowq" in w for w in warnings)


async def test_modify_with_both_stops_zero_turns_flow_control_off(running, ssn):
    await ssn.declare_queue("q", arguments={"qpid.flow_stop_count": 2, "qpid.flow_resume_count": 1})
    sender = ssn.sender("q", capacity=10)
    for _ in range(4):
        await sender.send(b"x")
    await wait_for(lambda: sender.incomplete == 2)
    # The change is resolved with the queue's arguments as a declare would be. {stop_count 0, resume_count 1}
    # leaves the count unit stop 0 / resume 1 and the size unit its pre-filled 80 MB / 70 MB: qpidd's
    # flow limit still exists, and 4 messages are not below the resume count of 1, so flow stays ON. (The
    # old rule dropped the resume count and turned flow off here.)
    s = await ssn.modify_queue("q", {"qpid.flow_stop_count": 0})
    assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopped"]) == (0, 1, True)
    assert s["arguments"]["qpid.flow_resume_count"] == 1
    assert sender.incomplete == 2
    # The manual: "disable flow control on a per queue basis by setting the flow-stop-size and
    # flow-stop-count to zero": no flow limit at all, flow OFF, the held transfers complete.
    s = await ssn.modify_queue("q", {"qpid.flow_stop_size": 0})
    assert (s["flowStopCount"], s["flowResumeCount"], s["flowStopSize"], s["flowResumeSize"]) == (0, 0, 0, 0)
    assert not s["flowStopped"]
    with trio.fail_after(20):
        await sender.sync()

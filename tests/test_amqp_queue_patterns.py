"""qflowd's --queue-patterns: "An unknown address is refused with
``amqp:not-found``, unless it matches ``--queue-patterns`` (qpidd's option
for queues created on demand)". Real qflowd processes, proton as the client.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import trio
from proton import Message
from proton.utils import BlockingConnection, LinkDetached

import qflow
from qflow.testing import Daemon, start

pytestmark = pytest.mark.native_only  # the protocol is the same whichever accounting; once is enough


@pytest.fixture
def qflowd(tmp_path: Any) -> Iterator[Daemon]:
    d = start("--queue-patterns", "qit.#", "--queue-patterns", "test.*", log=str(tmp_path / "qflowd.log"))
    try:
        yield d
    finally:
        d.stop()


def queues(d: Daemon) -> list[str]:
    async def main() -> list[str]:
        async with qflow.open_connection("127.0.0.1", d.port) as conn:
            return await (await conn.session()).list_queues()
    return trio.run(main)


def test_a_link_to_an_address_matching_a_pattern_creates_its_queue(qflowd: Daemon) -> None:
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        conn.create_sender("qit.test.uint.a.b").send(Message(body="kept"))
        receiver = conn.create_receiver("test.reply")  # a receiver creates one too
        conn.create_sender("test.reply").send(Message(body="back"))
        assert receiver.receive(timeout=10).body == "back"
        receiver.accept()
        receiver = conn.create_receiver("qit.test.uint.a.b")
        assert receiver.receive(timeout=10).body == "kept"  # the queue kept what was sent before
        receiver.accept()
    finally:
        conn.close()
    assert {"qit.test.uint.a.b", "test.reply"} <= set(queues(qflowd))
    assert "queue 'qit.test.uint.a.b' created on demand (--queue-patterns)" in qflowd.log()


@pytest.mark.parametrize("address", ["other", "qitx.a", "test.a.b", "test"])
def test_an_address_matching_no_pattern_is_still_not_found(qflowd: Daemon, address: str) -> None:
    conn = BlockingConnection(qflowd.address, timeout=20)
    try:
        with pytest.raises(LinkDetached, match="amqp:not-found"):
            conn.create_sender(address)
        with pytest.raises(LinkDetached, match="amqp:not-found"):
            conn.create_receiver(address)
    finally:
        conn.close()
    assert address not in queues(qflowd)


def test_the_acl_decides_who_may_create_on_demand(tmp_path: Any) -> None:
    from qflow.auth.users_file import SaslDb
    from qflow.protocol.sasl import make_verifier

    users = tmp_path / "users.json"
    db = SaslDb.open(str(users), missing_ok=True)
    db.users["alice"] = make_verifier("secret")
    db.users["bob"] = make_verifier("secret")
    db.save()
    acl = tmp_path / "qflowd.acl"
    acl.write_text("acl allow alice all all\nacl deny bob create queue\nacl allow bob all all\n")
    d = start("--sasl-db", str(users), "--acl-file", str(acl), "--queue-patterns", "qit.#",
              log=str(tmp_path / "qflowd.log"))
    try:
        conn = BlockingConnection(d.address, timeout=20, user="bob", password="secret", allowed_mechs="PLAIN")
        try:
            with pytest.raises(LinkDetached, match="amqp:unauthorized-access"):
                conn.create_sender("qit.bob")
        finally:
            conn.close()
        conn = BlockingConnection(d.address, timeout=20, user="alice", password="secret", allowed_mechs="PLAIN")
        try:
            conn.create_sender("qit.alice").send(Message(body="x"))
        finally:
            conn.close()
    finally:
        d.stop()

"""Access control lists (issue 16): the rules in units (qflow/broker/acl.py),
then real qflowd processes with ``--auth yes --acl-file``, the Python client
and the real tools with ``-b USER/PASS@HOST:PORT``. Each rule of
docs/security.md, "Access control lists", has its test here, by example.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

import qflow
from qflow.broker import Broker
from qflow.broker.acl import AclDenied, AclError, parse
from qflow.client.errors import NotAllowed, ResourceLocked
from qflow.protocol.ranges import RangeSet
from qflow.testing import Daemon, start
from tests.test_tools import DEADLINE, command, ok, refused, run

TIMEOUT = 60  # seconds: room for a slow machine, never a timing assertion

PAYMENTS_DENIED = "not allowed: alice publish exchange name=amq.default routingkey=payments"

ACL = r"""
# Who is who. A group may name groups defined above it.
group admins admin@QPID
group staff alice \
            bob
acl allow admins all
acl deny-log alice publish exchange name=amq.default routingkey=payments
acl allow bob all queue name=payments
acl allow bob publish exchange name=amq.default routingkey=payments
acl allow staff create queue name=tmp.* queuemaxsizeupperlimit=1000000
acl allow staff all queue name=tmp.*
acl allow staff publish exchange name=amq.default routingkey=tmp.*
acl allow staff access queue
acl allow-log staff access exchange
acl allow staff bind exchange name=amq.topic routingkey=news.*
acl deny all all
"""


# -- the rules, in units ------------------------------------------------------------------------


def test_the_first_matching_rule_decides_and_nothing_matching_is_denied():
    acl = parse("acl deny alice consume queue name=secret\nacl allow all consume queue\n")
    acl.check("alice", "consume", "queue", {"name": "public"})
    with pytest.raises(AclDenied, match="^not allowed: alice consume queue name=secret$"):
        acl.check("alice", "consume", "queue", {"name": "secret"})
    acl.check("bob", "consume", "queue", {"name": "secret"})
    # qpidd's implicit last rule is "acl deny all all".
    with pytest.raises(AclDenied, match="^not allowed: bob purge queue name=public$"):
        acl.check("bob", "purge", "queue", {"name": "public"})


def test_all_all_ends_the_list_and_later_lines_are_ignored():
    """"acl allow all all / acl deny user@QPID all all # This line is ignored" (the MRG manual)."""
    acl = parse("acl allow all all\nacl deny alice@QPID all all\n")
    assert len(acl.rules) == 1
    acl.check("alice", "delete", "queue", {"name": "q"})


def test_groups_continuations_comments_realms_and_wildcards():
    acl = parse("# comment\n\ngroup g1 alice@QPID \\\n   bob\ngroup g2 g1 carol\n"
                "acl allow g2 bind exchange name=amq.topic routingkey=stocks.#\n"
                "acl allow g1 create queue name=tmp.*\n")
    assert acl.groups["g2"] == {"alice", "bob", "carol"}
    # A rule's routingkey is a topic pattern, as in qpidd ('#' after a word is data, not a comment).
    for key in ("stocks.#", "stocks", "stocks.rht.x"):
        acl.check("carol", "bind", "exchange", {"name": "amq.topic", "queuename": "q", "routingkey": key})
    for key in ("#", "bonds.x", "stocksx"):
        with pytest.raises(AclDenied):
            acl.check("carol", "bind", "exchange", {"name": "amq.topic", "queuename": "q", "routingkey": key})
    acl.check("alice", "create", "queue", {"name": "tmp.x", "durable": False})
    with pytest.raises(AclDenied):
        acl.check("carol", "create", "queue", {"name": "tmp.x"})
    with pytest.raises(AclDenied):
        acl.check("alice", "create", "queue", {"name": "tmpx"})


def test_queue_limit_properties_bound_create_and_update():
    acl = parse("acl allow all create queue queuemaxsizeupperlimit=1000 queuemaxcountlowerlimit=10\n"
                "acl allow all update queue flowstopcountupperlimit=50\n")
    acl.check("u", "create", "queue", {"name": "q", "queuemaxsize": 1000, "queuemaxcount": 10})
    for request in ({"name": "q", "queuemaxsize": 1001, "queuemaxcount": 10},
                    {"name": "q", "queuemaxsize": 10, "queuemaxcount": 9},
                    {"name": "q"}):  # a limit rule matches only a request that names the limit
        with pytest.raises(AclDenied):
            acl.check("u", "create", "queue", request)
    acl.check("u", "update", "queue", {"name": "q", "flowstopcount": 50})
    with pytest.raises(AclDenied):
        acl.check("u", "update", "queue", {"name": "q", "flowstopcount": 51})


def test_an_allow_rule_out_of_its_limits_denies_as_in_qpidd():
    """qpidd demotes a matching allow rule whose limit check fails to a deny:
    the request does not fall through to the rules below."""
    acl = parse("acl allow-log all create queue name=tmp.* queuemaxcountupperlimit=100\nacl allow all all\n")
    acl.check("u", "create", "queue", {"name": "tmp.a", "queuemaxcount": 100})
    with pytest.raises(AclDenied, match="^not allowed: u create queue name=tmp.a queuemaxcount=101$"):
        acl.check("u", "create", "queue", {"name": "tmp.a", "queuemaxcount": 101})
    acl.check("u", "create", "queue", {"name": "tmp.a"})  # names no limit: the rule does not match


@pytest.mark.parametrize("text, line, message", [
    ("acl allow all all\nacl permit all all\n", 2, "permission must be one of"),
    ("\n\nacl allow alice eat queue\n", 3, "action must be all or one of"),
    ("acl allow alice consume link\n", 1, "object must be all or one of"),
    ("acl allow alice publish queue\n", 1, "action 'publish' does not apply to object 'queue'"),
    ("acl allow alice consume queue colour=red\n", 1, "unknown property 'colour'"),
    ("acl allow alice consume queue name\n", 1, "expected property=value"),
    ("acl allow alice create queue queuemaxsizeupperlimit=big\n", 1, "must be a whole number"),
    ("acl allow alice create queue durable=maybe\n", 1, "must be true or false"),
    ("group g alice\ngroup g bob\n", 2, "defined twice"),
    ("group g\n", 1, "expected 'group NAME MEMBER...'"),
    ("group g alice \\\n\\\n bob\n", 2, "empty continuation"),
    ("acl allow alice all queue \\\n", 1, "ends with '\\'"),
    ("allow alice all\n", 1, "expected 'acl' or 'group'"),
    ("acl allow alice\n", 1, "expected 'acl PERMISSION"),
])
def test_a_bad_file_is_refused_with_its_line_number(text, line, message):
    with pytest.raises(AclError) as info:
        parse(text)
    assert info.value.line == line
    assert str(info.value).startswith(f"line {line}: ") and message in str(info.value)


def test_no_acl_costs_nothing_on_the_per_message_path():
    """Without an ACL the broker's transfer is the class's own method: no check
    at all; with one, the checking one (decided once per exchange and key)."""
    broker = Broker()
    assert "transfer" not in vars(broker)
    broker.set_acl(parse("acl allow all all\n"))
    assert vars(broker)["transfer"] == broker._checked_transfer
    broker.set_acl(None)
    assert "transfer" not in vars(broker)


# -- real qflowd ------------------------------------------------------------------------------


PASSWORDS = {"alice": "alice-pw", "bob": "bob-pw", "admin": "admin-pw"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    where = tmp_path_factory.mktemp("acl")
    db = where / "users.json"
    for user, password in PASSWORDS.items():
        ok(run("qflow-passwd", "--sasl-db", str(db), "--iterations", "4096", user, stdin=password + "\n"))
    acl = where / "broker.acl"
    acl.write_text(ACL)
    return db, acl


def start_acl_broker(db: Path, acl: Path) -> Daemon:
    fd, log = tempfile.mkstemp(prefix="qflowd-acl-", suffix=".log")
    os.close(fd)
    return start("--auth", "yes", "--sasl-db", str(db), "--acl-file", str(acl), "--no-data-dir", log=log)


@pytest.fixture
def daemon(setup: tuple[Path, Path]) -> Iterator[Daemon]:
    db, acl = setup
    acl.write_text(ACL)
    d = start_acl_broker(db, acl)
    try:
        yield d
    finally:
        d.stop()


def connect(d: Daemon, user: str) -> Any:
    return qflow.open_connection("127.0.0.1", d.port, username=user, password=PASSWORDS[user])


def mgmt(d: Daemon, method: str, path: str, user: str | None, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{d.mgmt_port}{path}", data=data, method=method)
    request.add_header("Content-Type", "application/json")  # a change must say JSON (the management guard)
    if user is not None:
        token = base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def depth(d: Daemon, name: str) -> int:
    status, view = mgmt(d, "GET", f"/api/queues/{name}", "admin")
    assert status == 200, view
    return view["msgDepth"]


async def test_a_denied_publish_fails_with_530_saying_what_and_harms_nothing(daemon):
    """"A denied operation fails with an error that says what was denied ("not
    allowed: alice publish exchange name=amq.default routingkey=payments").
    Nothing changes, the broker and the other clients are unaffected, and the
    session stays usable"; deny-log writes a log line."""
    d = daemon
    with trio.fail_after(TIMEOUT):
        async with connect(d, "bob") as bob_conn, connect(d, "alice") as alice_conn:
            bob = await bob_conn.session()
            await bob.declare_queue("payments")
            bob_sender = bob.sender("payments")
            alice = await alice_conn.session()
            sender = alice.sender("payments")
            with pytest.raises(NotAllowed) as info:
                await sender.send_many([b"steal"] * 200)  # many frames: the run path is checked too
                await sender.sync()
            assert info.value.code == 530 and info.value.text == PAYMENTS_DENIED
            assert depth(d, "payments") == 0
            # The same session carries on with what it may do.
            await alice.declare_queue("tmp.alice")
            mine = alice.sender("tmp.alice")
            await mine.send_many([b"a"] * 100)
            await mine.sync()
            receiver = await alice.receiver("tmp.alice")
            assert (await receiver.fetch(timeout=TIMEOUT)).body == b"a"
            # Bob, on the same broker, publishes and reads his queue in runs.
            await bob_sender.send_many([b"pay"] * 300)
            await bob_sender.sync()
            assert depth(d, "payments") == 300
            bob_receiver = await bob.receiver("payments")
            assert (await bob_receiver.fetch(timeout=TIMEOUT)).body == b"pay"
    # deny-log: one line, though 200 transfers were refused (decided once per session, exchange and key)
    assert d.log().count(f"ACL denied (line 7): {PAYMENTS_DENIED[len('not allowed: '):]}") == 1


async def test_every_command_is_checked_as_its_action(daemon):
    """consume, purge, delete, bind, create (with the queue-limit properties),
    access: each refused with 530 and what was denied, the session usable."""
    d = daemon
    with trio.fail_after(TIMEOUT):
        async with connect(d, "bob") as bob_conn, connect(d, "alice") as alice_conn:
            bob = await bob_conn.session()
            await bob.declare_queue("payments")
            alice = await alice_conn.session()
            refusals = [
                (alice.receiver("payments"), "alice consume queue name=payments"),
                (alice.available("payments"), "alice consume queue name=payments"),  # a browsing reader's plan
                (alice.remove_sequences("payments", "any", RangeSet([(1, 1)])),  # ... and its commit
                 "alice consume queue name=payments"),
                (alice.purge_queue("payments"), "alice purge queue name=payments"),
                (alice.delete_queue("payments"), "alice delete queue name=payments"),
                (alice.declare_queue("mine"), "alice create queue name=mine durable=false autodelete=false "
                                              "exclusive=false"),
                (alice.declare_queue("tmp.big", arguments={"qpid.max_size": 2_000_000}),
                 "alice create queue name=tmp.big durable=false autodelete=false exclusive=false "
                 "queuemaxsize=2000000"),
                (alice.bind("amq.topic", "tmp.spy", "#"),
                 "alice bind exchange name=amq.topic queuename=tmp.spy routingkey=#"),
                (alice.declare_exchange("x"), "alice create exchange name=x type=direct durable=false"),
                (alice.modify_queue("payments", {"qpid.max_count": 1}),
                 "alice update queue name=payments queuemaxcount=1"),
            ]
            for call, what in refusals:
                with pytest.raises(NotAllowed) as info:
                    await call
                assert info.value.text == f"not allowed: {what}"
            await alice.declare_queue("tmp.spy", arguments={"qpid.max_size": 1_000_000})
            await alice.bind("amq.topic", "tmp.spy", "news.today")
            assert (await alice.query_queue("payments"))["msgDepth"] == 0  # access queue is allowed
            status, view = mgmt(d, "GET", "/api/queues/payments", "admin")
            assert status == 200 and view["consumerCount"] == 0 and view["arguments"] == {}


async def test_an_exclusive_queue_is_its_owners_alone_even_for_an_admin(daemon):
    """"Exclusive queues can be used only by the connection that owns them":
    admin, whom the ACL allows everything, is refused (405, resource-locked)
    on the wire and 409 on the management API."""
    d = daemon
    with trio.fail_after(TIMEOUT):
        async with connect(d, "bob") as bob_conn, connect(d, "admin") as admin_conn:
            bob = await bob_conn.session()
            await bob.declare_queue("tmp.excl", exclusive=True)
            await bob.sender("tmp.excl").send(b"private")
            admin = await admin_conn.session()
            for call in (admin.receiver("tmp.excl"), admin.purge_queue("tmp.excl"), admin.delete_queue("tmp.excl"),
                         admin.bind("amq.direct", "tmp.excl", "k"), admin.modify_queue("tmp.excl", {"qpid.max_count": 9}),
                         admin.remove_through("tmp.excl", 10), admin.available("tmp.excl"),
                         admin.remove_sequences("tmp.excl", "any", RangeSet([(1, 1)])), admin.declare_queue("tmp.excl")):
                with pytest.raises(ResourceLocked, match="exclusive to another session"):
                    await call
            for method, path, body in (("DELETE", "/api/queues/tmp.excl", None),
                                       ("POST", "/api/queues/tmp.excl/purge", None),
                                       ("PATCH", "/api/queues/tmp.excl", {"arguments": {"qpid.max_count": 9}}),
                                       ("POST", "/api/bindings", {"exchange": "amq.direct", "queue": "tmp.excl"})):
                status, answer = mgmt(d, method, path, "admin", body)
                assert status == 409 and "exclusive to another session" in answer["error"], (method, path, answer)
            assert depth(d, "tmp.excl") == 1
            receiver = await bob.receiver("tmp.excl")
            assert (await receiver.fetch(timeout=TIMEOUT)).body == b"private"


def test_the_management_api_is_checked_as_the_same_actions(daemon):
    d = daemon
    assert mgmt(d, "PUT", "/api/queues/tmp.m", "alice", {"arguments": {"qpid.max_size": 1000}})[0] == 201
    for method, path, body, what in (
        ("PUT", "/api/queues/other", {}, "alice create queue name=other durable=false autodelete=false "
                                          "exclusive=false"),
        ("DELETE", "/api/queues/tmp.m", None, None),  # allowed: tmp.* is alice's
        ("PUT", "/api/exchanges/x", {"type": "topic"}, "alice create exchange name=x type=topic durable=false"),
        ("POST", "/api/bindings", {"exchange": "amq.topic", "queue": "q", "key": "#"},
         "alice bind exchange name=amq.topic queuename=q routingkey=#"),
        ("GET", "/api/broker", None, "alice access broker"),
        ("GET", "/metrics", None, "alice access broker"),
        ("POST", "/api/acl/reload", None, "alice update broker"),
        ("PUT", "/api/broker/log-level", {"level": "debug"}, "alice update broker"),
        ("GET", "/api/broker/log-level", None, "alice access broker"),
    ):
        if what is None:
            assert mgmt(d, method, path, "alice", body)[0] == 200
            continue
        status, answer = mgmt(d, method, path, "alice", body)
        assert (status, answer) == (403, {"error": f"not allowed: {what}"}), (method, path)
    assert mgmt(d, "GET", "/api/broker", "admin")[0] == 200
    assert mgmt(d, "GET", "/api/broker", "admin")[1]["options"]["aclFile"].endswith("broker.acl")


async def test_connections_show_other_users_only_to_access_broker(daemon):
    """"/api/connections shows other users' connections only to users the ACL allows access broker"."""
    d = daemon
    with trio.fail_after(TIMEOUT):
        async with connect(d, "bob") as bob_conn, connect(d, "alice") as alice_conn:
            await bob_conn.session()
            await alice_conn.session()
            status, views = mgmt(d, "GET", "/api/connections", "alice")
            assert status == 200 and {v["user"] for v in views} == {"alice"}
            status, views = mgmt(d, "GET", "/api/connections", "admin")
            assert status == 200 and {v["user"] for v in views} == {"alice", "bob"}


def test_the_tools_with_credentials_are_checked(daemon):
    d = daemon
    url = lambda user: f"{user}/{PASSWORDS[user]}@127.0.0.1:{d.port}"  # noqa: E731
    mgmt_url = lambda user: f"{user}/{PASSWORDS[user]}@127.0.0.1:{d.port}"  # noqa: E731
    ok(run("qflow-config", "-b", mgmt_url("bob"), "add", "queue", "payments"))
    ok(run("qflow-send", "-b", url("bob"), "-a", "payments", "--messages", "3", "--content-string", "p"))
    refused(run("qflow-send", "-b", url("alice"), "-a", "payments", "--messages", "3"), 1, PAYMENTS_DENIED)
    refused(run("qflow-receive", "-b", url("alice"), "-a", "payments", "--timeout", "5"), 1,
            "not allowed: alice consume queue name=payments")
    refused(run("qflow-config", "-b", mgmt_url("alice"), "purge", "queue", "payments"), 1,
            "Failed: not allowed: alice purge queue name=payments")
    refused(run("qflow-config", "-b", mgmt_url("alice"), "del", "queue", "payments", "--force"), 1,
            "Failed: not allowed: alice delete queue name=payments")
    assert "payments" in ok(run("qflow-config", "-b", mgmt_url("alice"), "queues"))  # access queue: allowed
    assert ok(run("qflow-receive", "-b", url("bob"), "-a", "payments", "--messages", "3",
                  "--timeout", "30")).split() == ["p", "p", "p"]


async def test_reload_puts_new_rules_in_force_and_a_bad_file_keeps_the_old(daemon, setup):
    """"The file is reloaded by a management call; a bad file is refused, with
    its line number, and the old rules stay." A session's remembered publish
    decisions are forgotten on reload."""
    d = daemon
    _db, acl = setup
    with trio.fail_after(TIMEOUT):
        async with connect(d, "bob") as bob_conn:
            bob = await bob_conn.session()
            await bob.declare_queue("payments")
            sender = bob.sender("payments")
            await sender.send(b"1")
            await sender.sync()
            admin_url = f"admin/{PASSWORDS['admin']}@127.0.0.1:{d.port}"
            # A bad file: refused naming its line; the old rules stay.
            acl.write_text("group admins admin\nacl allow admins all\nacl allow bob publish queue\n")
            refused(run("qflow-config", "-b", admin_url, "reload-acl"), 1,
                    "line 3: action 'publish' does not apply to object 'queue'")
            await sender.send(b"2")
            await sender.sync()
            # A good one: bob may no longer publish there, from his very next message on.
            acl.write_text("group admins admin\nacl allow admins all\nacl allow bob access queue\n"
                           "acl deny-log bob publish exchange name=amq.default routingkey=payments\n")
            ok(run("qflow-config", "-b", admin_url, "reload-acl"))
            with pytest.raises(NotAllowed, match="not allowed: bob publish exchange name=amq.default "
                                                 "routingkey=payments"):
                await sender.send(b"3")
                await sender.sync()
            assert depth(d, "payments") == 2
            status, answer = mgmt(d, "POST", "/api/acl/reload", "admin")
            assert status == 200 and answer["rules"] == 3 and answer["groups"] == 1


def qflowd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command("qflowd") + ["--port", "0", "--mgmt-port", "0", "--no-data-dir", *args],
                          capture_output=True, text=True, timeout=DEADLINE, stdin=subprocess.DEVNULL)


def test_qflowd_refuses_a_bad_acl_file_at_start_naming_the_line(tmp_path):
    bad = tmp_path / "bad.acl"
    bad.write_text("acl allow all consume queue\n\nacl allow all purge queue flavour=x\n")
    result = qflowd("--acl-file", str(bad))
    assert result.returncode == 1, result
    assert f"qflowd: --acl-file {bad}: line 3: unknown property 'flavour'" in result.stderr
    assert "Traceback" not in result.stderr
    result = qflowd("--acl-file", str(tmp_path / "missing.acl"))
    assert result.returncode == 1 and "cannot read --acl-file" in result.stderr, result


def test_reload_without_an_acl_file_is_refused():
    d = start("--no-data-dir")
    try:
        status, answer = mgmt(d, "POST", "/api/acl/reload", None)
        assert status == 409 and "--acl-file" in answer["error"]
    finally:
        d.stop()


def test_management_lists_show_only_what_the_user_may_access():
    """GET lists are filtered by ``access`` on each object; a single object not
    allowed is a 403 naming it; without an ACL, everything shows."""
    from qflow.management import ManagementApi

    broker = Broker()
    for name in ("carol.a", "secret"):
        broker.declare_queue(name)
    broker.bind("amq.topic", "secret", "s")
    api = ManagementApi(broker)

    def get(path: str, user: str) -> tuple[int, Any]:
        response = api.handle("GET", path.encode(), b"", user)
        return response.status, json.loads(response.body)

    assert {q["name"] for q in get("/api/queues", "carol")[1]} == {"carol.a", "secret"}
    broker.set_acl(parse("acl allow carol access queue name=carol.*\nacl allow carol access exchange name=amq.d*\n"))
    assert [q["name"] for q in get("/api/queues", "carol")[1]] == ["carol.a"]
    assert get("/api/queues/secret", "carol") == (403, {"error": "not allowed: carol access queue name=secret"})
    assert {e["name"] for e in get("/api/exchanges", "carol")[1]} == {"", "amq.direct"}
    assert get("/api/bindings", "carol")[1] == []
    assert get("/api/connections", "carol") == (200, [])
    assert get("/api/subscriptions", "carol") == (200, [])
    assert get("/api/broker", "carol") == (403, {"error": "not allowed: carol access broker"})


async def test_with_auth_no_clients_are_anonymous_or_who_they_say(tmp_path):
    """With --auth no, an ANONYMOUS client and a management request without
    credentials are the user ``anonymous``; a named user is believed."""
    acl = tmp_path / "open.acl"
    acl.write_text("acl allow anonymous access queue\nacl allow anonymous create queue name=anon.*\n"
                   "acl allow carol all all\nacl deny all all\n")
    d = start("--auth", "no", "--acl-file", str(acl), "--no-data-dir")
    try:
        with trio.fail_after(TIMEOUT):
            async with qflow.open_connection("127.0.0.1", d.port) as conn:
                ssn = await conn.session()
                await ssn.declare_queue("anon.q")
                with pytest.raises(NotAllowed, match=r"^not allowed: anonymous purge queue name=anon\.q \(code 530\)$"):
                    await ssn.purge_queue("anon.q")
            async with qflow.open_connection("127.0.0.1", d.port, username="carol", password="x") as conn:
                await (await conn.session()).purge_queue("anon.q")
        assert mgmt(d, "GET", "/api/queues/anon.q", None)[0] == 200
        assert mgmt(d, "DELETE", "/api/queues/anon.q", None) == (
            403, {"error": "not allowed: anonymous delete queue name=anon.q"})
    finally:
        d.stop()


async def test_queue_list_names_only_the_queues_a_user_may_access(setup, tmp_path):
    """queue.list (a Spark source's queuePattern asks it) is checked per
    queue as "access queue": a queue the user may not access is left out,
    not refused, so a pattern never reveals it."""
    db, _ = setup
    acl = tmp_path / "broker.acl"
    acl.write_text(ACL.replace("acl allow staff access queue\n",
                               "acl deny alice access queue name=payments\nacl allow staff access queue\n"))
    d = start_acl_broker(db, acl)
    try:
        with trio.fail_after(TIMEOUT):
            async with connect(d, "bob") as bob_conn, connect(d, "alice") as alice_conn:
                bob = await bob_conn.session()
                await bob.declare_queue("payments")
                await bob.declare_queue("tmp.orders")
                alice = await alice_conn.session()
                assert "payments" not in await alice.list_queues()
                assert "tmp.orders" in await alice.list_queues()
                assert {"payments", "tmp.orders"} <= set(await bob.list_queues())
                with pytest.raises(NotAllowed):
                    await alice.query_queue("payments")
    finally:
        d.stop()
